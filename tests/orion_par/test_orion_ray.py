"""The Ray executor gives exactly the local executor's results (one Ray for the whole module)."""

from __future__ import annotations

import numpy as np
import pytest

from orion_par import Buffer, DistArray, parallel_for

ray = pytest.importorskip("ray", reason="ray is not installed (pip install ray==2.60.0)")


def _compare(fn, arrays, **run):
    start = [a.copy() for a in arrays]
    first_epoch = fn.epochs_run  # both backends run the same epochs, so the same stratum orders
    fn.run(backend="local", **run)
    local = [a.copy() for a in arrays]
    for a, s in zip(arrays, start, strict=True):
        a[...] = s
    fn.epochs_run = first_epoch
    fn.run(backend="ray", **run)
    for a, want in zip(arrays, local, strict=True):
        assert np.array_equal(a, want)
    return local


def test_mf_2d_on_ray_equals_local(ray_session):
    rng = np.random.default_rng(0)
    keys = np.stack([rng.integers(0, 60, 4000), rng.integers(0, 25, 4000)], axis=1)
    W = DistArray(rng.random((60, 3)))
    H = DistArray(rng.random((25, 3)))

    @parallel_for(DistArray.from_coo(keys, rng.random(4000)))
    def sgd(key, value):
        u, i = key
        err = value
        for r in range(3):
            err -= W[u, r] * H[i, r]
        for r in range(3):
            wr = W[u, r]
            W[u, r] += 0.02 * err * H[i, r]
            H[i, r] += 0.02 * err * wr

    assert sgd.plan.scheme == "2d"
    before = W.copy()
    _compare(sgd, [W, H], workers=2, epochs=2, time_partitions=3)
    assert not np.array_equal(W, before)
    _compare(sgd, [W, H], workers=2, epochs=1, time_partitions=3)  # reused actors start from new values
    sgd.close()


def test_mf_2d_with_several_chunks_per_block_on_ray_equals_local(ray_session, monkeypatch):
    from orion_par import schedule as schedule_module

    monkeypatch.setattr(schedule_module, "_MIN_CHUNK", 200)  # 4000 records, 2 workers x 3 time parts: 3 chunks
    rng = np.random.default_rng(1)
    keys = np.stack([rng.integers(0, 60, 4000), rng.integers(0, 25, 4000)], axis=1)
    W = DistArray(rng.random((60, 3)))
    H = DistArray(rng.random((25, 3)))

    @parallel_for(DistArray.from_coo(keys, rng.random(4000)))
    def sgd(key, value):
        u, i = key
        err = value
        for r in range(3):
            err -= W[u, r] * H[i, r]
        for r in range(3):
            wr = W[u, r]
            W[u, r] += 0.02 * err * H[i, r]
            H[i, r] += 0.02 * err * wr

    assert sgd.schedule(2, 3).chunks == 3
    _compare(sgd, [W, H], workers=2, epochs=2, time_partitions=3)
    sgd.close()


def test_buffer_and_random_numbers_on_ray_equal_local(ray_session):
    rng = np.random.default_rng(1)
    keys = np.stack([rng.integers(0, 40, 3000), rng.integers(0, 30, 3000)], axis=1)
    counts = DistArray(np.zeros((40, 5)))
    totals = Buffer(np.zeros(5), max_delay=2)

    @parallel_for(DistArray.from_coo(keys, rng.random(3000)))
    def body(key, value):
        k = int(np.random.random() * 5)
        counts[key[0], k] += value
        totals[k] += value

    assert body.plan.scheme == "1d"
    _compare(body, [counts, totals], workers=2, epochs=3, seed=11)
    assert np.isclose(totals.sum(), counts.sum())
    body.close()


def test_wavefront_on_ray_equals_local(ray_session):
    rng = np.random.default_rng(2)
    keys = np.array([(i, j) for i in range(20) for j in range(16) if rng.random() < 0.8])
    A = DistArray(np.zeros((21, 17)))

    @parallel_for(DistArray.from_coo(keys, rng.random(len(keys))), ordered=True)
    def dp(key, value):
        i, j = key
        A[i + 1, j + 1] = max(A[i, j + 1], A[i + 1, j]) + value

    assert dp.plan.scheme == "2d_ordered"
    _compare(dp, [A], workers=2, epochs=2, time_partitions=4)
    dp.close()


def test_lda_on_ray_equals_local(ray_session):
    from models.lda import LdaState, parallel_gibbs, synthetic_corpus

    corpus = synthetic_corpus(40, 30, 50, 4, seed=0)
    state = LdaState.random(corpus, 4, seed=1)
    gibbs = parallel_gibbs(corpus, state)
    _compare(gibbs, [state.Z, state.ndk, state.nwk, state.nk], workers=2, epochs=3, seed=5)
    assert np.array_equal(state.nwk.sum(axis=0), np.asarray(state.nk))
    gibbs.close()


HELPER_I = DistArray(np.zeros(25))


def _helper_writes_a_global(i, r):
    HELPER_I[i] = 0.5 * HELPER_I[i] + r  # an array the body never names: each actor must update its copy


def test_a_helper_writing_a_global_on_ray_equals_local(ray_session):
    rng = np.random.default_rng(2)
    keys = np.stack([rng.integers(0, 60, 3000), rng.integers(0, 25, 3000)], axis=1)
    U = DistArray(np.zeros(60))

    @parallel_for(DistArray.from_coo(keys, rng.random(3000)))
    def body(key, value):
        U[key[0]] += value
        _helper_writes_a_global(key[1], value)

    assert body.plan.scheme == "2d"
    _compare(body, [U, HELPER_I], workers=2, epochs=2)
    body.close()


def test_accumulators_on_ray_equal_local(ray_session):
    from orion_par import Accumulator

    rng = np.random.default_rng(4)
    keys = np.stack([rng.integers(0, 40, 2000), rng.integers(0, 30, 2000)], axis=1)
    W, H = DistArray(rng.random(40)), DistArray(rng.random(30))
    loss = Accumulator("sum")

    @parallel_for(DistArray.from_coo(keys, rng.random(2000)))
    def sgd(key, value):
        u, i = key
        err = value - W[u] * H[i]
        W[u] += 0.05 * err * H[i]
        H[i] += 0.05 * err * W[u]
        loss[0] += err * err
        return err

    start = W.copy(), H.copy()
    local = sgd.run(workers=2, epochs=2)
    W[...], H[...] = start
    sgd.epochs_run = 0
    on_ray = sgd.run(workers=2, epochs=2, backend="ray")
    assert on_ray.accumulated == local.accumulated and len(local.returned) == 2
    sgd.close()
