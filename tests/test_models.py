"""The benchmark models: they build, every tensor has a known size, training steps run, learn and repeat exactly."""

from __future__ import annotations

import doctest
import re

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from models import deepspeech, moe_transformer, resnet, transformer, wgan_gp
from tfmem.examples import Built
from tfmem.testbed import initializer_names

TINY = {
    "moe_transformer": lambda: moe_transformer.build(experts=4, layers=1, d_model=16, d_ff=32, heads=2, seq=8,
                                                     batch=4, vocab=16, lr=1e-2),
    "moe_top1": lambda: moe_transformer.build(experts=3, top_k=1, layers=2, moe_every=2, d_model=16, d_ff=16,
                                              heads=2, seq=8, batch=2, vocab=16, optimizer="momentum", lr=0.05),
    "resnet": lambda: resnet.build(depth=11, batch=4, image=8, width=4, lr=0.01),
    "deepspeech": lambda: deepspeech.build(seq_len=12, batch=2, freq=8, conv_channels=2, rnn_layers=1, hidden=8,
                                           classes=6, lr=1e-2),
    "deepspeech_rnn": lambda: deepspeech.build(seq_len=8, batch=2, freq=8, conv_channels=2, conv_layers=1,
                                               rnn_layers=2, hidden=8, cell="rnn", classes=5, optimizer="sgd"),
    "transformer": lambda: transformer.build(layers=1, heads=2, d_model=16, d_ff=32, seq=8, batch=4, vocab=16,
                                             lr=1e-2),
    "encoder_only": lambda: transformer.build(layers=1, decoder_layers=0, heads=2, d_model=16, d_ff=16, seq=6,
                                              batch=2, vocab=8, optimizer="sgd", lr=0.1),
    "wgan_gp": lambda: wgan_gp.build(batch=8, data_dim=8, z_dim=4, hidden=16, layers=2, critic_steps=2, lr=1e-3),
}


def train(built: Built, steps: int) -> list[list[np.ndarray]]:
    """Initialise, then run ``steps`` training steps in a plain Session; the tensor fetches of every step."""
    with tf.compat.v1.Session(graph=built.graph) as sess:
        sess.run(initializer_names(built.graph.as_graph_def()))
        tensors = [f for f in built.fetches if ":" in f]
        return [sess.run(tensors + [f for f in built.fetches if ":" not in f], built.feeds)[: len(tensors)]
                for _ in range(steps)]


@pytest.fixture(scope="module", params=sorted(TINY))
def model(request: pytest.FixtureRequest) -> tuple[str, Built]:
    return request.param, TINY[request.param]()


def test_every_tensor_has_a_known_size(model):
    _, built = model
    ir = tfmem.load(built.graph, built.feed_shapes)
    unknown = [f"{n.name}:{i}" for n in ir.nodes for i, spec in enumerate(n.outputs) if not spec.known]
    assert not unknown
    assert set(built.feed_shapes) <= {f"{n.name}:0" for n in ir.nodes if n.op == "Placeholder"}
    assert built.params > 0


def test_steps_are_finite_learn_and_repeat_exactly(model):
    name, built = model
    first = train(built, 4)
    losses = [float(step[0]) for step in first]
    assert all(np.isfinite(v).all() for step in first for v in step)
    assert losses[-1] < losses[0], losses
    again = train(TINY[name](), 4)          # a second build, same seed: bit-identical
    for a, b in zip(first, again, strict=True):
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_seed_changes_the_initial_weights():
    a = train(transformer.build(layers=1, heads=2, d_model=16, d_ff=16, seq=6, batch=2, vocab=8, seed=0), 1)
    b = train(transformer.build(layers=1, heads=2, d_model=16, d_ff=16, seq=6, batch=2, vocab=8, seed=1), 1)
    assert a[0][0] != b[0][0]


def test_simulator_sizes_a_model_and_grows_with_its_size_argument():
    small = moe_transformer.build(experts=2, layers=1, d_model=16, d_ff=64, heads=2, seq=8, batch=2, vocab=16)
    large = moe_transformer.build(experts=8, layers=1, d_model=16, d_ff=64, heads=2, seq=8, batch=2, vocab=16)
    peaks = [tfmem.simulate(m.graph, m.fetches, grappler=False).peak_bytes for m in (small, large)]
    # 6 more experts of 2*16*64 + 64 + 16 parameters, each with two Adam slots: >= 6 * 2128 * 4 * 3 bytes.
    assert peaks[1] - peaks[0] >= 6 * 2128 * 4 * 3
    assert large.params - small.params == 6 * 2128 + 16 * 6   # experts, and the gate's 6 extra columns


