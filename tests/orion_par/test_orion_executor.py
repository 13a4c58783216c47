"""The local executor: parallel results equal the serial run in the executor's order (exactly)."""

from __future__ import annotations

import warnings
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orion_par import Buffer, CompileFallbackWarning, DataOrderError, DistArray, parallel_for
from orion_par import schedule as schedule_module
from orion_par.errors import BadBodyError


def _mf(keys, vals, nu, ni, rank=4, seed=0):
    rng = np.random.default_rng(seed)
    W = DistArray(rng.random((nu, rank)) * 0.3)
    H = DistArray(rng.random((ni, rank)) * 0.3)
    data = DistArray.from_coo(keys, vals)

    @parallel_for(data)
    def sgd(key, value):
        u, i = key
        w = W[u]
        h = H[i]
        err = value
        for r in range(rank):
            err -= w[r] * h[r]
        for r in range(rank):
            wr = w[r]
            w[r] += 0.05 * (err * h[r] - 0.01 * wr)
            h[r] += 0.05 * (err * wr - 0.01 * h[r])

    return sgd, W, H


def _serial_python(fn, data, order):
    keys, values = data.keys, np.asarray(data)
    for r in order:
        fn(tuple(int(x) for x in keys[r]), values[r].item())


@st.composite
def sparse_ratings(draw):
    nu, ni = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    n = draw(st.integers(0, 150))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    keys = np.stack([rng.integers(0, nu, n), rng.integers(0, ni, n)], axis=1)
    return (keys, rng.random(n), nu, ni, draw(st.integers(1, 3)), draw(st.sampled_from([None, 4, 7])),
            draw(st.sampled_from([2, 5, 4096])))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sparse_ratings())
def test_parallel_equals_serial_in_executor_order(case):
    keys, vals, nu, ni, workers, tparts, min_chunk = case  # a small minimum chunk: several chunks per block
    sgd, W, H = _mf(keys, vals, nu, ni)
    tparts = max(tparts or 2 * workers, workers)
    W0, H0 = W.copy(), H.copy()
    with mock.patch.object(schedule_module, "_MIN_CHUNK", min_chunk):
        sgd.run(workers=workers, epochs=2, time_partitions=tparts)
    par_W, par_H = W.copy(), H.copy()
    W[:], H[:] = W0, H0
    sgd.run_serial(order=sgd.schedule(workers, tparts).serial_order(epochs=2))
    assert np.array_equal(W, par_W) and np.array_equal(H, par_H)


def test_compiled_equals_plain_python_serial():
    rng = np.random.default_rng(1)
    keys = np.stack([rng.integers(0, 30, 500), rng.integers(0, 20, 500)], axis=1)
    sgd, W, H = _mf(keys, rng.random(500), 30, 20)
    W0, H0 = W.copy(), H.copy()
    sgd.run(workers=2)
    par = W.copy(), H.copy()
    W[:], H[:] = W0, H0
    _serial_python(sgd, sgd.data, sgd.schedule(2).serial_order())
    assert np.allclose(W, par[0], rtol=1e-12, atol=1e-12) and np.allclose(H, par[1], rtol=1e-12, atol=1e-12)


def test_2d_on_one_worker_is_the_serial_loop_in_data_order():
    rng = np.random.default_rng(5)
    keys = np.stack([rng.integers(0, 30, 600), rng.integers(0, 20, 600)], axis=1)
    sgd, W, H = _mf(keys, rng.random(600), 30, 20)
    assert sgd.plan.scheme == "2d"
    W0, H0 = W.copy(), H.copy()
    sgd.run(workers=1, epochs=3)
    got = W.copy(), H.copy()
    W[:], H[:] = W0, H0
    sgd.run_serial(epochs=3)  # data order
    assert np.array_equal(W, got[0]) and np.array_equal(H, got[1])
    assert np.array_equal(sgd.schedule(1).serial_order(), np.arange(600))
    # Two workers keep data order inside each block (arrays this small make one cache-sized part per block).
    sched = sgd.schedule(2)
    for b in range(sched.block_start.size):
        assert np.all(np.diff(sched.block_records(b)) > 0)


