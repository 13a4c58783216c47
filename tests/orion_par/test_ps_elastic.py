"""Elastic parameter server: resizing and replacing Ray workers at clock boundaries, exactly."""

from __future__ import annotations

import numpy as np
import pytest

from orion_par.elastic import Elastic, ElasticError, Emulation, FixedSchedule, Stragglers
from orion_par.ps import BoundedStalenessServer, Checkpoint, LocalPS, PSError, TableSpec
from orion_par.ps.param_server import ShardState


@pytest.fixture
def ray_ps(ray_session):
    from orion_par.ps.ray_transport import RayPS

    made = []

    def build(*args, **kwargs):
        ps = RayPS(*args, **kwargs)
        made.append(ps)
        return ps

    yield build
    for ps in made:
        ps.close()


# -- the server's membership logic, no transport ------------------------------------------------------
def test_resize_only_at_a_clock_boundary():
    srv = BoundedStalenessServer([TableSpec("t", 2, 1, staleness=0)], num_workers=2)
    srv.tick(0)
    with pytest.raises(PSError, match=r"resize needs every worker at the same clock.*\[1, 0\]"):
        srv.resize(3)
    det = BoundedStalenessServer([TableSpec("t", 2, 1, staleness=0)], num_workers=1, deterministic=True)
    det.inc(0, "t", np.array([0]), np.array([[1.0]]), flush_seq=1, clock=0)  # queued: clock 0 not over
    with pytest.raises(PSError, match="nothing queued"):
        det.resize(2)
    with pytest.raises(PSError, match="nothing queued"):
        det.forget_worker(0)
    with pytest.raises(PSError, match=">= 1"):
        srv.resize(0)


def test_resize_keeps_survivors_views_so_their_cached_rows_are_pushed():
    srv = BoundedStalenessServer([TableSpec("t", 3, 1, staleness=1)], num_workers=2)
    first = srv.get(0, {"t": np.array([0, 1])}, clock=0)  # worker 0 caches rows 0 and 1
    srv.tick(0), srv.tick(1)
    srv.resize(3)
    assert srv.clocks.clocks == [1, 1, 1] and srv.min_clock == 1
    srv.inc(2, "t", np.array([1]), np.array([[7.0]]), flush_seq=1)  # the new worker changes a cached row
    push = srv.deliver(0)
    assert push.seq == first.seq + 1  # the survivor's deliveries go on in order
    assert push.rows["t"][0].tolist() == [1] and push.rows["t"][1].tolist() == [[7.0]]
    srv.forget_worker(0)  # a replacement in slot 0 starts with an empty cache and deliveries from 1
    srv.inc(2, "t", np.array([1]), np.array([[1.0]]), flush_seq=2)
    fresh = srv.deliver(0)
    assert fresh.seq == 1 and fresh.rows == {}
    srv.resize(1)
    assert len(srv.views) == 1 and srv.clocks.clocks == [1]


# -- programs -----------------------------------------------------------------------------------------
RECORDS = [(r % 6, (5 * r + 1) % 6, float(r % 3) - 1.0) for r in range(24)]  # (row, row, target)
MF = [TableSpec("w", 6, 2, staleness=0)]
W0 = np.random.default_rng(0).normal(size=(6, 2))


def mf_program(client, worker, clock):
    # Data parallel: record r belongs to worker r % n; an SGD-like step from the values read at this clock.
    mine = [rec for r, rec in enumerate(RECORDS) if r % client.num_workers == worker]
    rows = np.unique([a for a, _, _ in mine] + [b for _, b, _ in mine])
    values = dict(zip(rows.tolist(), client.get("w", rows), strict=True))
    delta = {r: np.zeros(2) for r in rows.tolist()}
    for a, b, y in mine:
        err = values[a] @ values[b] - y
        delta[a] -= 0.05 * err * values[b]
        delta[b] -= 0.05 * err * values[a]
    client.inc("w", rows, np.array([delta[r] for r in rows.tolist()]))
    return len(mine)


SCHEDULE = [1, 3, 2, 4]  # workers per window of 2 clocks


def schedule_elastic(**kw):
    return Elastic(FixedSchedule({i: n for i, n in enumerate(SCHEDULE) if i}), window=2, background=False, **kw)


def chained_local(specs, program, counts, window, start):
    """One fresh LocalPS per window (``window`` clocks, or ``window[i]`` for the i-th), each from the previous
    one's tables at the same clock."""
    tables, clock = start, 0
    for i, n in enumerate(counts):
        clocks = window[i] if isinstance(window, list) else window
        ps = LocalPS(specs, n, num_shards=2, deterministic=True)
        ps.restore(Checkpoint(clock, [ShardState(clock, tables) for _ in range(2)]))
        ps.run(program, clocks)
        tables, clock = ps.tables(), clock + clocks
    return tables


