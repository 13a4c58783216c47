"""models/mf.py and models/lda.py: the decorated loops plan as expected and train like the serial ones."""

from __future__ import annotations

import numpy as np

from models.lda import LdaState, gibbs_serial, log_likelihood_per_token, parallel_gibbs, synthetic_corpus
from models.mf import init_factors, parallel_sgd, rmse, sgd_serial, sgd_serial_numba, synthetic_ratings


def test_mf_plan_and_parallel_training_tracks_serial():
    data = synthetic_ratings(300, 200, 20000, rank=8, noise=0.1, seed=0)
    W, H = init_factors(300, 200, 8, seed=1)
    W0, H0 = W.copy(), H.copy()
    sgd = parallel_sgd(data.ratings, W, H, lr=0.03, reg=0.01)
    assert sgd.plan.scheme == "2d" and sgd.plan.space_arrays == ("W",)
    start = rmse(data.keys, data.values, W, H)
    par = []
    for _ in range(8):
        sgd.run(workers=2)
        par.append(rmse(data.keys, data.values, W, H))
    Ws, Hs = W0.copy(), H0.copy()
    ser = []
    for _ in range(8):
        sgd_serial_numba(data.keys, data.values, Ws, Hs, 0.03, 0.01)
        ser.append(rmse(data.keys, data.values, Ws, Hs))
    assert par[-1] < 0.6 * start
    assert abs(par[-1] - ser[-1]) / ser[-1] < 0.05


def test_mf_compiled_serial_equals_plain_python_serial():
    data = synthetic_ratings(20, 15, 200, rank=3, seed=2)
    W, H = init_factors(20, 15, 3, seed=3)
    Wp, Hp = W.copy(), H.copy()
    sgd = parallel_sgd(data.ratings, W, H, lr=0.05, reg=0.01)
    sgd.run_serial(epochs=2)
    sgd_serial(data.ratings, Wp, Hp, lr=0.05, reg=0.01, epochs=2)
    assert np.allclose(W, Wp, rtol=1e-12, atol=1e-12) and np.allclose(H, Hp, rtol=1e-12, atol=1e-12)


def test_skewed_ratings_have_heavy_users():
    data = synthetic_ratings(1000, 100, 20000, rank=2, skew=1.2, seed=4)
    counts = np.bincount(data.keys[:, 0], minlength=1000)
    assert counts.max() > 20 * np.median(counts[counts > 0])


def _check_counts(corpus, state):
    keys = corpus.tokens.keys
    z = state.Z[keys[:, 0], keys[:, 2]]
    assert np.array_equal(state.ndk, np.bincount(keys[:, 0] * state.ndk.shape[1] + z,
                                                 minlength=state.ndk.size).reshape(state.ndk.shape))
    assert np.array_equal(state.nwk.sum(axis=0), np.asarray(state.nk))
    assert state.nwk.sum() == corpus.num_tokens


def test_lda_plan_buffers_topic_totals_and_counts_stay_consistent():
    corpus = synthetic_corpus(60, 40, 80, 4, seed=0)
    state = LdaState.random(corpus, 4, seed=1)
    gibbs = parallel_gibbs(corpus, state)
    plan = gibbs.plan
    assert plan.scheme == "2d" and plan.buffered == {"nk": 1}
    assert (plan.space_dim, plan.time_dim) == (0, 1)
    before = log_likelihood_per_token(state.ndk, state.nwk, state.alpha, state.beta)
    gibbs.run(workers=2, epochs=15, seed=0)
    _check_counts(corpus, state)
    after = log_likelihood_per_token(state.ndk, state.nwk, state.alpha, state.beta)
    assert after > before + 0.3


def test_lda_parallel_reaches_the_serial_likelihood():
    corpus = synthetic_corpus(150, 50, 200, 5, seed=3)
    par = LdaState.random(corpus, 5, seed=4)
    ser = par.copy()
    parallel_gibbs(corpus, par).run(workers=2, epochs=30, seed=1)
    serial = parallel_gibbs(corpus, ser)
    serial.run_serial(epochs=30, seed=1)
    ll_par = log_likelihood_per_token(par.ndk, par.nwk, par.alpha, par.beta)
    ll_ser = log_likelihood_per_token(ser.ndk, ser.nwk, ser.alpha, ser.beta)
    assert abs(ll_par - ll_ser) / abs(ll_ser) < 0.03


def test_lda_plain_python_serial_loop_improves_the_likelihood():
    corpus = synthetic_corpus(15, 20, 30, 3, seed=5)
    state = LdaState.random(corpus, 3, seed=6)
    before = log_likelihood_per_token(state.ndk, state.nwk, state.alpha, state.beta)
    gibbs_serial(corpus, state, epochs=10, seed=0)
    _check_counts(corpus, state)
    assert log_likelihood_per_token(state.ndk, state.nwk, state.alpha, state.beta) > before


def test_log_likelihood_prefers_the_true_assignment():
    corpus = synthetic_corpus(40, 50, 60, 3, alpha=0.1, beta=0.05, seed=7)
    rand = LdaState.random(corpus, 3, seed=8)
    keys = corpus.tokens.keys
    true_z = np.argmax(corpus.theta[keys[:, 0]] * corpus.phi[:, keys[:, 1]].T, axis=1)
    ndk = np.zeros_like(rand.ndk)
    nwk = np.zeros_like(rand.nwk)
    np.add.at(ndk, (keys[:, 0], true_z), 1)
    np.add.at(nwk, (keys[:, 1], true_z), 1)
    assert log_likelihood_per_token(ndk, nwk, 0.1, 0.05) > log_likelihood_per_token(rand.ndk, rand.nwk, 0.1, 0.05)


def test_lda_reports_its_training_likelihood_through_an_accumulator():
    corpus = synthetic_corpus(60, 40, 80, 4, seed=2)
    state = LdaState.random(corpus, 4, seed=3)
    start = state.copy()
    gibbs = parallel_gibbs(corpus, state)
    one = gibbs.run(workers=1, epochs=6, seed=0).accumulated["loglik"]
    assert one[-1] > one[0]  # sampling raises the predictive likelihood of the tokens
    state.assign(start)
    assert gibbs.run_serial(epochs=6, seed=0).accumulated["loglik"] == one  # one worker: the serial loop
    state.assign(start)
    two = gibbs.run(workers=2, epochs=6, seed=0).accumulated["loglik"]
    assert abs(two[-1] - one[-1]) / abs(one[-1]) < 0.05