def test_1d_equals_serial_in_data_order():
    rng = np.random.default_rng(2)
    keys = np.stack([rng.integers(0, 40, 800), rng.integers(0, 9, 800)], axis=1)
    acc = DistArray(np.zeros((40, 3)))
    data = DistArray.from_coo(keys, rng.random(800))

    @parallel_for(data)
    def body(key, value):
        u, i = key
        acc[u, 0] = acc[u, 0] * 0.9 + value * i  # order-sensitive: a running average per u
        acc[u, 1] += 1.0

    assert body.plan.scheme == "1d"
    body.run(workers=2, epochs=2)
    got = acc.copy()
    acc[:] = 0
    _serial_python(body, data, np.tile(np.arange(800), 2))
    assert np.array_equal(acc, got)


def _grid_keys(n_i, n_j, rng, density=0.7):
    keys = np.array([(i, j) for i in range(n_i) for j in range(n_j) if rng.random() < density])
    return keys


def test_wavefront_equals_serial_in_data_order():
    rng = np.random.default_rng(3)
    keys = _grid_keys(25, 18, rng)
    A = DistArray(np.zeros((26, 19)))
    data = DistArray.from_coo(keys, rng.random(len(keys)))

    @parallel_for(data, ordered=True)
    def dp(key, value):
        i, j = key
        A[i + 1, j + 1] = max(A[i, j + 1], A[i + 1, j]) * 0.99 + value

    assert dp.plan.scheme == "2d_ordered"
    dp.run(workers=3, epochs=2, time_partitions=5)
    got = A.copy()
    A[:] = 0
    _serial_python(dp, data, np.tile(np.arange(len(keys)), 2))
    assert np.array_equal(A, got)


def test_wavefront_needs_sorted_data():
    rng = np.random.default_rng(4)
    keys = _grid_keys(6, 6, rng)[::-1].copy()
    A = DistArray(np.zeros((7, 7)))

    @parallel_for(DistArray.from_coo(keys, np.ones(len(keys))), ordered=True)
    def dp(key, value):
        A[key[0] + 1, key[1] + 1] = A[key[0], key[1] + 1] + A[key[0] + 1, key[1]]

    with pytest.raises(DataOrderError, match="lexsort"):
        dp.run(workers=2)


def test_buffer_with_one_worker_is_exact_and_merges_with_two():
    rng = np.random.default_rng(5)
    keys = np.stack([rng.integers(0, 50, 3000), rng.integers(0, 40, 3000)], axis=1)
    data = DistArray.from_coo(keys, rng.integers(0, 4, 3000))
    per_user = DistArray(np.zeros((50, 4), dtype=np.int64))
    totals = Buffer(np.zeros(4, dtype=np.int64))

    @parallel_for(data)
    def count(key, value):
        per_user[key[0], value] += 1
        totals[value] += 1

    assert count.plan.scheme == "1d" and count.plan.buffered == {"totals": 1}
    count.run(workers=1)
    assert np.array_equal(np.asarray(totals), np.bincount(np.asarray(data), minlength=4))
    count.run(workers=2, epochs=3)
    assert np.array_equal(np.asarray(totals), 4 * np.bincount(np.asarray(data), minlength=4))
    assert per_user.sum() == 4 * 3000


def test_buffer_runs_are_deterministic():
    rng = np.random.default_rng(6)
    keys = np.stack([rng.integers(0, 30, 2000), rng.integers(0, 30, 2000)], axis=1)
    data = DistArray.from_coo(keys, rng.random(2000))
    W = DistArray(np.ones((30, 2)))
    mean = Buffer(np.zeros(2), max_delay=2)

    @parallel_for(data)
    def body(key, value):
        W[key[0], 0] += value - mean[0]
        mean[0] += 0.001 * (W[key[0], 0] - mean[0])

    results = []
    for _ in range(2):
        W[:] = 1.0
        mean[:] = 0.0
        body.run(workers=2, epochs=2)
        results.append((W.copy(), mean.copy()))
    assert np.array_equal(results[0][0], results[1][0]) and np.array_equal(results[0][1], results[1][1])


def test_uncompilable_body_falls_back_with_warning_and_same_result():
    rng = np.random.default_rng(7)
    keys = rng.integers(0, 20, 300)
    data = DistArray.from_coo(keys, rng.random(300))
    out = DistArray(np.zeros(20))
    names = {"scale": 2.0}

    @parallel_for(data)
    def body(key, value):
        out[key[0]] += value * names["scale"]  # a dict of str: numba cannot type it

    with pytest.warns(CompileFallbackWarning) as rec:
        stats = body.run(workers=2)
    msg = str(rec[0].message)
    assert "line" in msg and 'names["scale"]' in msg
    assert not stats.compiled
    expected = np.zeros(20)
    np.add.at(expected, keys, np.asarray(data) * 2.0)
    assert np.allclose(out, expected)