def elastic_run(ray_ps, counts, **kw):
    """``mf_program`` with ``counts[i]`` workers in window ``i`` (2 clocks each): the final table and the log."""
    ps = ray_ps(MF, counts[0], num_shards=2, deterministic=True)
    ps.initialize("w", W0)
    elastic = Elastic(FixedSchedule({i: n for i, n in enumerate(counts) if i}), window=2, background=False,
                      progress=lambda: float(np.linalg.norm(ps.table("w"))), **kw)
    result = ps.run(mf_program, 2 * len(counts), elastic=elastic)
    assert [w.workers for w in ps.elastic_log.windows] == counts
    assert ps.elastic_log.windows[-1].progress == float(np.linalg.norm(ps.table("w")))  # after the last window
    assert ps.clock == 2 * len(counts) and ps.num_workers == counts[-1]
    return ps.table("w"), ps.elastic_log, result


def test_resizes_give_the_tables_of_separate_runs(ray_ps):
    table, log, result = elastic_run(ray_ps, SCHEDULE)
    assert [(e.window, e.workers_before, e.workers_after, e.kind) for e in log.events] == [
        (1, 1, 3, "resize"), (2, 3, 2, "resize"), (3, 2, 4, "resize")]
    assert all(e.idle_s > 0 and "fixed schedule" in e.reason for e in log.events)
    assert [w.work for w in log.windows] == [2 * len(RECORDS)] * 4  # every record once per clock
    assert [len(r) for r in result.results] == [8, 6, 4, 2]  # slot 0 ran every clock, slot 3 the last two
    chained = chained_local(MF, mf_program, SCHEDULE, 2, {"w": W0})
    np.testing.assert_array_equal(table, chained["w"])  # bitwise: == a fresh job per window


def test_restart_baseline_gives_the_same_tables(ray_ps):
    counts = [2, 1, 2]
    table, log, _ = elastic_run(ray_ps, counts, restart=True)
    assert [(e.workers_before, e.workers_after) for e in log.events] == [(2, 1), (1, 2)]
    np.testing.assert_array_equal(table, chained_local(MF, mf_program, counts, 2, {"w": W0})["w"])


@pytest.mark.slow
def test_resize_and_restart_agree_on_the_full_schedule(ray_ps):
    resized, _, _ = elastic_run(ray_ps, SCHEDULE)
    restarted, log, _ = elastic_run(ray_ps, SCHEDULE, restart=True)
    assert len(log.events) == 3
    np.testing.assert_array_equal(resized, restarted)  # bitwise: resize == checkpoint-and-restart


def count_program(client, worker, clock):
    # Updates independent of reads: row worker % 3 counts worker-clocks, row 3 sums the worker count.
    client.inc("c", [worker % 3, 3], [[1.0], [float(client.num_workers)]])
    client.get("c", [0, 3])
    return None


def test_background_starts_delay_transitions_and_are_replayed_exactly(ray_ps):
    """Growing with actors started in the background: the transition waits for them (the current workers go on),
    idles less, and the allocation it made, replayed by checkpoint-and-restart, gives the same table."""
    ps = ray_ps(MF, 1, num_shards=2, deterministic=True, emulation=Emulation(0.004))
    ps.initialize("w", W0)
    ps.run(mf_program, 16, elastic=Elastic(FixedSchedule({1: 3}), window=2))
    log, table = ps.elastic_log, ps.table("w")
    (event,) = log.events
    assert event.workers_after == 3 and event.window >= 1 and event.started_s > 0
    ps2 = ray_ps(MF, 1, num_shards=2, deterministic=True)
    ps2.initialize("w", W0)
    ps2.run(mf_program, 16, elastic=Elastic(log.as_schedule(), window=2, restart=True))
    assert [w.workers for w in ps2.elastic_log.windows] == [w.workers for w in log.windows]
    np.testing.assert_array_equal(ps2.table("w"), table)
    assert ps2.elastic_log.events[0].idle_s > event.idle_s


