"""SGD matrix factorisation written as a plain serial loop, and the same loop parallelised by orion_par.

A rating is a record keyed ``(user, item)``.  The loop body reads and updates row ``W[user]`` and row
``H[item]``; orion_par's analyzer sees that ``W`` conflicts only between ratings of the same user and
``H`` only between ratings of the same item, and picks a 2D plan (DSGD): users in space, items in time.

>>> data = synthetic_ratings(num_users=50, num_items=40, num_ratings=500, rank=4, seed=0)
>>> W, H = init_factors(50, 40, rank=4, seed=1)
>>> sgd = parallel_sgd(data.ratings, W, H, lr=0.02, reg=0.01)
>>> str(sgd.plan.scheme)
'2d'
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from orion_par import DistArray, ParallelFor, RunStats, parallel_for


@dataclass(frozen=True)
class Ratings:
    """Observed ratings ``W_true[u] . H_true[i] + noise`` in random order, with the true factors."""

    ratings: DistArray  # keyed dataset: keys (user, item), values the rating
    W_true: np.ndarray
    H_true: np.ndarray
    noise: float

    @property
    def keys(self) -> np.ndarray:
        return self.ratings.keys  # type: ignore[return-value]

    @property
    def values(self) -> np.ndarray:
        return np.asarray(self.ratings)


def synthetic_ratings(num_users: int, num_items: int, num_ratings: int, rank: int, *, noise: float = 0.1,
                      skew: float = 0.0, seed: int = 0) -> Ratings:
    """Low-rank ratings plus Gaussian noise; ``skew > 0`` draws users from a power law (a few heavy users).

    The factors have entries ``N(0, rank ** -0.25)`` so a clean rating has unit variance; the best
    achievable training RMSE is about ``noise``.
    """
    rng = np.random.default_rng(seed)
    W_true = rng.normal(0, rank ** -0.25, (num_users, rank))
    H_true = rng.normal(0, rank ** -0.25, (num_items, rank))
    if skew > 0:
        p = 1.0 / np.arange(1, num_users + 1) ** skew
        users = rng.permutation(num_users)[rng.choice(num_users, num_ratings, p=p / p.sum())]
    else:
        users = rng.integers(0, num_users, num_ratings)
    items = rng.integers(0, num_items, num_ratings)
    pairs = np.unique(np.stack([users, items], axis=1), axis=0)  # one rating per (user, item)
    pairs = pairs[rng.permutation(pairs.shape[0])]  # SGD visits ratings in random order
    clean = np.einsum("nk,nk->n", W_true[pairs[:, 0]], H_true[pairs[:, 1]])
    values = clean + rng.normal(0, noise, pairs.shape[0])
    return Ratings(DistArray.from_coo(pairs, values), W_true, H_true, noise)


def init_factors(num_users: int, num_items: int, rank: int, *, seed: int = 0, scale: float = 0.1
                 ) -> tuple[DistArray, DistArray]:
    """Small random starting factors (the same for every method that is compared)."""
    rng = np.random.default_rng(seed)
    return (DistArray(rng.normal(0, scale, (num_users, rank))), DistArray(rng.normal(0, scale, (num_items, rank))))


def sgd_serial(ratings: DistArray, W: np.ndarray, H: np.ndarray, *, lr: float, reg: float, epochs: int = 1) -> None:
    """The serial loop as people write it: plain Python over every rating (slow; the reference)."""
    rank = W.shape[1]
    for _ in range(epochs):
        for (u, i), value in ratings.records():
            w = W[u]
            h = H[i]
            pred = 0.0
            for r in range(rank):
                pred += w[r] * h[r]
            err = value - pred
            for r in range(rank):
                wr = w[r]
                w[r] += lr * (err * h[r] - reg * wr)
                h[r] += lr * (err * wr - reg * h[r])


@numba.njit(nogil=True, cache=True)
def sgd_serial_numba(keys: np.ndarray, values: np.ndarray, W: np.ndarray, H: np.ndarray, lr: float,
                     reg: float) -> None:
    """The same serial loop hand-compiled with numba: what a user writes to make it fast on one core."""
    rank = W.shape[1]
    for n in range(keys.shape[0]):
        w = W[keys[n, 0]]
        h = H[keys[n, 1]]
        pred = 0.0
        for r in range(rank):
            pred += w[r] * h[r]
        err = values[n] - pred
        for r in range(rank):
            wr = w[r]
            w[r] += lr * (err * h[r] - reg * wr)
            h[r] += lr * (err * wr - reg * h[r])


def parallel_sgd(ratings: DistArray, W: DistArray, H: DistArray, *, lr: float, reg: float) -> ParallelFor:
    """The same loop body under ``@parallel_for``: ``.run(workers, epochs)`` runs one epoch per epoch.

    The body returns its squared error, so ``.run(...).returned[e]`` is epoch ``e``'s training loss, each
    rating's error taken just before its update (``training_rmse``).
    """
    rank = W.shape[1]

    @parallel_for(ratings)
    def sgd(key, value):
        u, i = key
        w = W[u]
        h = H[i]
        pred = 0.0
        for r in range(rank):
            pred += w[r] * h[r]
        err = value - pred
        for r in range(rank):
            wr = w[r]
            w[r] += lr * (err * h[r] - reg * wr)
            h[r] += lr * (err * wr - reg * h[r])
        return err * err

    return sgd


def training_rmse(stats: RunStats) -> list[float]:
    """Each epoch's RMSE over the errors seen during training (from ``parallel_sgd``'s return values).

    >>> data = synthetic_ratings(num_users=30, num_items=20, num_ratings=300, rank=2, seed=0)
    >>> W, H = init_factors(30, 20, rank=2, seed=1)
    >>> stats = parallel_sgd(data.ratings, W, H, lr=0.05, reg=0.0).run(workers=2, epochs=3)
    >>> a, b, c = training_rmse(stats)
    >>> a > b > c
    True
    """
    n = stats.records / stats.epochs if stats.epochs else 0
    return [float(np.sqrt(s / n)) if n else 0.0 for s in stats.returned]


@numba.njit(cache=True)
def _sq_error(keys: np.ndarray, values: np.ndarray, W: np.ndarray, H: np.ndarray) -> float:
    s = 0.0
    for n in range(keys.shape[0]):
        pred = 0.0
        for r in range(W.shape[1]):
            pred += W[keys[n, 0], r] * H[keys[n, 1], r]
        s += (values[n] - pred) ** 2
    return s


def rmse(keys: np.ndarray, values: np.ndarray, W: np.ndarray, H: np.ndarray) -> float:
    """Root mean squared error of ``W[u] . H[i]`` against the ratings."""
    if keys.shape[0] == 0:
        return 0.0
    return float(np.sqrt(_sq_error(keys, values, np.asarray(W), np.asarray(H)) / keys.shape[0]))