def _moe_reference(x, gate_w, experts, top_k, capacity):
    """numpy: top-k softmax gate, first-come capacity per expert, weighted sum of expert FFNs."""
    logits = x @ gate_w
    gates = np.exp(logits - logits.max(1, keepdims=True))
    gates /= gates.sum(1, keepdims=True)
    top = np.argsort(-gates, axis=1, kind="stable")[:, :top_k]
    out, filled = np.zeros_like(x), np.zeros(len(experts), int)
    for t in range(len(x)):
        weights = gates[t, top[t]] / gates[t, top[t]].sum()
        for e, w in zip(top[t], weights, strict=True):
            if filled[e] < capacity:
                filled[e] += 1
                w_in, b_in, w_out, b_out = experts[e]
                out[t] += w * (np.maximum(x[t] @ w_in + b_in, 0) @ w_out + b_out)
    return out


@pytest.mark.parametrize("top_k,capacity", [(1, 3), (2, 2), (2, 16)])
def test_moe_dispatch_matches_a_dense_reference(top_k, capacity):
    tokens, d_model, d_ff, n_experts = 16, 8, 12, 4
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (tokens, d_model), name="x")
        y, _ = moe_transformer.moe_layer(x, n_experts, d_ff, top_k, capacity, "moe", moe_transformer.Seeds(3))
        variables = {v.op.name: v for v in tf.compat.v1.global_variables()}
    feed = np.random.default_rng(0).standard_normal((tokens, d_model)).astype(np.float32)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(initializer_names(graph.as_graph_def()))
        got, values = sess.run([y, variables], {x: feed})
    experts = [tuple(values[f"moe/expert{e}/{p}"] for p in ("in/w", "in/b", "out/w", "out/b"))
               for e in range(n_experts)]
    np.testing.assert_allclose(got, _moe_reference(feed, values["moe/gate/w"], experts, top_k, capacity),
                               rtol=1e-4, atol=1e-5)


def test_resnet_depth_counts_weighted_layers():
    for depth, stages in ((11, None), (20, None), (14, 4)):
        built = resnet.build(depth=depth, stages=stages, batch=1, image=8, width=2)
        ops = built.graph.get_operations()
        convs = [op for op in ops if op.type == "Conv2D" and "/proj" not in op.name]
        matmuls = [op for op in ops if op.type == "MatMul" and not op.name.startswith("gradients")]
        assert len(convs) + len(matmuls) == depth
    assert resnet.stage_blocks(1001) == (111,) * 3 and resnet.depth_of(111) == 1001


def test_deepspeech_unrolls_every_frame():
    counts = {}
    for seq_len in (8, 16):
        built = deepspeech.build(seq_len=seq_len, batch=1, freq=8, rnn_layers=1, hidden=4, classes=4)
        counts[seq_len] = sum(op.type == "Tanh" and not op.name.startswith("gradients")
                              for op in built.graph.get_operations())
    assert counts == {8: 16, 16: 32}   # one per frame per direction


@pytest.mark.parametrize("call,message", [
    (lambda: moe_transformer.build(experts=1, top_k=2), "experts (1) must be >= top_k (2)"),
    (lambda: moe_transformer.build(top_k=3), "top_k must be 1 or 2"),
    (lambda: moe_transformer.build(d_model=30, heads=4), "heads (4) must divide d_model (30)"),
    (lambda: resnet.build(depth=60), "depth 60 is not 50, 101, 152, 200 or 9n+2 (n >= 1); nearest: 56 or 65"),
    (lambda: resnet.build(depth=5), "smallest: 11"),
    (lambda: resnet.build(depth=20, stages=4), "depth 20 is not 12n+2"),
    (lambda: resnet.build(batch=0), "batch must be a number >= 1, got 0"),
    (lambda: deepspeech.build(seq_len=8, label_len=5), "label_len (5) must be at most seq_len / 2 (4)"),
    (lambda: deepspeech.build(cell="lstm"), "cell must be one of gru, rnn"),
    (lambda: transformer.build(optimizer="rmsprop"), "unknown optimizer 'rmsprop'"),
    (lambda: wgan_gp.build(critic_steps=0), "critic_steps must be a number >= 1"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises(tfmem.BadInputError, match=re.escape(message)):
        call()


@pytest.mark.parametrize("module", [deepspeech, moe_transformer, resnet, transformer, wgan_gp])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
