"""Accumulators and return values: one worker gives the serial loop's values bit for bit, more workers
give the serial order's per-worker partial values combined in worker order; other uses are refused."""

from __future__ import annotations

import numpy as np
import pytest

from orion_par import Accumulator, BadBodyError, DistArray, NotParallelizableError, parallel_for

RNG = np.random.default_rng(11)
N = 800
KEYS = np.stack([RNG.integers(0, 30, N), RNG.integers(0, 20, N)], axis=1)
DATA = DistArray.from_coo(KEYS, RNG.normal(size=N))
W = DistArray(RNG.random(30))
H = DistArray(RNG.random(20))
LOSS = Accumulator("sum")
BEST = Accumulator("max")
LOW = Accumulator("min")
SEEN = Accumulator("count", 4)


def _sgd():
    @parallel_for(DATA)
    def sgd(key, value):
        u, i = key
        err = value - W[u] * H[i]
        W[u] += 0.01 * err * H[i]
        H[i] += 0.01 * err * W[u]
        LOSS[0] += err * err
        BEST[0] = max(BEST[0], err)
        LOW[0] = min(err, LOW[0])
        SEEN[u % 4] += 1
        return abs(err)

    return sgd


def _python_loop(epochs):
    """The serial loop in plain Python, in data order, with the accumulators as local variables."""
    out = []
    for _ in range(epochs):
        loss, best, low, seen, total = 0.0, -np.inf, np.inf, np.zeros(4, np.int64), 0.0
        for (u, i), value in DATA.records():
            err = value - W[u] * H[i]
            W[u] += 0.01 * err * H[i]
            H[i] += 0.01 * err * W[u]
            loss += err * err
            best = max(best, err)
            low = min(err, low)
            seen[u % 4] += 1
            total += abs(err)
        out.append((loss, best, low, seen.tolist(), total))
    return out


def _epochs(stats):
    acc = stats.accumulated
    return [(acc["LOSS"][e], acc["BEST"][e], acc["LOW"][e], acc["SEEN"][e].tolist(), stats.returned[e])
            for e in range(stats.epochs)]


def test_one_worker_equals_the_serial_loop_bit_for_bit():
    start = W.copy(), H.copy()
    want = _python_loop(epochs=2)
    W[:], H[:] = start
    sgd = _sgd()
    assert "accumulated: LOSS" in str(sgd.plan)
    got = _epochs(sgd.run(workers=1, epochs=2))
    assert got == want  # exact equality of floats
    assert float(LOSS[0]) == want[-1][0]  # the array holds the last epoch's value
    W[:], H[:] = start
    assert _epochs(sgd.run_serial(epochs=2)) == want


@pytest.mark.parametrize("workers", [2, 3])
def test_more_workers_combine_the_serial_orders_partials_in_worker_order(workers):
    @parallel_for(DATA)
    def total(key, value):
        LOSS[0] += value * value
        return value

    stats = total.run(workers=workers)
    sched = total.schedule(workers).for_epoch(0)
    values = np.asarray(DATA)[sched.perm]
    partials = []
    for w in range(workers):  # worker w's records, in the order it runs them
        p = 0.0
        for start, stop in sched.calls[w][:, :2]:
            for r in range(start, stop):
                p += values[r]
        partials.append(p)
    want = partials[0]
    for p in partials[1:]:
        want += p
    assert stats.returned == (want,)
    assert np.isclose(stats.accumulated["LOSS"][0], float(np.sum(np.asarray(DATA) ** 2)))


def test_a_read_of_an_accumulator_is_refused_and_the_suggested_form_works():
    @parallel_for(DATA)
    def reads(key, value):
        W[key[0]] += 0.001 * LOSS[0]
        LOSS[0] += value

    with pytest.raises(NotParallelizableError, match=r"line \d+ uses the accumulator `LOSS` \(sum\).*`LOSS\[i\] \+= x`"):
        _ = reads.plan

    @parallel_for(DATA)
    def updates(key, value):
        LOSS[0] += value  # the suggested form; the value is read after run()

    assert updates.run(workers=2).accumulated["LOSS"][0] == pytest.approx(float(np.sum(np.asarray(DATA))))


def test_a_helper_that_updates_an_accumulator_is_refused_and_returning_the_value_works():
    @parallel_for(DATA)
    def via_helper(key, value):
        _add_loss(value)

    with pytest.raises(NotParallelizableError, match=r"calls a function that uses the accumulator `LOSS`"):
        _ = via_helper.plan

    @parallel_for(DATA)
    def in_body(key, value):
        LOSS[0] += _square(value)

    assert in_body.run(workers=2).accumulated["LOSS"][0] == pytest.approx(float(np.sum(np.asarray(DATA) ** 2)))


def _add_loss(x):
    LOSS[0] += x * x


def _square(x):
    return x * x


def test_a_body_that_returns_on_some_paths_only_is_refused_with_a_fix_that_works():
    @parallel_for(DATA)
    def partial(key, value):
        if value > 0:
            return value

    with pytest.raises(BadBodyError, match=r"ends the body without one.*return 0.0"):
        _ = partial.plan

    @parallel_for(DATA)
    def fixed(key, value):
        if value > 0:
            return value
        return 0.0

    want = float(np.sum(np.clip(np.asarray(DATA), 0, None)))
    assert fixed.run(workers=2).returned[0] == pytest.approx(want)


def test_accumulators_with_the_parameter_server_and_a_buffer():
    @parallel_for(DATA, allow_data_parallel=True)
    def dp(key, value):
        H[0] += 0.001 * value  # no scheme partitions H[0]: it goes to the parameter server
        SEEN[key[0] % 4] += 1

    stats = dp.run(workers=2, epochs=2)
    assert stats.accumulated["SEEN"][1].tolist() == np.bincount(KEYS[:, 0] % 4, minlength=4).tolist()


def test_unknown_reductions_are_rejected():
    with pytest.raises(BadBodyError, match="choose one of"):
        Accumulator("mean")
