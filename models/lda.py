"""Collapsed-Gibbs LDA written as a plain serial loop, and the same loop parallelised by orion_par.

A token is a record keyed ``(doc, word, position)``.  The loop body resamples the token's topic from the
counts (Griffiths & Steyvers 2004).  Its accesses are ``Z[doc, pos]``, ``ndk[doc, :]`` and
``nwk[word, :]``, so orion_par's analyzer finds a 2D plan (documents in space, words in time); the
topic totals ``nk`` are read and written by every token, so they go through a ``Buffer`` (updates from
other workers arrive one step late, as in AD-LDA and Orion's LDA).

>>> corpus = synthetic_corpus(num_docs=20, doc_len=15, vocab_size=30, num_topics=3, seed=0)
>>> state = LdaState.random(corpus, num_topics=3, seed=0)
>>> sampler = parallel_gibbs(corpus, state)
>>> str(sampler.plan.scheme)
'2d'
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np

from orion_par import Accumulator, Buffer, DistArray, ParallelFor, parallel_for


@dataclass(frozen=True)
class Corpus:
    """Tokens as records ``(doc, word, pos)``; ``theta``/``phi`` are the model that generated them."""

    tokens: DistArray  # keyed dataset; values are unused ones
    doc_lengths: np.ndarray
    vocab_size: int
    theta: np.ndarray  # (docs, topics): true document-topic proportions
    phi: np.ndarray  # (topics, vocab): true topic-word distributions
    alpha: float
    beta: float

    @property
    def words(self) -> np.ndarray:
        return self.tokens.keys[:, 1]  # type: ignore[index]

    @property
    def num_tokens(self) -> int:
        return self.tokens.num_records


def synthetic_corpus(num_docs: int, doc_len: int, vocab_size: int, num_topics: int, *, alpha: float = 0.1,
                     beta: float = 0.01, seed: int = 0) -> Corpus:
    """Draw a corpus from LDA's generative model with known ``theta`` and ``phi``.

    Every document has ``doc_len`` tokens; tokens are listed document by document, in position order.
    """
    rng = np.random.default_rng(seed)
    phi = rng.dirichlet(np.full(vocab_size, beta), size=num_topics)
    theta = rng.dirichlet(np.full(num_topics, alpha), size=num_docs)
    docs = np.repeat(np.arange(num_docs), doc_len)
    pos = np.tile(np.arange(doc_len), num_docs)
    z = _categorical(rng, theta[docs])
    words = np.empty(z.size, np.int64)
    for k in range(num_topics):  # per topic, so that no (tokens x vocabulary) matrix is built
        mine = np.flatnonzero(z == k)
        words[mine] = rng.choice(vocab_size, size=mine.size, p=phi[k])
    keys = np.stack([docs, words, pos], axis=1)
    tokens = DistArray.from_coo(keys, np.ones(keys.shape[0]))
    return Corpus(tokens, np.full(num_docs, doc_len), vocab_size, theta, phi, alpha, beta)


def _categorical(rng: np.random.Generator, probs: np.ndarray) -> np.ndarray:
    cdf = np.cumsum(probs, axis=1)
    u = rng.random(probs.shape[0])[:, None] * cdf[:, -1:]
    return np.minimum((cdf < u).sum(axis=1), probs.shape[1] - 1)


@dataclass
class LdaState:
    """Topic assignments ``Z[doc, pos]`` and the counts they imply."""

    Z: DistArray
    ndk: DistArray
    nwk: DistArray
    nk: Buffer
    alpha: float
    beta: float

    @classmethod
    def random(cls, corpus: Corpus, num_topics: int, seed: int = 0, max_delay: int = 1) -> LdaState:
        keys = corpus.tokens.keys
        rng = np.random.default_rng(seed)
        z = rng.integers(0, num_topics, keys.shape[0])
        Z = np.full((corpus.doc_lengths.size, int(corpus.doc_lengths.max())), -1, np.int64)
        Z[keys[:, 0], keys[:, 2]] = z
        # int32 counts: half the bytes of int64 per row a token reads, so more of nwk stays in cache.
        ndk = np.zeros((corpus.doc_lengths.size, num_topics), np.int32)
        nwk = np.zeros((corpus.vocab_size, num_topics), np.int32)
        np.add.at(ndk, (keys[:, 0], z), 1)
        np.add.at(nwk, (keys[:, 1], z), 1)
        nk = Buffer(np.bincount(z, minlength=num_topics).astype(np.int32), max_delay=max_delay)
        return cls(DistArray(Z), DistArray(ndk), DistArray(nwk), nk, corpus.alpha, corpus.beta)

    def copy(self) -> LdaState:
        return LdaState(DistArray(self.Z.copy()), DistArray(self.ndk.copy()), DistArray(self.nwk.copy()),
                        Buffer(self.nk.copy(), self.nk.max_delay), self.alpha, self.beta)

    def assign(self, other: LdaState) -> None:
        """Overwrite this state's arrays in place (the compiled bodies hold these very arrays)."""
        for name in ("Z", "ndk", "nwk", "nk"):
            getattr(self, name)[...] = getattr(other, name)


