"""The analyzer classifies bodies it has never seen as a careful person would (scheme and refusals)."""

from __future__ import annotations

import numpy as np
import pytest

from orion_par import Buffer, DistArray, NotParallelizableError, parallel_for
from orion_par.access import FULL, UNKNOWN, ConstSub, KeySub
from orion_par.analyzer import analyze_body
from orion_par.body import load_body
from orion_par.errors import BadBodyError

RNG = np.random.default_rng(0)
KEYS2 = np.stack([RNG.integers(0, 20, 200), RNG.integers(0, 15, 200)], axis=1)
DATA2 = DistArray.from_coo(KEYS2, RNG.random(200))
DATA1 = DistArray.from_coo(RNG.integers(0, 50, 100), RNG.random(100))
W = DistArray(RNG.random((20, 4)))
H = DistArray(RNG.random((15, 4)))
A = DistArray(np.zeros((21, 16)))
V = DistArray(np.zeros(60))
TOTAL = DistArray(np.zeros(1))
K = 4
LR = 0.05


def _accesses(fn, captured, key_ndim=2):
    analysis = analyze_body(load_body(fn), captured, key_ndim)
    return {(a.array, a.subs, a.is_write) for a in analysis.accesses}


def test_mf_update_is_2d_with_users_in_space():
    @parallel_for(DATA2)
    def sgd(key, value):
        u, i = key
        w = W[u]
        h = H[i]
        err = value
        for r in range(K):
            err -= w[r] * h[r]
        for r in range(K):
            wr = w[r]
            w[r] += LR * err * h[r]
            h[r] += LR * err * wr

    plan = sgd.plan
    assert plan.scheme == "2d"
    assert (plan.space_dim, plan.time_dim) == (0, 1)  # W (more rows, more bytes) stays put
    assert plan.space_arrays == ("W",)
    assert "W" in str(plan) and "H" in str(plan) and "2d" in str(plan)


def test_alias_write_through_augassign_is_a_write_of_the_row():
    def body(key, value):
        w = W[key[0]]
        w += value

    found = _accesses(body, {"W": W})
    assert ("W", (KeySub(0), FULL), True) in found
    assert ("W", (KeySub(0), FULL), False) in found


def test_index_arithmetic_and_constants():
    def body(key, value):
        i, j = key
        A[i + 1, j - 2] = A[1 + i, 3] + A[i, :].sum()

    found = _accesses(body, {"A": A})
    assert ("A", (KeySub(0, 1, 1), KeySub(1, -2, -2)), True) in found
    assert ("A", (KeySub(0, 1, 1), ConstSub(3)), False) in found
    assert ("A", (KeySub(0), FULL), False) in found


def test_loop_counter_and_data_values_are_unknown():
    def body(key, value):
        for r in range(K):
            A[key[0], r] = V[int(value)]

    found = _accesses(body, {"A": A, "V": V})
    assert ("A", (KeySub(0), UNKNOWN), True) in found
    assert ("V", (UNKNOWN,), False) in found


def test_range_around_the_key_gives_an_interval():
    def body(key, value):
        s = 0.0
        for j in range(key[0] - 1, key[0] + 2):
            s += V[j]
        TOTAL[0] = s

    found = _accesses(body, {"V": V, "TOTAL": TOTAL}, key_ndim=1)
    assert ("V", (KeySub(0, -1, 1),), False) in found


def test_if_else_aliases_are_joined():
    def body(key, value):
        u, i = key
        x = W[u] if value > 0.5 else H[i]
        if value > 0.2:
            y = x
        else:
            y = W[u]
        y[0] += 1.0

    found = _accesses(body, {"W": W, "H": H})
    assert ("W", (KeySub(0), ConstSub(0)), True) in found
    assert ("H", (KeySub(1), ConstSub(0)), True) in found


def test_unknown_call_and_method_may_write_their_arguments():
    def body(key, value):
        np.random.shuffle(W[key[0]])
        H[key[1]].fill(0.0)

    found = _accesses(body, {"W": W, "H": H, "np": np})
    assert ("W", (KeySub(0), FULL), True) in found
    assert ("H", (KeySub(1), FULL), True) in found


def test_a_helper_is_walked_with_its_arguments_bound():
    def helper(row, v):
        row[0] = v

    def body(key, value):
        helper(W[key[0]], value)

    found = _accesses(body, {"W": W, "helper": helper})
    assert ("W", (KeySub(0), ConstSub(0)), True) in found  # the element the helper writes, not the row