def test_windows_sized_by_the_worker_count(ray_ps):
    """``window=lambda workers: ...``: one clock per window at one worker, two at two (a clock's work is split
    among the workers, so the windows stay about as long)."""
    ps = ray_ps(MF, 1, num_shards=2, deterministic=True)
    ps.initialize("w", W0)
    ps.run(mf_program, 5, elastic=Elastic(FixedSchedule({1: 2}), window=lambda workers: workers, background=False))
    log = ps.elastic_log
    assert [(w.workers, w.work) for w in log.windows] == [(1, 24), (2, 48), (2, 48)]  # 24 records per clock
    assert [e.window for e in log.events] == [1] and ps.clock == 5
    chained = chained_local(MF, mf_program, [1, 2], [1, 4], {"w": W0})
    np.testing.assert_array_equal(ps.table("w"), chained["w"])


def test_staleness_one_resizes_lose_and_double_nothing(ray_ps):
    counts = [2, 4, 1, 3]
    ps = ray_ps([TableSpec("c", 4, 1, staleness=1)], counts[0], num_shards=2)
    ps.run(count_program, 8, elastic=Elastic(FixedSchedule({i: n for i, n in enumerate(counts)}), window=2,
                                                 background=False))
    assert [w.workers for w in ps.elastic_log.windows] == counts
    want = np.zeros((4, 1))
    for n in counts:
        for w in range(n):
            want[w % 3] += 2
        want[3] += 2 * n * n
    np.testing.assert_array_equal(ps.table("c"), want)
    assert [w.work for w in ps.elastic_log.windows] == [2.0 * n for n in counts]  # None counts 1 per clock


def test_straggler_is_replaced_by_a_worker_at_normal_speed(ray_ps):
    emulation = Emulation(seconds_per_unit=0.005, slow={1: 3.0})  # 12 records: 60 ms a clock, 180 for slot 1
    ps = ray_ps(MF, 2, num_shards=2, deterministic=True, emulation=emulation)
    ps.initialize("w", W0)
    elastic = Elastic(FixedSchedule(), window=2, stragglers=Stragglers(fraction=0.5, patience=2), background=False)
    ps.run(mf_program, 8, elastic=elastic)
    log = ps.elastic_log
    assert [(e.window, e.kind, e.replaced) for e in log.events] == [(2, "replace", (1,))]
    assert "worker 1" in log.events[0].reason and "median" in log.events[0].reason
    assert ps.start_numbers == [0, 2]  # the replacement is a new process: start number 2, full speed
    for w in log.windows[:2]:
        assert w.per_worker[1] < 0.5 * w.per_worker[0]
    for w in log.windows[2:]:
        assert w.per_worker[1] > 0.7 * w.per_worker[0]
    want = chained_local(MF, mf_program, [2], 8, {"w": W0})
    np.testing.assert_array_equal(ps.table("w"), want["w"])  # the replacement changed nothing in the tables


def test_worker_killed_in_a_resize_and_in_a_window_recovers_exactly(ray_ps, ray_session):
    killed = []

    def kill_new_worker(ps, clock):
        if clock == 2 and "transition" not in killed:  # right after 1 -> 3 started workers 1 and 2
            ray_session.kill(ps.workers[2])
            killed.append("transition")

    def kill_in_window(ps, clock):
        if clock == 4 and "window" not in killed:
            ray_session.kill(ps.workers[1])
            killed.append("window")

    ps = ray_ps(MF, SCHEDULE[0], num_shards=2, deterministic=True)
    ps.initialize("w", W0)
    ps.run(mf_program, 8, checkpoint_every=2, elastic=schedule_elastic(), fault=kill_in_window,
           fault_in_transition=kill_new_worker)
    assert killed == ["transition", "window"]
    assert ps.restarts == 2 and ps.elastic_log.recoveries == 2
    assert [w.workers for w in ps.elastic_log.windows] == SCHEDULE
    want = chained_local(MF, mf_program, SCHEDULE, 2, {"w": W0})
    np.testing.assert_array_equal(ps.table("w"), want["w"])  # nothing lost, nothing applied twice


def test_elastic_bad_input(ray_ps):
    with pytest.raises(ElasticError, match="window"):
        Elastic(FixedSchedule(), window=0)
    ps = ray_ps(MF, 1, emulation=Emulation(0.01))
    with pytest.raises(PSError, match="fault_in_transition"):
        ps.run(mf_program, 2, fault_in_transition=lambda ps, clock: None)
    with pytest.raises(PSError, match="deterministic"):
        ps.run(mf_program, 2, checkpoint_every=1, elastic=schedule_elastic())
    with pytest.raises(ElasticError, match="differ"):
        ps.run(mf_program, 2, elastic=schedule_elastic(emulation=Emulation(0.02)))
    with pytest.raises(PSError, match="slots are 0..0"):
        ps.replace(1)
