"""The elastic policies, the straggler rule and the log, on made-up windows (no Ray)."""

from __future__ import annotations

import pytest

from orion_par.elastic import (
    Controller,
    Decision,
    Elastic,
    ElasticError,
    ElasticLog,
    Event,
    FixedSchedule,
    ScalingEfficiency,
    Stragglers,
    UtilityCost,
    Window,
)


def _w(index, workers, throughput, per_worker=None, progress=None, elapsed=1.0):
    per = per_worker if per_worker is not None else (throughput / workers,) * workers
    return Window(index, float(index), elapsed, workers, throughput * elapsed, tuple(per), progress)


def test_scaling_efficiency_grows_while_workers_pay_and_goes_back_when_they_do_not():
    p = ScalingEfficiency(max_workers=16, threshold=0.5)
    h = [_w(0, 1, 100.0)]
    assert p.decide(h).workers == 2
    h.append(_w(1, 2, 50.0))  # warm-up
    assert p.decide(h) is None
    h.append(_w(1, 2, 190.0))  # s = 90 / 100 = 0.9
    d = p.decide(h)
    assert d.workers == 4 and "scaling efficiency 0.90" in d.reason
    h += [_w(2, 4, 0.0), _w(2, 4, 250.0)]  # s = (250 - 190) / 2 / 95 = 0.32 < 0.5
    d = p.decide(h)
    assert d.workers == 2 and "back to 2" in d.reason
    h += [_w(3, 2, 190.0), _w(3, 2, 190.0)]
    assert p.decide(h) is None  # settled


def test_scaling_efficiency_bounds_its_steps_and_the_count():
    p = ScalingEfficiency(max_workers=6, max_step=2, threshold=0.1)
    h = [_w(0, 4, 400.0)]
    assert p.decide(h).workers == 6  # 4 + max_step
    h += [_w(1, 6, 600.0), _w(2, 6, 600.0)]
    assert p.decide(h) is None  # at max_workers: stays


def test_measure_waits_for_enough_windows_and_drops_the_warm_up_after_a_change():
    p = ScalingEfficiency(max_workers=8, measure=2)
    h = [_w(0, 1, 100.0)]
    assert p.decide(h) is None
    h.append(_w(1, 1, 100.0))  # the starting count has no warm-up window
    assert p.decide(h).workers == 2
    h += [_w(2, 2, 20.0), _w(3, 2, 200.0)]  # window 2: the new worker's warm-up, not counted
    assert p.decide(h) is None
    h.append(_w(4, 2, 200.0))
    assert p.decide(h).workers == 4  # measured on windows 3 and 4: s = 1.0


def test_utility_cost_stops_where_a_worker_costs_more_than_it_brings():
    # utility = progress (e.g. epochs done); each worker costs 1 unit a second.
    p = UtilityCost(max_workers=8, utility=lambda x: 100 * x, cost_per_worker_s=1.0, warmup=0)
    h = [_w(0, 1, 1.0, progress=0.0), _w(1, 1, 1.0, progress=0.1)]  # gain 10/s - 1 = 9
    assert p.decide(h).workers == 2
    h.append(_w(2, 2, 1.0, progress=0.25))  # gain 15/s - 2 = 13: better
    assert p.decide(h).workers == 4
    h.append(_w(3, 4, 1.0, progress=0.3))  # gain 5/s - 4 = 1: worse
    d = p.decide(h)
    assert d.workers == 2 and "net utility rate" in d.reason
    with pytest.raises(ElasticError, match="progress measure"):
        UtilityCost(utility=float).decide([_w(0, 1, 1.0)])


def test_stragglers_replaces_a_slow_worker_after_patience_windows():
    rule = Stragglers(fraction=0.5, patience=2, alpha=1.0)
    assert rule.observe(_w(0, 3, 300.0, (100.0, 30.0, 100.0))) == ((), "")
    slots, why = rule.observe(_w(1, 3, 300.0, (100.0, 30.0, 100.0)))
    assert slots == (1,) and "worker 1" in why
    assert rule.observe(_w(2, 3, 300.0, (100.0, 100.0, 100.0))) == ((), "")  # a fresh average for the new one
    rule = Stragglers(fraction=0.5, patience=2, alpha=1.0)
    rule.observe(_w(0, 3, 300.0, (100.0, 30.0, 100.0)))
    assert rule.observe(_w(1, 3, 300.0, (100.0, 80.0, 100.0))) == ((), "")  # back above the line: count restarts


def test_fixed_schedule_and_controller_combine_counts_and_replacements():
    ctl = Controller(Elastic(FixedSchedule({2: 3}, replace={1: (0,)}), stragglers=None))
    assert ctl.observe(_w(0, 2, 1.0)) == Decision(2, (0,), "fixed schedule at window 1")
    assert ctl.observe(_w(1, 2, 1.0)).workers == 3
    assert ctl.observe(_w(2, 3, 1.0)) is None
    assert FixedSchedule({2: 3, 5: 1}).max_workers == 3  # a driver that starts Ray sizes it for 3


def test_log_counts_worker_seconds_and_replays_as_a_schedule():
    log = ElasticLog([_w(0, 1, 10.0), _w(1, 2, 10.0), _w(2, 2, 10.0)],
                     [Event("resize", 1, 1.0, 1, 2, (), "try", 0.0, 10.0, started_s=0.5)])
    # windows end at 1, 2, 3 s: 1 x 1 + 2 x 1 + 2 x 1, plus the new actor's 0.5 s of start-up
    assert log.worker_seconds() == pytest.approx(5.5)
    assert log.worker_seconds(until_s=2.0) == pytest.approx(3.5)
    assert log.as_schedule() == FixedSchedule({1: 2}, {})
    assert "resize 1 -> 2" in log.describe()


def test_bad_configurations_are_refused_with_the_fix():
    with pytest.raises(ElasticError, match="min_workers"):
        ScalingEfficiency(max_workers=0)
    with pytest.raises(ElasticError, match="fraction"):
        Stragglers(fraction=1.5)
    with pytest.raises(ElasticError, match="asked for 0 workers"):
        Controller(Elastic(FixedSchedule({1: 0}))).observe(_w(0, 1, 1.0))
    with pytest.raises(ElasticError, match=r"window=0\): a window is a whole number >= 1"):
        Elastic(FixedSchedule({}), window=0)
    with pytest.raises(ElasticError, match="giving 0 at 1"):
        Elastic(FixedSchedule({}), window=lambda workers: workers // 2).window_for(1)


def test_windows_can_follow_the_worker_count():
    elastic = Elastic(FixedSchedule({}), window=lambda workers: max(1, workers // 2))
    assert [elastic.window_for(k) for k in (1, 2, 4, 8)] == [1, 1, 2, 4]
    assert Elastic(FixedSchedule({}), window=3).window_for(8) == 3