def test_pure_numpy_call_only_reads():
    def body(key, value):
        TOTAL[0] = np.dot(W[key[0]], H[key[1]])

    found = _accesses(body, {"W": W, "H": H, "TOTAL": TOTAL, "np": np})
    assert ("W", (KeySub(0), FULL), False) in found
    assert ("W", (KeySub(0), FULL), True) not in found


def test_fancy_index_makes_the_view_opaque():
    idx = np.arange(3)

    def body(key, value):
        rows = W[idx]
        rows[key[0]] = 1.0  # writes a copy, but the analyzer cannot tell: conservative

    found = _accesses(body, {"W": W, "idx": idx})
    assert any(a == "W" and w and s[0] == UNKNOWN for a, s, w in found)


def test_one_key_field_indexing_everything_is_1d():
    @parallel_for(DATA2)
    def body(key, value):
        u, i = key
        W[u, 0] += value * H[i, 1]
        A[u, i] = W[u, 1]

    assert body.plan.scheme == "1d"
    assert body.plan.space_dim == 0


def test_only_same_key_writes_need_no_scheme():
    @parallel_for(DATA2)
    def body(key, value):
        A[key[0], key[1]] = value * W[key[0], 0] + H[key[1], 0]

    assert body.plan.scheme == "none"


def test_ordered_2d_recurrence_is_a_wavefront():
    @parallel_for(DATA2, ordered=True)
    def body(key, value):
        i, j = key
        A[i + 1, j + 1] = A[i, j + 1] + A[i + 1, j] + value

    assert body.plan.scheme == "2d_ordered"
    assert "wavefront" in str(body.plan)


def test_unordered_2d_recurrence_rotates():
    @parallel_for(DATA2)
    def body(key, value):
        i, j = key
        A[i + 1, j + 1] = A[i, j + 1] + A[i + 1, j] + value

    assert body.plan.scheme == "2d"


def test_backward_dependence_refuses_a_wavefront():
    @parallel_for(DATA2, ordered=True)
    def body(key, value):
        i, j = key
        A[i + 1, j] = A[i, j + 1] + value  # reads a later column of the previous row: points back in j

    with pytest.raises(NotParallelizableError):
        _ = body.plan


def test_true_chain_dependence_is_refused_with_lines_and_fixes():
    @parallel_for(DATA1)
    def body(key, value):
        V[key[0] + 1] = V[key[0]] * 0.5 + value

    with pytest.raises(NotParallelizableError) as err:
        _ = body.plan
    msg = str(err.value)
    assert "chain dependence" in msg
    line = body.fn.__code__.co_firstlineno + 2
    assert f"line {line}" in msg
    assert "Buffer" in msg and "allow_data_parallel=True" in msg


def test_global_write_without_buffer_is_refused():
    @parallel_for(DATA2)
    def body(key, value):
        W[key[0], 0] += value
        TOTAL[0] += value

    with pytest.raises(NotParallelizableError) as err:
        _ = body.plan
    assert "TOTAL" in str(err.value) and "global write" in str(err.value)


def test_global_write_through_a_buffer_is_allowed():
    total = Buffer(np.zeros(1), max_delay=2)

    @parallel_for(DATA2)
    def body(key, value):
        W[key[0], 0] += value
        total[0] += value

    plan = body.plan
    assert plan.scheme == "1d" and plan.buffered == {"total": 2}
    assert "Buffer" in str(plan)


def test_data_dependent_subscript_is_refused():
    @parallel_for(DATA1)
    def body(key, value):
        V[int(value * 10)] += 1.0

    with pytest.raises(NotParallelizableError) as err:
        _ = body.plan
    assert "data-dependent subscript" in str(err.value)


def test_allow_data_parallel_hands_the_blocking_array_over():
    @parallel_for(DATA2, allow_data_parallel=True)
    def body(key, value):
        W[key[0], 0] += value
        TOTAL[0] += value

    plan = body.plan
    assert plan.data_parallel == ("TOTAL",)
    assert plan.scheme == "1d"
    assert "parameter server" in str(plan)


def test_index_moving_in_a_loop_is_widened_to_unknown():
    @parallel_for(DATA1)
    def body(key, value):
        j = key[0]
        while j < 40:
            V[j] += value
            j += 3

    with pytest.raises(NotParallelizableError):
        _ = body.plan


