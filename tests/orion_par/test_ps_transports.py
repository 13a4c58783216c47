"""The same suite against both transports (in-process threads and Ray actors), plus Ray's fault recovery."""

from __future__ import annotations

import time

import numpy as np
import pytest

from orion_par.ps import ClientOptions, LocalPS, PSError, RolledBack, TableSpec, TokenBucket


@pytest.fixture(params=["local", "ray"])
def make(request):
    made = []

    def build(tables, workers, **kw):
        if request.param == "local":
            ps = LocalPS(tables, workers, **kw)
        else:
            request.getfixturevalue("ray_session")
            from orion_par.ps.ray_transport import RayPS

            ps = RayPS(tables, workers, **kw)
        made.append(ps)
        return ps

    yield build
    for ps in made:
        if hasattr(ps, "close"):
            ps.close()


def bsp_program(client, worker, clock):
    # Each worker adds (worker + 1) * (clock + 1) to row `worker` and reads both rows.
    client.inc("w", [worker], [[float((worker + 1) * (clock + 1))]])
    return client.get("w", [0, 1]).ravel().tolist()


def test_bsp_reads_see_exactly_the_previous_clocks(make):
    # Deterministic BSP: at clock c a worker sees every clock < c of the other worker, and its own clock c.
    ps = make([TableSpec("w", 2, 1, staleness=0)], 2, deterministic=True)
    out = ps.run(bsp_program, clocks=4).results
    other = [sum((2 - w) * (c + 1) for c in range(k)) for w in range(2) for k in range(4)]
    for w in range(2):
        for c in range(4):
            mine = sum((w + 1) * (k + 1) for k in range(c + 1))
            assert out[w][c][w] == mine
            assert out[w][c][1 - w] == other[w * 4 + c]
    assert ps.table("w").ravel().tolist() == [10.0, 20.0]


def asp_program(client, worker, clock):
    if worker == 1:
        time.sleep(0.05)  # a slow worker; ASP readers must not wait for it
    client.inc("w", [worker], [[1.0]])
    return client.clock_now, client.get("w", [0, 1]).ravel().tolist()


def test_asp_never_blocks_and_counts_everything(make):
    ps = make([TableSpec("w", 2, 1, staleness=None)], 2)
    result = ps.run(asp_program, clocks=5)
    assert ps.table("w").ravel().tolist() == [5.0, 5.0]
    for clock, (_, values) in enumerate(result.results[0]):
        assert values[0] == clock + 1  # own writes always visible
    # never waits for the slow worker: each row is fetched once, to fill the cache, and never again (a wall-clock
    # comparison of blocked time failed here on a loaded machine: a first fetch over Ray took 2.1 s)
    assert all(s.cache_misses == 2 for s in result.stats)


def coalesce_program(client, worker, clock):
    for _ in range(10):
        client.inc("w", [0, 1, 0], np.ones((3, 4)))
    return None


def test_oplog_coalesces_and_bytes_are_counted(make):
    ps = make([TableSpec("w", 3, 4, staleness=1)], 2)
    result = ps.run(coalesce_program, clocks=3)
    np.testing.assert_array_equal(ps.table("w"), [[120.0] * 4, [60.0] * 4, [0.0] * 4])
    row_bytes = TableSpec("w", 3, 4).row_bytes
    for s in result.stats:
        assert s.bytes_sent == 3 * 2 * row_bytes  # 30 increments per clock, 2 distinct rows sent
        assert s.clocks == 3


def sparse_program(client, worker, clock):
    client.inc("topics", [7, 7], [{worker: 1.0}, {5: 2.0}])
    return client.get("topics", [7])[0]


def test_sparse_rows(make):
    ps = make([TableSpec("topics", 10, 8, staleness=0, kind="sparse")], 2, num_shards=3, deterministic=True)
    out = ps.run(sparse_program, clocks=2).results
    assert ps.table("topics") == {7: {0: 2.0, 1: 2.0, 5: 8.0}}
    assert out[0][1] == {0: 2.0, 1: 1.0, 5: 6.0}  # clock 1: own clocks 0-1, worker 1's clock 0


def test_checkpoint_restore_round_trip(make):
    ps = make([TableSpec("w", 2, 1, staleness=0)], 2, num_shards=2, deterministic=True)
    ps.run(bsp_program, clocks=2)
    ckpt = ps.checkpoint()
    before = ps.table("w")
    ps.run(bsp_program, clocks=2)
    after = ps.table("w")
    assert not np.array_equal(before, after)
    ps.restore(ckpt)
    assert ckpt.clock == 2
    np.testing.assert_array_equal(ps.table("w"), before)
    ps.run(bsp_program, clocks=2)  # clocks 2 and 3 again: the same updates, applied once
    np.testing.assert_array_equal(ps.table("w"), after)


def managed_program(client, worker, clock):
    client.inc("w", np.arange(8), np.full((8, 2), 1.0 + worker))
    time.sleep(0.03)  # computing: the background flusher spends the spare budget meanwhile
    return None


def test_managed_communication_sends_between_clocks(make):
    opts = ClientOptions(bandwidth_bytes_per_s=1e6, policy="magnitude")
    ps = make([TableSpec("w", 8, 2, staleness=1)], 2, options=opts)
    result = ps.run(managed_program, clocks=3)
    np.testing.assert_array_equal(ps.table("w"), np.full((8, 2), 9.0))  # 3 clocks x (1 + 2)
    assert all(s.early_bytes > 0 for s in result.stats)
    assert all(s.bytes_sent == 3 * 8 * TableSpec("w", 8, 2).row_bytes for s in result.stats)


