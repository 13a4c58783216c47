"""Elastic parallel_for on Ray: resizing, replacing and killing workers mid-run changes no value.

Every elastic run is compared bit for bit with the serial run in the order it reports
(``RunStats.elastic.serial_order()``) and with the same allocation sequence carried out by
checkpoint-and-restart (``Elastic(restart=True)``).
"""

from __future__ import annotations

import numpy as np
import pytest

from orion_par import Buffer, DistArray, parallel_for
from orion_par.elastic import (
    Elastic,
    ElasticError,
    Emulation,
    FixedSchedule,
    ScalingEfficiency,
    Stragglers,
)

ray = pytest.importorskip("ray", reason="ray is not installed (pip install ray==2.60.0)")


RAY_CPUS = 4  # ray_session's (tests/orion_par/conftest.py): room for actors started beside others


def _mf(n=6000, users=60, items=25, seed=0):
    rng = np.random.default_rng(seed)
    keys = np.stack([rng.integers(0, users, n), rng.integers(0, items, n)], axis=1)
    W = DistArray(rng.random((users, 3)))
    H = DistArray(rng.random((items, 3)))

    @parallel_for(DistArray.from_coo(keys, rng.random(n)))
    def sgd(key, value):
        u, i = key
        err = value
        for r in range(3):
            err -= W[u, r] * H[i, r]
        for r in range(3):
            wr = W[u, r]
            W[u, r] += 0.02 * err * H[i, r]
            H[i, r] += 0.02 * err * wr
        return err * err

    return sgd, [W, H]


def _counts(n=5000, seed=3):
    rng = np.random.default_rng(seed)
    keys = np.stack([rng.integers(0, 50, n), rng.integers(0, 30, n)], axis=1)
    C = DistArray(np.zeros((50, 4)))

    @parallel_for(DistArray.from_coo(keys, rng.random(n)))
    def body(key, value):
        u = key[0]
        for r in range(4):
            C[u, r] = 0.5 * C[u, r] + value * (r + 1)

    return body, [C]


def _elastic_run(fn, arrays, start, elastic, workers, epochs, time_partitions=None):
    for a, s in zip(arrays, start, strict=True):
        a[...] = s
    fn.epochs_run = 0
    stats = fn.run(workers=workers, epochs=epochs, backend="ray", elastic=elastic, time_partitions=time_partitions)
    return stats, [a.copy() for a in arrays]


def _serial(fn, arrays, start, order):
    for a, s in zip(arrays, start, strict=True):
        a[...] = s
    fn.run_serial(order=order)
    return [a.copy() for a in arrays]


@pytest.mark.slow
@pytest.mark.parametrize("build, scheme", [(_mf, "2d"), (_counts, "1d")])
def test_resizing_mid_epoch_equals_serial_order_and_checkpoint_restart(ray_session, build, scheme):
    fn, arrays = build()
    assert fn.plan.scheme == scheme
    start = [a.copy() for a in arrays]
    policy = {1: 3, 3: 2, 6: 4, 8: 1}  # windows of 2 steps: some changes fall mid-epoch, one at its end
    stats, got = _elastic_run(fn, arrays, start, Elastic(FixedSchedule(policy), window=2, background=False), 2, 3)
    log = stats.elastic
    assert [(e.workers_before, e.workers_after) for e in log.events] == [(2, 3), (3, 2), (2, 4), (4, 1)]
    assert len({w for _, w, _ in log.allocations()}) == 4
    assert any(e < 2 and a != 6000 and a != 5000 for e, _, a in log.allocations())  # a transition mid-epoch
    order = log.serial_order()
    assert np.array_equal(np.sort(order), np.sort(np.tile(np.arange(fn.data.num_records), 3)))  # each record once per epoch
    for a, b in zip(got, _serial(fn, arrays, start, order), strict=True):
        assert np.array_equal(a, b)
    restarted, again = _elastic_run(fn, arrays, start, Elastic(FixedSchedule(policy), window=2, restart=True), 2, 3)
    assert restarted.elastic.allocations() == log.allocations()
    for a, b in zip(got, again, strict=True):
        assert np.array_equal(a, b)
    assert restarted.accumulated == stats.accumulated
    assert all(r.idle_s > 0 for r in restarted.elastic.events)


def test_no_transition_equals_the_plain_ray_run(ray_session):
    fn, arrays = _mf()
    start = [a.copy() for a in arrays]
    stats, got = _elastic_run(fn, arrays, start, Elastic(FixedSchedule({}), window=3), 2, 2)
    assert not stats.elastic.events
    for a, s in zip(arrays, start, strict=True):
        a[...] = s
    fn.epochs_run = 0
    plain = fn.run(workers=2, epochs=2, backend="ray")
    for a, b in zip(got, arrays, strict=True):
        assert np.array_equal(a, b)
    assert plain.returned == stats.returned
    fn.close()


