"""Bodies that call the user's functions: the analyzer sees what the callees touch, the executor gives
them the current arrays, and calls it cannot read are refused with a fix that works."""

from __future__ import annotations

import collections
import functools
import warnings

import numba
import numpy as np
import pytest

from orion_par import (
    BadBodyError,
    CompileFallbackWarning,
    DistArray,
    NotParallelizableError,
    parallel_for,
    pure,
)

RNG = np.random.default_rng(3)
N = 600
KEYS = np.stack([RNG.integers(0, 12, N), RNG.integers(0, 9, N)], axis=1)
DATA = DistArray.from_coo(KEYS, RNG.random(N))
HG_U = DistArray(np.zeros(12))
HG_I = DistArray(np.zeros(9))
P = np.ones(12)
Q = np.ones(9)
OUT = DistArray(np.zeros(12))
ROWS = DistArray(np.zeros((12, 3)))


def _item_ema(i, r):
    HG_I[i] = 0.9 * HG_I[i] + 0.1 * r  # an array the body never names


def _record_both(u, i, r, scale=1.0):
    HG_U[u] += scale * r
    _item_ema(i, r)


@numba.njit
def _pq(u, i):
    return P[u] * Q[i]


def _row(u):
    return ROWS[u]


def _parallel_equals_serial(fn, arrays, workers=2, epochs=2):
    start = [a.copy() for a in arrays]
    fn.epochs_run = 0
    fn.run(workers=workers, epochs=epochs)
    parallel = [a.copy() for a in arrays]
    for a, s in zip(arrays, start, strict=True):
        a[...] = s
    fn.run_serial(order=fn.schedule(workers).serial_order(epochs, 0), epochs=1)
    return all(np.array_equal(a, p) for a, p in zip(arrays, parallel, strict=True))


def test_a_global_written_only_by_a_helper_is_seen_and_kept_exact():
    @parallel_for(DATA)
    def body(key, value):
        u, i = key
        HG_U[u] += value
        _item_ema(i, value)

    plan = body.plan
    assert plan.scheme == "2d"  # HG_U by u, HG_I (the helper's) by i: not 1d, which would race on HG_I
    assert "HG_I" in plan.written and "_item_ema" in str(plan)
    assert _parallel_equals_serial(body, [HG_U, HG_I])


def test_nested_helpers_keywords_and_defaults():
    @parallel_for(DATA)
    def body(key, value):
        _record_both(key[0], key[1], value)
        _record_both(key[0], key[1], r=value, scale=0.5)

    assert body.plan.scheme == "2d"
    assert _parallel_equals_serial(body, [HG_U, HG_I])


def test_a_compiled_helper_reads_the_current_globals_not_a_frozen_copy():
    @parallel_for(DATA)
    def body(key, value):
        u, i = key
        OUT[u] += _pq(u, i)

    OUT[:] = 0
    P[:] = 1.0
    body.run(workers=1)
    assert OUT.sum() == N
    P[:] = 2.0  # numba would have frozen P = 1 into _pq
    OUT[:] = 0
    body.run(workers=2)
    assert OUT.sum() == 2 * N


def test_a_view_returned_by_a_helper_is_written_through():
    @parallel_for(DATA)
    def body(key, value):
        row = _row(key[0])
        row[1] += value

    plan = body.plan
    assert plan.scheme == "1d" and plan.space_dim == 0
    assert any(a.array == "ROWS" and a.is_write for a in plan.accesses)


def test_a_helpers_own_array_under_a_name_the_body_uses_for_another_array():
    other = DistArray(np.zeros(9))

    def make_writer():
        OUT = other

        def write(i, r):
            OUT[i] += r

        return write

    writer = make_writer()

    @parallel_for(DATA)
    def body(key, value):
        OUT[key[0]] += value
        writer(key[1], value)

    plan = body.plan
    assert plan.scheme == "2d"
    assert {"OUT", "OUT_1"} <= set(plan.written)
    assert _parallel_equals_serial(body, [OUT, other])


def test_recursion_is_refused_with_the_call():
    @parallel_for(DATA)
    def body(key, value):
        _countdown(key[0])

    with pytest.raises(NotParallelizableError, match=r"_countdown.*calls itself"):
        _ = body.plan


def _countdown(n):
    if n > 0:
        OUT[n] += 1
        _countdown(n - 1)