def test_skewed_keys_are_balanced_across_workers():
    rng = np.random.default_rng(8)
    users = np.minimum(rng.zipf(1.3, 20000), 5000) - 1
    keys = np.stack([users, rng.integers(0, 300, 20000)], axis=1)
    sgd, _, _ = _mf(keys, rng.random(20000), 5000, 300)
    sizes = sgd.schedule(4).worker_sizes()
    biggest_user = np.bincount(users).max()
    assert sizes.sum() == 20000
    assert sizes.max() <= max(20000 / 4 * 1.05, biggest_user)  # nobody gets most of the data


def test_out_of_range_keys_are_reported_before_running():
    data = DistArray.from_coo([[0, 1], [7, 1]], [1.0, 2.0])
    small = DistArray(np.zeros((5, 3)))

    @parallel_for(data)
    def body(key, value):
        small[key[0], key[1]] = value

    with pytest.raises(BadBodyError, match=r"size 5.*0\.\.7"):
        body.run()


def test_bad_run_arguments():
    sgd, _, _ = _mf(np.array([[0, 0]]), np.array([1.0]), 1, 1)
    with pytest.raises(BadBodyError, match="backend"):
        sgd.run(backend="spark")
    with pytest.raises(BadBodyError, match="epochs"):
        sgd.run(epochs=-1)
    with pytest.raises(ValueError, match="workers"):
        sgd.run(workers=0)


def test_body_exceptions_reach_the_caller():
    data = DistArray.from_coo(np.arange(10), np.arange(10.0))
    out = DistArray(np.zeros(10))
    table = {"x": 1.0}

    @parallel_for(data)
    def body(key, value):
        out[key[0]] = table["missing"] + value

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompileFallbackWarning)
        with pytest.raises(KeyError):
            body.run(workers=2)


def test_random_numbers_are_reproducible_with_a_seed():
    data = DistArray.from_coo(np.arange(100) % 10, np.zeros(100))
    out = DistArray(np.zeros(10))

    @parallel_for(data)
    def body(key, value):
        out[key[0]] += np.random.random()

    body.run(workers=2, seed=3)
    first = out.copy()
    out[:] = 0
    body.run(workers=2, seed=3)
    assert np.array_equal(out, first) and first.sum() > 0


def test_negative_keys_are_rejected_because_they_alias():
    data = DistArray.from_coo([[-1, 0], [4, 0]], [1.0, 2.0])
    arr = DistArray(np.zeros(5))

    @parallel_for(data)
    def body(key, value):
        arr[key[0]] += value

    with pytest.raises(BadBodyError, match="wraps around to the end of the array"):
        body.run(workers=2)


def test_row_values_docstring_and_early_return():
    rng = np.random.default_rng(9)
    keys = rng.integers(0, 10, 200)
    vals = rng.random((200, 3))
    out = DistArray(np.zeros((10, 3)))

    @parallel_for(DistArray.from_coo(keys, vals))
    def body(key, value):
        """Accumulate the rows whose first entry is large enough."""
        if value[0] < 0.1:
            return
        for c in range(3):
            out[key[0], c] += value[c]

    assert body.run(workers=2).compiled
    expected = np.zeros((10, 3))
    for k, v in zip(keys, vals, strict=True):
        if v[0] >= 0.1:
            expected[k] += v
    assert np.allclose(out, expected)


def test_data_parallel_arrays_are_merged_every_step():
    rng = np.random.default_rng(10)
    keys = np.stack([rng.integers(0, 20, 1000), rng.integers(0, 20, 1000)], axis=1)
    data = DistArray.from_coo(keys, rng.random(1000))
    per_user = DistArray(np.zeros(20))
    total = DistArray(np.zeros(1))

    @parallel_for(data, allow_data_parallel=True)
    def body(key, value):
        per_user[key[0]] += value
        total[0] += value

    assert body.plan.data_parallel == ("total",)
    body.run(workers=2, epochs=2)
    assert np.isclose(total[0], 2 * np.asarray(data).sum())
    assert np.allclose(per_user, 2 * np.bincount(keys[:, 0], weights=np.asarray(data), minlength=20))