def test_autoscaler_with_background_starts_is_replayed_exactly_by_checkpoint_restart(ray_session):
    fn, arrays = _mf(n=12000, users=120, items=50)
    start = [a.copy() for a in arrays]
    elastic = Elastic(ScalingEfficiency(max_workers=4, threshold=0.0), window=1,
                      emulation=Emulation(seconds_per_unit=5e-5))  # 0.15 s a step on one worker
    stats, got = _elastic_run(fn, arrays, start, elastic, 1, 4, time_partitions=4)
    log = stats.elastic
    assert log.events and log.events[0].workers_after == 2  # threshold 0: any gain grows the job
    for a, b in zip(got, _serial(fn, arrays, start, log.serial_order()), strict=True):
        assert np.array_equal(a, b)
    replay = Elastic(log.as_schedule(), window=1, restart=True)
    restarted, again = _elastic_run(fn, arrays, start, replay, 1, 4, time_partitions=4)
    assert restarted.elastic.allocations() == log.allocations()
    for a, b in zip(got, again, strict=True):
        assert np.array_equal(a, b)


def test_a_new_count_mid_epoch_partitions_the_rest_of_the_epoch_for_it(ray_session):
    """Growing 2 -> 4 mid-epoch with background starts: the transition waits a window (the rest is partitioned
    then), the rest's blocks are balanced over the 4 workers, and the result is the serial order's."""
    fn, arrays = _mf(n=12000, users=120, items=50)
    start = [a.copy() for a in arrays]
    elastic = Elastic(FixedSchedule({2: 4}), window=1, emulation=Emulation(seconds_per_unit=1e-3))
    stats, got = _elastic_run(fn, arrays, start, elastic, 2, 1, time_partitions=16)  # 16 steps of 0.375 s
    log = stats.elastic
    (event,) = log.events
    assert event.workers_after == 4 and event.window >= 3  # decided after window 1, partitioned during window 2
    first, rest = log.segments
    done = first.steps_records(0, first.last_step)
    assert np.array_equal(np.sort(np.concatenate([done, rest.records])), np.arange(12000))
    assert rest.sched.num_workers == 4 and rest.records.size == rest.sched.perm.size
    sizes = rest.sched.worker_sizes()
    assert sizes.max() <= 1.25 * sizes.mean()  # (the whole-epoch schedule's blocks would be partly done)
    for a, b in zip(got, _serial(fn, arrays, start, log.serial_order()), strict=True):
        assert np.array_equal(a, b)


def test_killing_a_worker_during_a_resize_changes_nothing(ray_session):
    fn, arrays = _mf()
    start = [a.copy() for a in arrays]
    policy = FixedSchedule({2: 3, 5: 2})
    clean, want = _elastic_run(fn, arrays, start, Elastic(policy, window=2, background=False), 2, 2)
    killed = []

    def kill(point, window, actors):
        if point == "transition" and window == 2 and not killed:
            ray.kill(actors[0])  # mid-resize: the new actor is started, the old ones not yet loaded
            killed.append(window)

    stats, got = _elastic_run(fn, arrays, start, Elastic(policy, window=2, background=False, fault=kill), 2, 2)
    assert killed and stats.elastic.recoveries >= 1
    assert stats.elastic.allocations() == clean.elastic.allocations()
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a, b)


def test_a_slow_worker_is_replaced_and_values_match_the_serial_order(ray_session):
    fn, arrays = _counts(n=20000)
    start = [a.copy() for a in arrays]
    elastic = Elastic(FixedSchedule({}), window=2, stragglers=Stragglers(fraction=0.5, patience=2),
                      emulation=Emulation(seconds_per_unit=2e-5, slow={1: 3.0}), background=False)
    stats, got = _elastic_run(fn, arrays, start, elastic, 3, 3)
    replaced = [e for e in stats.elastic.events if e.replaced]
    assert replaced and replaced[0].replaced == (1,), stats.elastic.describe()
    assert "below 0.5 x the others' median" in replaced[0].reason
    later = [w for w in stats.elastic.windows if w.index > replaced[0].window + 1]
    if later:  # the fresh actor runs at full speed
        assert min(later[-1].per_worker) > 0.5 * max(later[-1].per_worker)
    for a, b in zip(got, _serial(fn, arrays, start, stats.elastic.serial_order()), strict=True):
        assert np.array_equal(a, b)


def test_bad_elastic_arguments_say_what_to_do(ray_session):
    fn, _ = _mf(n=500)
    with pytest.raises(ElasticError, match="backend='ray'"):
        fn.run(workers=2, elastic=Elastic(FixedSchedule({})))
    with pytest.raises(ElasticError, match="pass an orion_par.elastic.Elastic"):
        fn.run(workers=2, backend="ray", elastic=4)
    with pytest.raises(ElasticError, match="window is a whole number"):
        Elastic(FixedSchedule({}), window=0)
    totals = Buffer(np.zeros(3), max_delay=2)
    rng = np.random.default_rng(0)

    @parallel_for(DistArray.from_coo(rng.integers(0, 5, (50, 2)), rng.random(50)))
    def body(key, value):
        totals[key[1] % 3] += value

    with pytest.raises(ElasticError, match="merged additively"):
        body.run(workers=2, backend="ray", elastic=Elastic(FixedSchedule({})))