def test_a_function_without_source_is_refused_and_declaring_it_pure_works():
    namespace: dict = {}
    exec("def scaled(x):\n    return 2.0 * x\n", namespace)  # no file: its source cannot be read
    scaled = namespace["scaled"]

    def make_body():
        @parallel_for(DATA)
        def body(key, value):
            OUT[key[0]] += scaled(value)

        return body

    with pytest.raises(NotParallelizableError, match=r"line \d+ calls `scaled`.*@orion_par.pure"):
        _ = make_body().plan
    pure(scaled)  # the suggested fix
    body = make_body()
    assert body.plan.scheme == "1d"
    OUT[:] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompileFallbackWarning)  # numba cannot compile an exec'd function
        body.run(workers=2)
    assert np.isclose(OUT.sum(), 2 * np.asarray(DATA).sum())


def test_a_call_through_a_local_name_is_refused_and_the_global_name_works():
    @parallel_for(DATA)
    def by_local(key, value):
        f = _item_ema
        f(key[1], value)

    with pytest.raises(NotParallelizableError, match=r"line \d+ calls `f`, a local name.*global name"):
        _ = by_local.plan

    @parallel_for(DATA)
    def by_global(key, value):
        _item_ema(key[1], value)

    assert by_global.plan.scheme == "1d" and by_global.plan.space_dim == 1


def test_a_bound_method_of_the_users_class_is_refused():
    class Model:
        def update(self, i, r):
            HG_I[i] += r

    update = Model().update

    @parallel_for(DATA)
    def body(key, value):
        update(key[1], value)

    with pytest.raises(NotParallelizableError, match=r"calls `update` \(method\)"):
        _ = body.plan


def test_a_helper_called_from_an_inner_function_is_seen():
    @parallel_for(DATA)
    def body(key, value):
        def step(i, r):
            _item_ema(i, r)  # walked with i unknown: any element of HG_I

        HG_U[key[0]] += value
        step(key[1], value)

    with pytest.raises(NotParallelizableError, match=r"HG_I\[i\] in `_item_ema`") as info:
        _ = body.plan
    assert "accumulator" not in info.value.fixes  # the body never names HG_I: an Accumulator could not help


def _scale_row(HG_U, u, i, r):  # a parameter named like a global array its callee uses
    HG_U[u] += r
    _record_both(u, i, r)


def test_a_helper_parameter_named_like_a_callees_global():
    other = DistArray(np.zeros(12))

    @parallel_for(DATA)
    def body(key, value):
        _scale_row(other, key[0], key[1], value)

    plan = body.plan
    assert {"HG_U", "HG_I", "other"} <= set(plan.written)
    assert _parallel_equals_serial(body, [other, HG_U, HG_I])


V0 = DistArray(np.zeros(3))


def _bump_v0(x):
    V0[0] += x


def _views_of_v0():
    yield V0[0:1]


@functools.cache
def _cached_bump(x):
    V0[0] += x


def test_hidden_writes_are_refused_not_planned():
    """Each body writes V0[0] for every record: no parallel plan keeps that (found by fuzzing)."""

    def by_match(key, value):
        match value:
            case _:
                V0[0] += value

    def by_expression(key, value):
        [_bump_v0][0](value)

    def by_dunder_call(key, value):
        _bump_v0.__call__(value)

    def by_cached(key, value):
        _cached_bump(value)

    def by_generator(key, value):
        for row in _views_of_v0():
            row[0] += value

    def by_exec(key, value):
        exec("V0[0] += 1")

    def by_globals(key, value):
        globals()["V0"][0] += value

    for body in (by_match, by_expression, by_dunder_call, by_cached, by_generator, by_exec, by_globals):
        with pytest.raises(NotParallelizableError, match=r"line \d+"):
            _ = parallel_for(DATA)(body).plan


def test_a_body_wrapped_by_another_decorator_is_refused_with_the_fix():
    def logged(fn):
        @functools.wraps(fn)
        def wrapper(*args):
            return fn(*args)

        return wrapper

    @logged
    def body(key, value):
        V0[0] += value

    with pytest.raises(BadBodyError, match=r"line \d+\) is wrapped by another decorator.*directly on the `def`"):
        parallel_for(DATA)(body)


def _make_data():
    return DATA


def test_a_function_called_in_the_decorator_is_not_a_helper():
    @parallel_for(_make_data())
    def body(key, value):
        HG_U[key[0]] += value

    assert body.plan.scheme == "1d" and not body.graph.helpers


class _Logger:
    def __init__(self, u, r):
        HG_U[u] += r  # a constructor that writes a global array


def test_a_class_of_the_users_is_refused_and_a_namedtuple_is_not():
    @parallel_for(DATA)
    def body(key, value):
        _Logger(key[0], value)

    with pytest.raises(NotParallelizableError, match=r"calls `_Logger` \(type\)"):
        _ = body.plan

    pair = collections.namedtuple("pair", "u r")

    @parallel_for(DATA)
    def with_tuple(key, value):
        p = pair(key[0], value)
        HG_U[key[0]] += p.r

    assert with_tuple.plan.scheme == "1d"
