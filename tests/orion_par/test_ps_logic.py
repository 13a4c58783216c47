"""The transport-free SSP logic: clock table, admission, deliveries, oplog, priorities, token bucket, stats."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orion_par.ps import BoundedStalenessServer, ClockTable, PSError, TableSpec, TokenBucket, ssp_admits
from orion_par.ps.oplog import ConsumptionOrder, OpLog, magnitude_scores, priority_candidates, select
from orion_par.ps.stats import WorkerStats, total
from orion_par.ps.tables import make_store


def test_clock_table_min_clock():
    ct = ClockTable(3)
    assert [ct.tick(0), ct.tick(1), ct.tick(0), ct.tick(2)] == [False, False, False, True]
    assert ct.min_clock == 1 and ct.clocks == [2, 1, 1]


@given(st.integers(0, 50), st.integers(0, 50), st.one_of(st.none(), st.integers(0, 10)))
def test_admission_matches_the_definition(stamp, clock, s):
    # A value stamped m holds every update of clocks < m; a reader at clock c needs clocks < c - s.
    needed_clocks = set() if s is None else set(range(max(clock - s, 0)))
    assert ssp_admits(stamp, clock, s) == needed_clocks.issubset(set(range(stamp)))


def _server(staleness, workers=2, deterministic=False):
    return BoundedStalenessServer([TableSpec("t", 4, 1, staleness=staleness)], workers, deterministic=deterministic)


def test_bsp_waits_for_the_slowest_and_asp_never_waits():
    bsp, asp = _server(0), _server(None)
    for srv in (bsp, asp):
        srv.tick(0)
        srv.tick(0)  # worker 0 at clock 2, worker 1 still at 0
    assert bsp.get(0, {"t": np.array([0])}, clock=2) is None
    assert asp.get(0, {"t": np.array([0])}, clock=2) is not None
    bsp.tick(1)
    assert bsp.get(0, {"t": np.array([0])}, clock=2) is None  # min clock 1 < 2
    bsp.tick(1)
    assert bsp.get(0, {"t": np.array([0])}, clock=2).stamp == 2


def test_ssp_lets_a_worker_run_s_clocks_ahead():
    srv = _server(2)
    for _ in range(2):
        srv.tick(0)
    assert srv.get(0, {"t": np.array([1])}, clock=2) is not None  # needs clocks < 0: nothing
    srv.tick(0)
    assert srv.get(0, {"t": np.array([1])}, clock=3) is None  # needs worker 1's clock 0


def test_delivery_pushes_changed_cached_rows_only():
    srv = _server(None)
    first = srv.get(1, {"t": np.array([0, 1])}, clock=0)
    assert first.seq == 1 and first.rows["t"][0].tolist() == [0, 1]
    srv.inc(0, "t", np.array([1, 3]), np.array([[2.0], [5.0]]), flush_seq=1)
    push = srv.deliver(1)
    assert push.seq == 2 and push.rows["t"][0].tolist() == [1]  # row 3 is not cached by worker 1
    assert srv.deliver(1).rows == {}
    assert srv.views[0].acked_flush == 1


def test_deterministic_mode_applies_clock_by_clock_in_worker_order():
    srv = _server(0, deterministic=True)
    srv.inc(1, "t", np.array([0]), np.array([[1.0]]), flush_seq=1, clock=0)
    srv.inc(0, "t", np.array([0]), np.array([[2.0]]), flush_seq=1, clock=0)
    assert srv.table("t")[0, 0] == 0.0  # queued until every worker finished clock 0
    srv.tick(0)
    srv.tick(1)
    assert srv.table("t")[0, 0] == 3.0
    with pytest.raises(PSError, match="needs the clock"):
        srv.inc(0, "t", np.array([0]), np.array([[1.0]]), flush_seq=2)


def test_checkpoint_needs_a_quiescent_server():
    srv = _server(1)
    srv.tick(0)
    with pytest.raises(PSError, match=r"worker clocks are \[1, 0\]"):
        srv.checkpoint()
    srv.tick(1)
    srv.inc(0, "t", np.array([2]), np.array([[4.0]]), flush_seq=1)
    state = srv.checkpoint()
    srv.inc(0, "t", np.array([2]), np.array([[4.0]]), flush_seq=2)
    srv.restore(state)
    assert srv.table("t")[2, 0] == 4.0 and srv.min_clock == 1 and srv.generation == 1


def test_oplog_coalesces_per_row():
    log = OpLog([TableSpec("t", 5, 2), TableSpec("s", 5, 9, kind="sparse")])
    for _ in range(4):
        log.add("t", np.array([1, 2]), np.ones((2, 2)))
    log.add("s", np.array([3, 3]), [{0: 1.0}, {0: 2.0, 8: 1.0}])
    assert log.coalesced == 6 + 1
    batches = {b.table: b for b in log.take_all()}
    assert batches["t"].rows.tolist() == [1, 2] and batches["t"].deltas.tolist() == [[4.0, 4.0], [4.0, 4.0]]
    assert batches["s"].deltas == [{0: 3.0, 8: 1.0}]
    assert batches["t"].nbytes == 2 * TableSpec("t", 5, 2).row_bytes and log.empty()


def test_magnitude_priority_orders_by_relative_change():
    spec = TableSpec("t", 3, 1)
    log = OpLog([spec])
    values = {"t": make_store(spec)}
    values["t"].add(np.array([0, 1, 2]), np.array([[100.0], [1.0], [10.0]]))
    log.add("t", np.array([0, 1, 2]), np.array([[10.0], [0.5], [0.2]]))  # relative: 0.1, 0.5, 0.02
    cands = priority_candidates(log, values, "magnitude", ConsumptionOrder())
    assert cands["t"][1].round(3).tolist() == [0.1, 0.5, 0.02]
    one_row = spec.row_bytes
    assert [r.tolist() for _, r in select(cands, 2 * one_row)] == [[0, 1]]
    assert [r.tolist() for _, r in select(cands, one_row)] == [[1]]
    assert select(cands, one_row - 1) == []


def test_consumption_priority_follows_last_clocks_read_order():
    order = ConsumptionOrder()
    order.record("t", np.array([2, 0]))
    order.record("t", np.array([0, 1]))
    order.next_clock()
    spec = TableSpec("t", 4, 1)
    log = OpLog([spec])
    log.add("t", np.array([0, 1, 2, 3]), np.ones((4, 1)))
    cands = priority_candidates(log, {"t": make_store(spec)}, "consumption", order)
    picked = select(cands, 3 * spec.row_bytes)
    assert [r.tolist() for _, r in picked] == [[0, 1, 2]]  # 2, 0, 1 were read first; 3 never
    with pytest.raises(PSError, match="unknown"):
        priority_candidates(log, {"t": make_store(spec)}, "newest", order)


def test_magnitude_scores_of_an_unread_row_are_finite_and_high():
    spec = TableSpec("t", 2, 1)
    d, v = make_store(spec), make_store(spec)
    d.add(np.array([0, 1]), np.array([[1e-6], [1.0]]))
    v.add(np.array([1]), np.array([[1.0]]))
    s = magnitude_scores(d, v, np.array([0, 1]))
    assert np.isfinite(s).all() and s[0] > s[1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 10)), min_size=1, max_size=20), st.integers(0, 200))
def test_select_never_lets_a_lower_priority_row_overtake(items, budget):
    rows = np.arange(len(items))
    scores = np.array([s for _, s in items])
    nbytes = np.array([10 + 10 * b for b, _ in items])
    chosen = np.concatenate([r for _, r in select({"t": (rows, scores, nbytes)}, budget)] or [np.array([], int)])
    assert nbytes[chosen].sum() <= budget
    if chosen.size:
        rest = [r for r in rows if r not in set(chosen.tolist())]
        better_left = [r for r in rest if scores[r] > scores[chosen].min()]
        assert not better_left  # every skipped row scores no higher than the lowest chosen one


def test_token_bucket_counts_bytes():
    b = TokenBucket(rate_bytes_per_s=1.0, burst_bytes=100)  # refills 1 byte/s: nothing comes back during the test
    assert b.try_take(60) and not b.try_take(60) and b.available() <= 41
    b.refund(30)
    assert 70 <= b.available() <= 71
    b.refund(1000)
    assert b.available() == 100  # a refund never overfills the bucket
    with pytest.raises(PSError, match="must be > 0"):
        TokenBucket(0)


def test_token_bucket_message_waits_its_transmission_time():
    # 10 bytes of tokens at 10 kB/s: a 60-byte message owes 50 bytes of link time, i.e. 5 ms, and the next
    # message queues behind that debt.  The waits are computed from the tokens, not measured.
    b = TokenBucket(rate_bytes_per_s=1e4, burst_bytes=10)
    first = b.take(60)
    assert 0.004 < first <= 0.005
    assert b.take(5) <= 0.0005  # the link has carried the first message's bytes by now


def test_absolute_priority_orders_by_accumulated_change():
    spec = TableSpec("t", 3, 2)
    log = OpLog([spec])
    values = {"t": make_store(spec)}
    values["t"].add(np.array([0, 1, 2]), np.array([[100.0, 0.0], [1.0, 0.0], [10.0, 0.0]]))
    log.add("t", np.array([0, 1, 2]), np.array([[10.0, -1.0], [0.5, 0.0], [0.2, 0.1]]))  # |delta|: 11, 0.5, 0.3
    cands = priority_candidates(log, values, "absolute", ConsumptionOrder())
    assert cands["t"][1].round(3).tolist() == [11.0, 0.5, 0.3]  # the cached values do not matter
    assert [r.tolist() for _, r in select(cands, 2 * spec.row_bytes)] == [[0, 1]]


def test_random_policy_scores_every_dirty_row():
    spec = TableSpec("t", 6, 1)
    log = OpLog([spec])
    log.add("t", np.array([4, 1, 5]), np.ones((3, 1)))
    rows, scores, nbytes = priority_candidates(log, {"t": make_store(spec)}, "random", ConsumptionOrder())["t"]
    assert rows.tolist() == [1, 4, 5] and ((scores >= 0) & (scores < 1)).all()
    assert nbytes.tolist() == [spec.row_bytes] * 3


def test_stats_histogram_and_totals():
    a, b = WorkerStats(0), WorkerStats(1)
    a.record_reads(np.array([5, 4, 4]), clock=5)
    b.record_reads(np.array([1]), clock=4)
    b.bytes_sent = 10
    t = total([a, b])
    assert t["staleness_hist"] == {"0": 1, "1": 2, "3": 1} and t["row_reads"] == 4 and t["bytes_sent"] == 10
    assert a.max_staleness == 1 and b.mean_staleness == 3.0


def test_table_spec_errors_say_what_to_fix():
    with pytest.raises(PSError, match="num_rows=0 must be an int >= 1"):
        TableSpec("t", 0, 1)
    with pytest.raises(PSError, match="kind='ragged'"):
        TableSpec("t", 1, 1, kind="ragged")
    with pytest.raises(PSError, match="rows must be a 1-D sequence of ints"):
        TableSpec("t", 3, 1).check_rows([0.5])
    with pytest.raises(PSError, match="two tables are named 't'"):
        BoundedStalenessServer([TableSpec("t", 1, 1), TableSpec("t", 2, 1)], 1)


def test_dense_store_row_paths_agree():
    # Contiguous rows take slices, increasing ones skip np.unique, repeats use np.add.at: all the same sums.
    spec = TableSpec("t", 12, 3)
    rng = np.random.default_rng(4)
    for rows in ([2, 3, 4, 5], [1, 4, 9], [5, 2, 5, 5], [7], [], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]):
        rows = np.array(rows, dtype=np.int64)
        store, ref = make_store(spec), np.zeros((12, 3))
        deltas = rng.standard_normal((rows.size, 3))
        store.add(rows, deltas)
        np.add.at(ref, rows, deltas)
        assert np.array_equal(store.snapshot(), ref)
        assert np.array_equal(store.read(rows), ref[rows])
        got = store.read(rows)
        got += 1.0  # a read is a copy, whichever path made it
        assert np.array_equal(store.snapshot(), ref)
        store.zero(rows)
        ref[rows] = 0
        assert np.array_equal(store.snapshot(), ref)