class CountingBucket(TokenBucket):
    """A token bucket that remembers the bytes it was charged net of refunds."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.charged = 0

    def take(self, nbytes):
        self.charged += nbytes
        return super().take(nbytes)

    def refund(self, nbytes):
        self.charged -= nbytes
        super().refund(nbytes)


@pytest.mark.parametrize("policy", [None, "magnitude", "random"])
@pytest.mark.parametrize("async_send", [False, True])
def test_every_mode_is_charged_exactly_the_bytes_it_sends(policy, async_send):
    # Plain SSP and managed communication share one bucket per worker; neither pays for bytes it does not send.
    opts = ClientOptions(bandwidth_bytes_per_s=2e5, policy=policy, async_send=async_send)
    ps = LocalPS([TableSpec("w", 8, 2, staleness=1)], 2, options=opts)
    for c in ps.clients:
        c.bucket = CountingBucket(2e5, c.bucket.burst)
    result = ps.run(managed_program, clocks=3)
    for c, s in zip(ps.clients, result.stats, strict=True):
        assert c.bucket.charged == s.bytes_sent == 3 * 8 * TableSpec("w", 8, 2).row_bytes
    np.testing.assert_array_equal(ps.table("w"), np.full((8, 2), 9.0))


def test_wall_time_snapshots_and_bytes_over_time():
    opts = ClientOptions(bandwidth_bytes_per_s=1e6, policy="magnitude", async_send=True)
    ps = LocalPS([TableSpec("w", 8, 2, staleness=1)], 2, options=opts)
    result = ps.run(managed_program, clocks=3, snapshot_every=1, snapshot_every_s=0.01)
    times = [t for _, t, _ in result.snapshots]
    assert times == sorted(times) and len(result.snapshots) > 3  # 3 clock snapshots plus the timed ones
    clocks = [c for c, _, _ in result.snapshots]
    assert clocks == sorted(clocks)  # the server's min clock never goes back
    sent = [b for _, b in result.sent]
    assert sent == sorted(sent) and sent[-1] <= sum(s.bytes_sent for s in result.stats)
    assert all(set(tables) == {"w"} for _, _, tables in result.snapshots)


def test_bad_input_errors():
    with pytest.raises(PSError, match="staleness"):
        TableSpec("w", 2, 1, staleness=-1)
    ps = LocalPS([TableSpec("w", 2, 1)], 1)
    with pytest.raises(PSError, match="out of range 0..1"):
        ps.client(0).inc("w", [2], [[1.0]])
    with pytest.raises(PSError, match="shape"):
        ps.client(0).inc("w", [0], [[1.0, 2.0]])
    with pytest.raises(PSError, match="no table named 'v'"):
        ps.client(0).get("v", [0])
    with pytest.raises(PSError, match="managed communication"):
        ClientOptions(policy="magnitude")
    with pytest.raises(PSError, match="deterministic"):
        LocalPS([TableSpec("w", 2, 1)], 1, deterministic=True,
                options=ClientOptions(bandwidth_bytes_per_s=1e6, policy="magnitude"))


def failing_program(client, worker, clock):
    if worker == 1 and clock == 2:
        raise ValueError("boom")
    client.inc("w", [worker], [[1.0]])
    client.get("w", [0, 1])


def test_local_worker_failure_is_reported_not_hung():
    ps = LocalPS([TableSpec("w", 2, 1, staleness=0)], 2)
    with pytest.raises(ValueError, match="boom"):
        ps.run(failing_program, clocks=5)


def fault_program(client, worker, clock):
    rng = np.random.default_rng([worker, clock])  # deterministic mode: updates depend on clock and reads only
    w = client.get("w", np.arange(4))
    rows = rng.choice(4, size=2, replace=False)
    client.inc("w", rows, 0.5 * w[rows] + rng.random((2, 3)))
    time.sleep(0.005)


def test_ray_worker_killed_mid_run_recovers_exactly(ray_session):
    from orion_par.ps.ray_transport import RayPS

    specs = [TableSpec("w", 4, 3, staleness=0)]
    clean = RayPS(specs, 2, num_shards=2, deterministic=True)
    try:
        clean.run(fault_program, clocks=12, checkpoint_every=4)
        want = clean.table("w")
    finally:
        clean.close()
    killed = []

    def kill_once(ps, clock):
        if clock == 4 and not killed:
            time.sleep(0.02)  # mid-segment
            ray_session.kill(ps.workers[1])
            killed.append(clock)

    ps = RayPS(specs, 2, num_shards=2, deterministic=True)
    try:
        ps.run(fault_program, clocks=12, checkpoint_every=4, fault=kill_once)
        assert ps.restarts == 1
        np.testing.assert_array_equal(ps.table("w"), want)  # bit-identical: nothing lost, nothing twice
    finally:
        ps.close()
    local = LocalPS(specs, 2, num_shards=2, deterministic=True)
    local.run(fault_program, clocks=12)
    np.testing.assert_array_equal(local.table("w"), want)  # and the transports agree


def test_restore_rolls_back_running_workers():
    ps = LocalPS([TableSpec("w", 1, 1)], 1)
    ckpt = ps.checkpoint()
    ps.hosts[0].server.restore(ckpt.shards[0])  # server restored behind the client's back
    with pytest.raises(RolledBack, match="restart it from the checkpoint"):
        ps.client(0).inc("w", [0], [[1.0]]) or ps.client(0).clock()