def test_division_by_zero_follows_numpy_as_the_python_body_does():
    data = DistArray.from_coo(np.arange(3), np.array([1.0, 0.0, -2.0]))
    den = DistArray(np.zeros(3))
    out = DistArray(np.zeros(3))

    @parallel_for(data)
    def ratio(key, value):
        out[key[0]] = value / den[key[0]]

    ratio.run(workers=1)
    compiled = out.copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        for r in range(3):
            ratio((r,), np.asarray(data)[r])  # the plain Python body on the same numpy scalars
    assert np.array_equal(compiled, out, equal_nan=True)
    assert np.isinf(compiled[0]) and np.isnan(compiled[1]) and compiled[2] == -np.inf


def _mf_case(n=900, nu=40, ni=30, seed=7):
    rng = np.random.default_rng(seed)
    keys = np.stack([rng.integers(0, nu, n), rng.integers(0, ni, n)], axis=1)
    return keys, rng.random(n), nu, ni


def test_fine_strata_repeat_one_seeded_order_every_epoch(monkeypatch):
    keys, vals, nu, ni = _mf_case()
    monkeypatch.setattr(schedule_module, "_MIN_CHUNK", 16)  # 900 records, 3 workers x 6 time parts: 3 chunks
    sgd, _, _ = _mf(keys, vals, nu, ni)
    sched = sgd.schedule(3)
    m, t = sched.chunks, 6
    assert m == 3 and sched.num_steps == t * m
    assert all(sched.for_epoch(e) is sched for e in range(3))  # every epoch runs one order, as the serial loop
    assert np.array_equal(sched.serial_order(3), np.tile(sched.serial_order(), 3))
    # Chunk j of block (p, g) has id (p * t + g) * m + j, worker p, token g; g rotates with the coarse step.
    assert all(t_.block // (t * m) == t_.worker and t_.block // m % t == t_.token for t_ in sched.tasks)
    # Every chunk j of block (p, g) holds the pairs of p's and g's sub-parts on one diagonal: per space key, its
    # records in a chunk share one time sub-part, so a user's ratings in a block are spread over the m steps.
    sizes = sched.block_stop - sched.block_start
    assert sizes.sum() == len(keys) and sizes.min() > 0
    again, _, _ = _mf(keys, vals, nu, ni)
    assert np.array_equal(again.schedule(3).serial_order(), sched.serial_order())  # same seed, same order
    again.stratum_seed = 1
    assert not np.array_equal(again.schedule(3).serial_order(), sched.serial_order())
    again.stratum_seed = None  # identity squares, steps in rotation order
    rotation = again.schedule(3)
    assert [(x.worker, x.step, x.block, x.token) for x in rotation.tasks] == [
        (p, k * m + j, (p * t + (p + k) % t) * m + j, (p + k) % t) for k in range(t) for j in range(m) for p in range(3)]


def test_a_blocks_consecutive_chunks_run_as_one_call(monkeypatch):
    from orion_par.local import _runs

    keys, vals, nu, ni = _mf_case()
    monkeypatch.setattr(schedule_module, "_MIN_CHUNK", 16)  # 3 chunks per block, one run of 3 steps each
    sgd, _, _ = _mf(keys, vals, nu, ni)
    sched = sgd.schedule(3)
    for w in range(3):
        merged, single = _runs(sched, w, merge=True), _runs(sched, w, merge=False)
        assert len(single) == 18 and len(merged) == 6 and all(c == 3 for _, c, _, _ in merged.values())
        # the calls cover the records of the tasks they merge, in the same order
        assert np.array_equal(np.concatenate([sched.perm[v[2]:v[3]] for _, v in sorted(merged.items())]),
                              np.concatenate([sched.perm[v[2]:v[3]] for _, v in sorted(single.items())]))


@pytest.mark.parametrize("stratum_seed", [0, 3, None])
def test_runs_continue_the_epoch_sequence_and_equal_the_serial_run(stratum_seed):
    keys, vals, nu, ni = _mf_case()
    sgd, W, H = _mf(keys, vals, nu, ni)
    sgd.stratum_seed = stratum_seed
    W0, H0 = W.copy(), H.copy()
    sgd.run(workers=3, epochs=1)
    sgd.run(workers=3, epochs=2)
    assert sgd.epochs_run == 3
    got = W.copy(), H.copy()
    W[:], H[:] = W0, H0
    sgd.run_serial(order=sgd.schedule(3).serial_order(epochs=3))
    assert np.array_equal(W, got[0]) and np.array_equal(H, got[1])
    W[:], H[:] = W0, H0
    sgd.epochs_run = 0
    sgd.run(workers=3, epochs=3)
    assert np.array_equal(W, got[0]) and np.array_equal(H, got[1])


def _run_and_serial(sgd, W, H, workers, epochs=2):
    W0, H0 = W.copy(), H.copy()
    sgd.run(workers=workers, epochs=epochs)
    got = W.copy(), H.copy()
    W[:], H[:] = W0, H0
    sgd.run_serial(order=sgd.schedule(workers).serial_order(epochs=epochs))
    return got, (W.copy(), H.copy())


@pytest.mark.parametrize("path", ["driver", "driver_sleeping", "python_handover"])
def test_every_token_handover_path_equals_the_serial_run(monkeypatch, path):
    from orion_par import local

    keys, vals, nu, ni = _mf_case(n=3000)
    monkeypatch.setattr(schedule_module, "_MIN_CHUNK", 16)  # many chunks: many hand-overs
    sgd, W, H = _mf(keys, vals, nu, ni)
    compiled = sgd.compiled_body(sgd.data.keys, np.asarray(sgd.data), sgd._params(sgd.captured()), sgd.plan.accesses)
    assert compiled.drive is not None
    if path == "driver_sleeping":
        monkeypatch.setattr(local, "_SPIN_S", 0.0)  # every wait leaves the driver and sleeps in Python
    if path == "python_handover":
        monkeypatch.setattr(compiled, "drive", None)  # the condition-variable path (a driver that failed to compile)
    got, want = _run_and_serial(sgd, W, H, workers=3)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_a_failing_worker_does_not_leave_the_others_waiting(monkeypatch):
    import threading

    keys, vals, nu, ni = _mf_case(n=3000)
    monkeypatch.setattr(schedule_module, "_MIN_CHUNK", 16)
    sgd, W, H = _mf(keys, vals, nu, ni)
    compiled = sgd.compiled_body(sgd.data.keys, np.asarray(sgd.data), sgd._params(sgd.captured()), sgd.plan.accesses)
    drive = compiled.drive

    def failing(*args):
        if threading.current_thread().name.endswith("-1"):
            raise RuntimeError("worker 1 failed")
        return drive(*args)

    monkeypatch.setattr(compiled, "drive", failing)
    with pytest.raises(RuntimeError, match="worker 1 failed"):
        sgd.run(workers=2)


def test_rows_indexed_by_the_key_are_prefetched_and_nothing_else():
    from orion_par import prefetch
    from orion_par.access import Access, AnySub, ConstSub, KeySub

    params = {"Z": np.zeros((5, 4)), "ndk": np.zeros((5, 3)), "nk": np.zeros(3), "v": np.zeros(9)}
    accesses = (Access("Z", (KeySub(0), KeySub(2)), True, 1, "Z[d, p]"),
                Access("ndk", (KeySub(0), AnySub("unknown")), False, 2, "ndk[d, k]"),
                Access("ndk", (KeySub(0), ConstSub(1)), True, 3, "ndk[d, 1]"),
                Access("nk", (AnySub("unknown"),), True, 4, "nk[old]"),  # not tied to the key: not prefetched
                Access("v", (KeySub(1, -1, 1),), False, 5, "v[w - 1:w + 2]"))
    assert prefetch.rows(accesses, params) == (
        ("Z", (("key", 0, 0), ("key", 2, 0)), True), ("ndk", (("key", 0, 0),), True),
        ("ndk", (("key", 0, 0), ("const", 1, 0)), True), ("v", (("key", 1, -1),), False))
    keys, vals, nu, ni = _mf_case()
    sgd, _, _ = _mf(keys, vals, nu, ni)
    sgd.run(workers=2, epochs=0)
    (compiled,) = sgd._compiled.values()
    assert "_orion_mem.prefetch_write(W, (keys[_orion_r + 8, 0] + 0) * W.strides[0], W.strides[0])" in compiled.source


PAIR = DistArray(np.zeros((6, 6)))


def test_a_construct_numba_miscompiles_runs_as_python():
    # numba 0.68 drops the write through t[0] when the function also has a comprehension.
    data = DistArray.from_coo(np.stack([np.arange(6), np.arange(6)], axis=1), np.ones(6))

    @parallel_for(data)
    def body(key, value):
        u, i = key
        t = (PAIR[u], PAIR[u])
        row = t[0]
        row[i] += value
        _ = [q for q in range(2)]

    with pytest.warns(CompileFallbackWarning, match="numba loses writes through an array taken out of a tuple"):
        body.run(workers=2)
    assert np.array_equal(PAIR, np.eye(6))
