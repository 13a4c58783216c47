"""The data-parallel fallback: parallel_for's relaxed arrays served by the parameter server."""

from __future__ import annotations

import numpy as np
import pytest

from orion_par import Buffer, DistArray, parallel_for
from orion_par.local import BlockData
from orion_par.ps import BadTableError, ClientOptions
from orion_par.ps.data_parallel import DataParallelOptions, run_data_parallel, table_specs


def _run(f, workers, epochs, options=None, seed=None):
    """What parallel_for.run would do with the hook: schedule, block data, compiled body, then the PS run."""
    plan = f.plan
    sched = f.schedule(workers)
    params = {n: np.asarray(v) for n, v in f.captured().items() if isinstance(v, np.ndarray)}
    params.update({n: v for n, v in f.captured().items() if isinstance(v, (int, float))})
    data = BlockData(np.ascontiguousarray(f.data.keys[sched.perm]), np.ascontiguousarray(np.asarray(f.data)[sched.perm]),
                     params)
    compiled = f.compiled_body(data.keys, data.values, params)
    return plan, run_data_parallel(compiled, data, sched, epochs, plan.relaxed, seed, options)


def test_histogram_with_a_global_total_is_exact():
    # `total` is written by every record: no scheme fits, so it goes to the parameter server.
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 20, (2000, 1))
    counts = DistArray(np.zeros(20))
    total = DistArray(np.zeros(1))

    @parallel_for(DistArray.from_coo(keys, np.ones(2000)), allow_data_parallel=True)
    def hist(key, value):
        counts[key[0]] += value
        total[0] += value

    plan, busy = _run(hist, workers=2, epochs=3)
    assert "total" in plan.data_parallel and len(busy) == 2
    assert total[0] == 6000.0  # additive increments: nothing lost, nothing twice
    np.testing.assert_array_equal(counts, 3 * np.bincount(keys[:, 0], minlength=20))


def test_buffer_counts_stay_consistent_with_managed_communication():
    rng = np.random.default_rng(1)
    keys = np.stack([rng.integers(0, 30, 3000), rng.integers(0, 5, 3000)], axis=1)
    per_doc = DistArray(np.zeros((30, 5), np.int64))
    topic_totals = Buffer(np.zeros(5, np.int64), max_delay=2)

    @parallel_for(DistArray.from_coo(keys, np.ones(3000)))
    def count(key, value):
        d, k = key
        per_doc[d, k] += 1
        topic_totals[k] += 1

    opts = DataParallelOptions(ClientOptions(bandwidth_bytes_per_s=5e6, policy="magnitude"))
    _run(count, workers=2, epochs=2, options=opts)
    np.testing.assert_array_equal(topic_totals, 2 * np.bincount(keys[:, 1], minlength=5))
    np.testing.assert_array_equal(np.asarray(per_doc).sum(axis=0), np.asarray(topic_totals))


def test_sgd_with_one_worker_tracks_the_serial_run():
    rng = np.random.default_rng(2)
    keys = np.stack([rng.integers(0, 40, 1500), rng.integers(0, 30, 1500)], axis=1)
    vals = rng.random(1500)
    W = DistArray(rng.normal(0, 0.3, (40, 3)))
    H = DistArray(rng.normal(0, 0.3, (30, 3)))
    bias = DistArray(np.zeros(1))
    W0, H0 = W.copy(), H.copy()

    @parallel_for(DistArray.from_coo(keys, vals), allow_data_parallel=True)
    def sgd(key, value):
        u, i = key
        err = value - bias[0]
        for r in range(3):
            err -= W[u, r] * H[i, r]
        bias[0] += 0.01 * err
        for r in range(3):
            wr = W[u, r]
            W[u, r] += 0.02 * err * H[i, r]
            H[i, r] += 0.02 * err * wr

    _run(sgd, workers=1, epochs=2)
    ps_result = (W.copy(), H.copy(), bias.copy())
    W[...], H[...], bias[...] = W0, H0, 0.0
    sgd.run_serial(order=sgd.schedule(1).serial_order(), epochs=2)
    for got, want in zip(ps_result, (W, H, bias), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_table_specs_reject_scalars():
    with pytest.raises(BadTableError, match="at least one dimension"):
        table_specs({"x": np.float64(1.0)}, {"x": 1})
    with pytest.raises(BadTableError, match="max_delay"):
        table_specs({"x": np.zeros(3)}, {"x": 0})


def test_parallel_for_run_sends_data_parallel_arrays_through_the_server(monkeypatch):
    import orion_par.ps.data_parallel as dp

    calls = []
    real = dp.run_data_parallel
    monkeypatch.setattr(dp, "run_data_parallel", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 16, (1500, 1))
    counts = DistArray(np.zeros(16))
    total = DistArray(np.zeros(1))

    @parallel_for(DistArray.from_coo(keys, np.ones(1500)), allow_data_parallel=True)
    def hist(key, value):
        counts[key[0]] += value
        total[0] += value

    hist.run(workers=2, epochs=2)
    assert calls and "total" in calls[0]            # the plan's relaxed arrays went to the server
    assert total[0] == 3000.0
    np.testing.assert_array_equal(counts, 2 * np.bincount(keys[:, 0], minlength=16))
