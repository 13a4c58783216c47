"""Every fix a refusal offers works: each test takes a refused body, checks which fixes the error offers
(``NotParallelizableError.fixes``), applies each one, and runs the fixed loop.  Other errors' advice
(float keys, bounds, unsorted data, aliases, attributes, record writes) is followed the same way."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from orion_par import (
    Accumulator,
    BadBodyError,
    Buffer,
    DataOrderError,
    DistArray,
    NotParallelizableError,
    parallel_for,
)
from orion_par.explain import FIXES

RNG = np.random.default_rng(21)
N = 400
KEYS = np.stack([RNG.integers(0, 20, N), RNG.integers(0, 15, N)], axis=1)
DATA = DistArray.from_coo(KEYS, RNG.random(N))
# The fixes each refusal below offers; every one is applied in its test.
EXPECTED = {
    "total": ("accumulator", "buffer", "data_parallel", "run_serial"),
    "histogram": ("accumulator", "buffer", "data_parallel", "key_subscript", "run_serial"),
    "list": ("return", "accumulator"),
    "dict": ("name_arrays",),
    "series": ("series_key", "run_serial"),
}


def _refusal(fn, case):
    with pytest.raises(NotParallelizableError) as info:
        _ = fn.plan
    assert info.value.fixes == EXPECTED[case]
    return info.value


def _runs(fn, workers=2):
    _ = fn.plan  # plans
    return fn.run(workers=workers, epochs=2)


# -- a global total --------------------------------------------------------------------------------
TOTAL = DistArray(np.zeros(1))


def test_a_global_total_offers_accumulator_buffer_parameter_server_and_serial():
    @parallel_for(DATA)
    def body(key, value):
        TOTAL[0] += value

    _refusal(body, "total")
    want = float(np.sum(np.asarray(DATA)))

    total = Accumulator("sum")  # accumulator

    @parallel_for(DATA)
    def with_accumulator(key, value):
        total[0] += value

    assert _runs(with_accumulator).accumulated["total"][-1] == pytest.approx(want)

    buffered = Buffer(np.zeros(1))  # buffer

    @parallel_for(DATA)
    def with_buffer(key, value):
        buffered[0] += value

    _runs(with_buffer)
    assert buffered[0] == pytest.approx(2 * want)

    @parallel_for(DATA, allow_data_parallel=True)  # data_parallel
    def with_server(key, value):
        TOTAL[0] += value

    TOTAL[0] = 0
    _runs(with_server)
    assert TOTAL[0] == pytest.approx(2 * want)

    TOTAL[0] = 0
    body.run_serial()  # run_serial
    assert TOTAL[0] == pytest.approx(want)


# -- a subscript computed from data ----------------------------------------------------------------
HIST = DistArray(np.zeros(20))


def test_a_computed_subscript_also_offers_indexing_by_the_key():
    @parallel_for(DATA)
    def body(key, value):
        HIST[int(value * 20)] += 1.0

    assert "index HIST by the key" in str(_refusal(body, "histogram"))

    @parallel_for(DATA)
    def by_key(key, value):  # key_subscript
        HIST[key[0]] += 1.0

    HIST[:] = 0
    _runs(by_key)
    assert HIST.sum() == 2 * N


# -- a Python list every record appends to -----------------------------------------------------------
LOSSES: list[float] = []


def test_a_shared_list_offers_return_and_accumulator():
    @parallel_for(DATA)
    def body(key, value):
        LOSSES.append(value * value)

    _refusal(body, "list")
    want = float(np.sum(np.asarray(DATA) ** 2))

    @parallel_for(DATA)
    def returns(key, value):  # return
        return value * value

    assert _runs(returns).returned[-1] == pytest.approx(want)

    loss = Accumulator("sum")

    @parallel_for(DATA)
    def accumulates(key, value):  # accumulator
        loss[0] += value * value

    assert _runs(accumulates).accumulated["loss"][-1] == pytest.approx(want)


# -- arrays held in a dict ---------------------------------------------------------------------------
PARAMS = {"W": DistArray(np.zeros((20, 2))), "H": DistArray(np.zeros((15, 2)))}


def test_arrays_in_a_dict_are_bound_to_names():
    @parallel_for(DATA)
    def body(key, value):
        u, i = key
        PARAMS["W"][u, 0] += value
        PARAMS["H"][i, 0] += value

    assert "`W = PARAMS['W']`" in str(_refusal(body, "dict"))
    W, H = PARAMS["W"], PARAMS["H"]  # name_arrays

    @parallel_for(DATA)
    def named(key, value):
        u, i = key
        W[u, 0] += value
        H[i, 0] += value

    assert named.plan.scheme == "2d"
    _runs(named)
    assert PARAMS["W"][:, 0].sum() == pytest.approx(2 * np.asarray(DATA).sum())


# -- an ordered recurrence ---------------------------------------------------------------------------
T = 60
SERIES = DistArray.from_coo(np.arange(T), RNG.random(T))
S = DistArray(np.zeros(T + 1))


def test_an_ordered_single_series_offers_a_series_key_and_the_serial_run():
    @parallel_for(SERIES, ordered=True)
    def body(key, value):
        t = key[0]
        S[t + 1] = 0.5 * S[t] + value

    assert "Buffer" not in str(_refusal(body, "series"))  # a late update cannot keep an ordered result
    body.run_serial()  # run_serial
    expected = np.zeros(T + 1)
    for t in range(T):
        expected[t + 1] = 0.5 * expected[t] + np.asarray(SERIES)[t]
    assert np.array_equal(S, expected)

    several = np.stack([np.repeat(np.arange(3), T), np.tile(np.arange(T), 3)], axis=1)  # series_key
    S3 = DistArray(np.zeros((3, T + 1)))

    @parallel_for(DistArray.from_coo(several, np.tile(np.asarray(SERIES), 3)), ordered=True)
    def by_series(key, value):
        s, t = key
        S3[s, t + 1] = 0.5 * S3[s, t] + value

    assert by_series.plan.scheme == "1d"
    by_series.run(workers=2)
    assert all(np.array_equal(S3[s], expected) for s in range(3))


def test_every_fix_code_is_exercised_here():
    assert set().union(*EXPECTED.values()) == set(FIXES)


# -- other errors' advice ----------------------------------------------------------------------------
def test_a_global_statement_is_fixed_by_returning_the_value():
    @parallel_for(DATA)
    def body(key, value):
        global COUNT
        COUNT += value

    with pytest.raises(NotParallelizableError, match=r"`return` it from the body.*Accumulator"):
        _ = body.plan

    @parallel_for(DATA)
    def fixed(key, value):
        return value

    assert fixed.run(workers=2).returned[0] == pytest.approx(np.asarray(DATA).sum())


COUNT = 0.0


def test_fractional_keys_are_refused_and_the_suggested_mapping_works():
    keys = np.array([0.5, 1.5, 0.5, 2.0])
    with pytest.raises(BadBodyError, match=r"record 0 has key \(0.5,\).*np.unique\(col, return_inverse=True\)\[1\]"):
        DistArray.from_coo(keys, np.ones(4))
    ids = np.unique(keys, return_inverse=True)[1]  # the fix
    data = DistArray.from_coo(ids, np.ones(4))
    assert data.keys[:, 0].tolist() == [0, 1, 0, 2]
    assert DistArray.from_coo(np.array([1.0, 3.0]), np.ones(2)).keys[:, 0].tolist() == [1, 3]  # whole floats pass


STEPS = 30
GRID = np.stack(np.meshgrid(np.arange(3), np.arange(STEPS), indexing="ij"), -1).reshape(-1, 2)
SMOOTH_DATA = DistArray.from_coo(GRID, RNG.random(GRID.shape[0]))
EW = DistArray(np.zeros((3, STEPS)))


def test_a_boundary_guard_is_understood_and_an_unguarded_read_gets_the_guard_as_advice():
    @parallel_for(SMOOTH_DATA, ordered=True)
    def unguarded(key, value):
        s, t = key
        EW[s, t] = 0.9 * EW[s, t - 1] + 0.1 * value

    with pytest.raises(BadBodyError, match=r"records with t < 1 would index -1.*`if t >= 1:`"):
        unguarded.run(workers=2)

    @parallel_for(SMOOTH_DATA, ordered=True)
    def guarded(key, value):  # the fix
        s, t = key
        if t >= 1:
            EW[s, t] = 0.9 * EW[s, t - 1] + 0.1 * value
        else:
            EW[s, t] = value

    @parallel_for(SMOOTH_DATA, ordered=True)
    def early_exit(key, value):  # the same guard as an early return
        s, t = key
        if t == 0:
            EW[s, t] = value
            return
        EW[s, t] = 0.9 * EW[s, t - 1] + 0.1 * value

    for body in (guarded, early_exit):
        EW[...] = 0
        body.run(workers=2)
        values = np.asarray(SMOOTH_DATA).reshape(3, STEPS)
        want = np.zeros((3, STEPS))
        for t in range(STEPS):
            want[:, t] = values[:, t] if t == 0 else 0.9 * want[:, t - 1] + 0.1 * values[:, t]
        assert np.array_equal(EW, want)


SMALL = DistArray(np.zeros(10))


def test_an_array_too_small_for_the_keys_gets_the_size_it_needs():
    @parallel_for(DATA)
    def body(key, value):
        SMALL[key[0]] += value

    with pytest.raises(BadBodyError, match=r"Make SMALL at least 20 along dimension 0"):
        body.run(workers=2)
    big = DistArray(np.zeros(20))  # the fix

    @parallel_for(DATA)
    def fixed(key, value):
        big[key[0]] += value

    _runs(fixed)


def test_unsorted_data_for_a_wavefront_is_fixed_by_the_suggested_sort():
    keys = np.stack([RNG.integers(0, 6, 80), RNG.integers(0, 6, 80)], axis=1)
    grid = DistArray(np.zeros((7, 7)))

    def make(data):
        @parallel_for(data, ordered=True)
        def wave(key, value):
            i, j = key
            grid[i + 1, j + 1] = grid[i, j + 1] + grid[i + 1, j] + value

        return wave

    with pytest.raises(DataOrderError, match=r"order = np.lexsort\(keys.T\[::-1\]\)"):
        make(DistArray.from_coo(keys, np.ones(80))).run(workers=2)
    order = np.lexsort(keys.T[::-1])  # the fix, as the message writes it
    make(DistArray.from_coo(keys[order], np.ones(80))).run(workers=2)


def test_an_array_behind_an_attribute_is_bound_to_a_name():
    model = SimpleNamespace(W=DistArray(np.zeros(20)))

    @parallel_for(DATA)
    def body(key, value):
        model.W[key[0]] += value

    with pytest.raises(BadBodyError, match=r"`W = model.W`"):
        _ = body.plan
    W_ = model.W  # the fix

    @parallel_for(DATA)
    def fixed(key, value):
        W_[key[0]] += value

    _runs(fixed)


def test_two_names_for_one_array_and_a_copy_fixes_it():
    base = DistArray(np.zeros(20))
    alias = base[:]

    @parallel_for(DATA)
    def body(key, value):
        base[key[0]] += value
        alias[key[0]] += value

    with pytest.raises(BadBodyError, match=r"pass a copy"):
        _ = body.plan
    alias = base.copy()  # the fix

    @parallel_for(DATA)
    def fixed(key, value):
        base[key[0]] += value
        alias[key[0]] += value

    _runs(fixed)


PER_RECORD = DistArray(np.zeros((20, 15)))


def test_a_write_to_the_record_value_goes_to_a_keyed_array():
    rows = DistArray.from_coo(KEYS, RNG.random((N, 2)))

    @parallel_for(rows)
    def body(key, value):
        value[0] = 1.0

    with pytest.raises(BadBodyError, match=r"Store per-record state in a DistArray indexed by the key"):
        _ = body.plan

    @parallel_for(rows)
    def fixed(key, value):
        u, i = key
        PER_RECORD[u, i] = value[0]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _runs(fixed)