def gibbs_serial(corpus: Corpus, state: LdaState, epochs: int = 1, seed: int | None = None) -> None:
    """The serial loop as people write it: plain Python over every token (slow; the reference)."""
    Z, ndk, nwk, nk = state.Z, state.ndk, state.nwk, state.nk
    K = ndk.shape[1]
    alpha, beta, vbeta = state.alpha, state.beta, state.beta * nwk.shape[0]
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        for (d, w, p), _value in corpus.tokens.records():
            old = Z[d, p]
            ndk[d, old] -= 1
            nwk[w, old] -= 1
            nk[old] -= 1
            weights = (ndk[d] + alpha) * (nwk[w] + beta) / (nk + vbeta)
            cdf = np.cumsum(weights)
            new = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), K - 1)
            Z[d, p] = new
            ndk[d, new] += 1
            nwk[w, new] += 1
            nk[new] += 1


def parallel_gibbs(corpus: Corpus, state: LdaState) -> ParallelFor:
    """The same sweep as one orion_par loop body; ``.run(workers, epochs)`` runs it, ``.run_serial()``
    runs it compiled in data order.

    The body also adds each token's predictive log-likelihood ``log p(w | d, the other tokens)`` under the
    counts it samples from to the accumulator ``loglik``: ``.run(...).accumulated["loglik"][e] / N`` is
    epoch ``e``'s training log-likelihood per token.
    """
    Z, ndk, nwk, nk = state.Z, state.ndk, state.nwk, state.nk
    K = ndk.shape[1]
    alpha, beta, vbeta = state.alpha, state.beta, state.beta * nwk.shape[0]
    others = np.asarray(corpus.doc_lengths, np.float64) - 1.0 + K * alpha  # the denominator's doc term
    loglik = Accumulator("sum")

    @parallel_for(corpus.tokens)
    def gibbs(key, value):
        d, w, p = key
        old = Z[d, p]
        ndk[d, old] -= 1
        nwk[w, old] -= 1
        nk[old] -= 1
        cdf = np.empty(K)
        for k in range(K):  # no running sum in this loop, so the compiler can vectorise it
            cdf[k] = (ndk[d, k] + alpha) * (nwk[w, k] + beta) / (nk[k] + vbeta)
        total = 0.0
        for k in range(K):
            total += cdf[k]
            cdf[k] = total
        loglik[0] += math.log(total / others[d])
        u = np.random.random() * total
        new = 0
        while new < K - 1 and cdf[new] <= u:
            new += 1
        Z[d, p] = new
        ndk[d, new] += 1
        nwk[w, new] += 1
        nk[new] += 1

    return gibbs


@numba.njit(cache=True)
def _lgamma_sum(counts: np.ndarray, prior: float) -> float:
    s = 0.0
    for x in counts.ravel():
        s += math.lgamma(x + prior)
    return s


def log_likelihood_per_token(ndk: np.ndarray, nwk: np.ndarray, alpha: float, beta: float) -> float:
    """Joint ``log p(w, z) / N`` of the collapsed model (Griffiths & Steyvers 2004, eqs. 2-3).

    Computed from the counts only, so it scores any sampler's assignments the same way.
    """
    D, K = ndk.shape
    V = nwk.shape[0]
    nk = nwk.sum(axis=0)
    nd = ndk.sum(axis=1)
    n = float(nd.sum())
    log_pw_z = K * (math.lgamma(V * beta) - V * math.lgamma(beta)) + _lgamma_sum(nwk.astype(np.float64), beta)
    log_pw_z -= _lgamma_sum(nk.astype(np.float64), V * beta)
    log_pz = D * (math.lgamma(K * alpha) - K * math.lgamma(alpha)) + _lgamma_sum(ndk.astype(np.float64), alpha)
    log_pz -= _lgamma_sum(nd.astype(np.float64), K * alpha)
    return (log_pw_z + log_pz) / n
