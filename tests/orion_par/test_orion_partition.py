"""Partitions keep equal keys together, are balanced, and concurrent blocks never share a row."""

from __future__ import annotations

from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from orion_par import DistArray, parallel_for
from orion_par import schedule as schedule_module
from orion_par.partition import partition_by_key, partition_by_whole_key

keys_1d = st.lists(st.integers(0, 30), min_size=1, max_size=300).map(lambda v: np.array(v)[:, None])


@settings(deadline=None)
@given(keys_1d, st.integers(1, 6), st.booleans())
def test_equal_keys_share_a_part_and_balance_holds(keys, parts, contiguous):
    p = partition_by_key(keys, 0, parts, contiguous=contiguous)
    for value in np.unique(keys):
        assert np.unique(p.part[keys[:, 0] == value]).size == 1
    counts = np.bincount(keys[:, 0])
    assert p.sizes.sum() == keys.shape[0]
    assert p.sizes.max() <= keys.shape[0] / parts + counts.max()  # greedy LPT / quantile-cut bound


@given(keys_1d, st.integers(1, 6))
def test_contiguous_parts_are_ranges_in_order(keys, parts):
    p = partition_by_key(keys, 0, parts, contiguous=True)
    order = np.argsort(keys[:, 0], kind="stable")
    assert np.all(np.diff(p.part[order]) >= 0)


@settings(deadline=None)
@given(keys_1d, st.integers(1, 6))
def test_prefer_ranges_never_costs_more_than_one_percent_of_balance(keys, parts):
    greedy = partition_by_key(keys, 0, parts)
    p = partition_by_key(keys, 0, parts, prefer_ranges=True)
    for value in np.unique(keys):
        assert np.unique(p.part[keys[:, 0] == value]).size == 1
    assert p.sizes.max() <= 1.01 * greedy.sizes.max()


def test_prefer_ranges_gives_ranges_on_even_keys_and_greedy_parts_on_skewed_ones():
    even = np.repeat(np.arange(1000), 20)[:, None]
    p = partition_by_key(even, 0, 4, prefer_ranges=True)
    assert np.all(np.diff(p.part) >= 0) and p.sizes.tolist() == [5000] * 4  # neighbours share a part
    # Ranges cut [0]*10 [1]*10 | [2] [3] into 10 / 12; the greedy parts {0, 2} / {1, 3} are 11 / 11.
    skewed = np.array([0] * 10 + [1] * 10 + [2] + [3])[:, None]
    p = partition_by_key(skewed, 0, 2, prefer_ranges=True)
    assert p.sizes.tolist() == [11, 11] and p.part[0] != p.part[10]


@settings(deadline=None)  # the first call loads the compiled LPT from numba's cache
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=100), st.integers(1, 4))
def test_whole_key_partition_keeps_duplicates_together(pairs, parts):
    keys = np.array(pairs)
    p = partition_by_whole_key(keys, parts)
    for k in {tuple(x) for x in pairs}:
        rows = np.all(keys == k, axis=1)
        assert np.unique(p.part[rows]).size == 1


@st.composite
def mf_problem(draw):
    n = draw(st.integers(1, 200))
    nu, ni = draw(st.integers(1, 15)), draw(st.integers(1, 15))
    rng = np.random.default_rng(draw(st.integers(0, 1000)))
    keys = np.stack([rng.integers(0, nu, n), rng.integers(0, ni, n)], axis=1)
    workers = draw(st.integers(1, 4))
    return keys, nu, ni, workers, draw(st.integers(workers, 3 * workers)), draw(st.sampled_from([1, 3, 4096]))


W = DistArray(np.zeros((15, 2)))
H = DistArray(np.zeros((15, 2)))


@settings(max_examples=60, deadline=None)
@given(mf_problem())
def test_concurrent_blocks_of_a_2d_schedule_are_conflict_free(problem):
    keys, nu, ni, workers, tparts, min_chunk = problem  # a small minimum chunk: several chunks per block

    @parallel_for(DistArray.from_coo(keys, np.zeros(len(keys))))
    def sgd(key, value):
        W[key[0], 0] += H[key[1], 0]
        H[key[1], 1] += W[key[0], 1]

    plan = sgd.plan
    assert plan.scheme == "2d"
    with mock.patch.object(schedule_module, "_MIN_CHUNK", min_chunk):
        _check_conflict_free(keys, plan, sgd.schedule(workers, tparts), workers)
        sgd.stratum_seed = None  # identity Latin squares, steps in rotation order
        _check_conflict_free(keys, plan, sgd.schedule(workers, tparts), workers)


def _check_conflict_free(keys, plan, sched, workers):
    assert sorted(sched.serial_order().tolist()) == list(range(len(keys)))  # every record exactly once
    s, t = plan.space_dim, plan.time_dim
    for step in range(sched.num_steps):
        rows_s, rows_t = [], []
        for w in range(workers):
            task = sched.by_worker[w].get(step)
            recs = sched.block_records(task.block) if task else np.zeros(0, int)
            rows_s.append(set(keys[recs, s].tolist()))
            rows_t.append(set(keys[recs, t].tolist()))
        for a in range(workers):
            for b in range(a + 1, workers):
                assert not rows_s[a] & rows_s[b] and not rows_t[a] & rows_t[b]
    # every worker keeps its space rows for the whole epoch
    for w in range(workers):
        owned = [set(keys[sched.block_records(t.block), s].tolist()) for t in sched.tasks if t.worker == w]
        others = [set(keys[sched.block_records(t.block), s].tolist()) for t in sched.tasks if t.worker != w]
        assert not set().union(*owned) & set().union(*others)