def test_global_statement_is_refused():
    counter = 0

    def body(key, value):
        nonlocal counter
        counter += 1

    with pytest.raises(NotParallelizableError) as err:
        analyze_body(load_body(body), {}, 1)
    assert "nonlocal counter" in str(err.value)
    assert counter == 0


def test_bad_signature_and_data_are_reported():
    with pytest.raises(BadBodyError, match="lambda"):
        parallel_for(DATA1)(lambda key: None)
    with pytest.raises(BadBodyError, match="from_coo"):
        parallel_for(np.zeros(3))

    def three(key, value, extra):
        pass

    with pytest.raises(BadBodyError, match=r"exactly \(key, value\)"):
        parallel_for(DATA1)(three)


def test_shared_python_containers_are_writes_every_iteration_makes():
    seen = []

    @parallel_for(DATA2)
    def body(key, value):
        W[key[0], 0] += value
        seen.append(key[0])

    with pytest.raises(NotParallelizableError, match="seen"):
        _ = body.plan

    lookup = {"scale": 2.0}

    @parallel_for(DATA2)
    def reads_only(key, value):
        W[key[0], 0] += value * lookup.get("scale", 1.0)

    assert reads_only.plan.scheme == "1d"


def test_arrays_behind_attributes_are_rejected_with_a_fix():
    class State:
        pass

    state = State()
    state.W = W

    @parallel_for(DATA2)
    def body(key, value):
        state.W[key[0], 0] += value

    with pytest.raises(BadBodyError, match="Bind it to a name"):
        _ = body.plan


def test_two_names_for_one_memory_are_rejected():
    rows = W[:10]

    @parallel_for(DATA2)
    def body(key, value):
        W[key[0], 0] += rows[key[1] % 10, 0]

    with pytest.raises(BadBodyError, match="share memory"):
        _ = body.plan


GRID = DistArray.from_coo(np.array([(i, j) for i in range(12) for j in range(10)]), np.ones(120))


def test_whole_key_as_index_touches_one_element_per_key():
    @parallel_for(GRID)
    def body(key, value):
        A[key] += value

    assert body.plan.scheme == "none"


def test_lcs_style_recurrence_with_diagonal_is_a_wavefront():
    @parallel_for(GRID, ordered=True)
    def lcs(key, value):
        i, j = key
        A[i + 1, j + 1] = max(A[i, j + 1], A[i + 1, j], A[i, j] + value)

    assert lcs.plan.scheme == "2d_ordered"
    assert "(1, 1)" in str(lcs.plan)


def test_row_prefix_sums_partition_by_row_even_when_ordered():
    @parallel_for(GRID, ordered=True)
    def prefix(key, value):
        i, j = key
        A[i, j + 1] = A[i, j] + value

    assert prefix.plan.scheme == "1d" and prefix.plan.space_dim == 0


def test_index_variable_shifted_by_augassign_keeps_its_key_offset():
    @parallel_for(GRID)
    def body(key, value):
        i, j = key
        k = i
        k += 1
        A[k, j] = A[i, j] + 1.0

    assert body.plan.scheme == "1d" and body.plan.space_dim == 1


def test_indexing_a_slice_view_is_shifted_by_the_slices_start():
    def body(key, value):
        u, i = key
        x = W[u, 1:]
        x[0] = value  # W[u, 1]
        y = W[1:]
        y[u, 0] = value  # W[u + 1, 0]
        z = W[u:]
        z[1, 2] = value  # W[u + 1, 2]
        s = W[u, ::2]
        s[1] = value  # W[u, 2]: a stepped slice is not followed
        W[u, -1] = value  # from the end: not the constant -1

    found = {(a.subs) for a in analyze_body(load_body(body), {"W": W}, 2).accesses if a.is_write}
    assert (KeySub(0), ConstSub(1)) in found
    assert (KeySub(0, 1, 1), ConstSub(0)) in found
    assert (KeySub(0, 1, 1), ConstSub(2)) in found
    assert (KeySub(0), UNKNOWN) in found
    assert (KeySub(0), ConstSub(0)) not in found and (KeySub(0), ConstSub(-1)) not in found


def test_a_write_through_an_offset_slice_conflicts_with_the_element_it_reaches():
    @parallel_for(DATA2)
    def body(key, value):
        u, i = key
        x = W[u, 1:]
        x[0] = x[0] * 0.5 + value  # really W[u, 1]
        A[i, 0] += W[i, 1]  # reads W[*, 1] by another key field

    with pytest.raises(NotParallelizableError):
        _ = body.plan
