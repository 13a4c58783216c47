"""run(check_bounds=True): an out-of-range subscript computed from data is an error naming the body's line
and the record, and leaves the arrays as they were; in-range bodies give the unchecked results."""

from __future__ import annotations

import numpy as np
import pytest

from orion_par import BadBodyError, DistArray, parallel_for

RNG = np.random.default_rng(5)
N = 1500
KEYS = np.stack([RNG.integers(0, 40, N), RNG.integers(0, 30, N)], axis=1)
VALUES = RNG.integers(0, 4, N).astype(np.float64)
VALUES[1000] = 9.0  # one record whose value points past the end of W's second dimension
DATA = DistArray.from_coo(KEYS, VALUES)
W = DistArray(np.zeros((40, 4)))


def _bump(u, slot):
    W[u, slot] += 1.0


def test_a_bad_subscript_names_the_line_and_the_record_and_undoes_the_run():
    @parallel_for(DATA)
    def body(key, value):
        u, i = key
        W[u, 0] += 0.5
        W[u, int(value)] += 1.0

    before = W.copy()
    with pytest.raises(BadBodyError, match=r"line \d+ `W\[u, int\(value\)\] \+= 1.0` indexes outside its array "
                                           r"for record 1000 \(key \(\d+, \d+\), value 9.0\)"):
        body.run(workers=2, epochs=2, check_bounds=True)
    assert np.array_equal(W, before)
    with pytest.raises(BadBodyError, match="for record 1000"):
        body.run_serial(check_bounds=True)
    assert np.array_equal(W, before)


def test_inside_a_helper_the_error_names_the_call_and_the_helper():
    @parallel_for(DATA)
    def body(key, value):
        _bump(key[0], int(value))

    with pytest.raises(BadBodyError, match=r"`_bump\(key\[0\], int\(value\)\)` \(in `_bump .*\.py:\d+\)`\)"):
        body.run(workers=2, check_bounds=True)


def test_checked_and_unchecked_runs_agree_when_every_subscript_fits():
    data = DistArray.from_coo(KEYS, np.minimum(VALUES, 3.0))

    @parallel_for(data)
    def body(key, value):
        W[key[0], int(value)] += 1.0 + value

    W[...] = 0
    body.run(workers=2, epochs=2)
    unchecked = W.copy()
    W[...] = 0
    body.epochs_run = 0
    body.run(workers=2, epochs=2, check_bounds=True)
    assert np.array_equal(W, unchecked)
