"""Small, deterministic TF1-style graphs for tests, the demo and calibration.

Each builder returns a ``Built``: the ``tf.Graph``, the fetches of one step, fixed-seed feeds and the
parameter count. Sizes are arguments so tests can make them tiny and benchmarks large. The big benchmark
models (MoE Transformer, ResNet, DeepSpeech, ...) live in ``models/``; these are the shapes the simulator
and passes must handle: chains, skips, wide fan-out, unrolled recurrences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1


@dataclass
class Built:
    """A graph ready to run: ``fetches`` for ``Session.run`` and ``feeds`` keyed by tensor name."""

    graph: tf.Graph
    fetches: list[str]
    feeds: dict[str, np.ndarray] = field(default_factory=dict)
    params: int = 0

    @property
    def feed_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.feeds.items()}


def _graph(build: Callable[[], tuple[list[str], dict[str, np.ndarray]]]) -> Built:
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1234)
        fetches, feeds = build()
        params = sum(int(np.prod(v.shape)) for v in v1.trainable_variables())
    return Built(graph, fetches, feeds, params)


def _dense(x: tf.Tensor, units: int, name: str, seed: int, activation: bool = True) -> tf.Tensor:
    w = v1.get_variable(f"{name}/w", (x.shape[-1], units), initializer=v1.glorot_uniform_initializer(seed=seed))
    b = v1.get_variable(f"{name}/b", (units,), initializer=v1.zeros_initializer())
    y = tf.nn.bias_add(tf.matmul(x, w), b)
    return tf.nn.relu(y) if activation else y


def _train(loss: tf.Tensor, optimizer: str) -> str:
    opt = {
        "sgd": lambda: v1.train.GradientDescentOptimizer(0.01),
        "momentum": lambda: v1.train.MomentumOptimizer(0.01, 0.9),
        "adam": lambda: v1.train.AdamOptimizer(1e-3),
    }[optimizer]()
    return str(opt.minimize(loss, name="train_op").name)


def mlp(batch: int = 64, dims: tuple[int, ...] = (784, 1024, 1024, 10), optimizer: str = "sgd") -> Built:
    """A fully connected classifier and one training step (softmax cross-entropy)."""

    def build() -> tuple[list[str], dict[str, np.ndarray]]:
        x = v1.placeholder(tf.float32, (batch, dims[0]), name="x")
        labels = v1.placeholder(tf.int32, (batch,), name="labels")
        h = x
        for i, units in enumerate(dims[1:]):
            h = _dense(h, units, f"dense{i}", seed=i, activation=i < len(dims) - 2)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=h), name="loss")
        rng = np.random.default_rng(0)
        feeds = {"x:0": rng.standard_normal((batch, dims[0]), dtype=np.float32),
                 "labels:0": rng.integers(0, dims[-1], batch).astype(np.int32)}
        return ["loss:0", _train(loss, optimizer)], feeds

    return _graph(build)


def residual_convnet(batch: int = 8, size: int = 32, channels: int = 32, blocks: int = 3,
                     optimizer: str = "sgd") -> Built:
    """Conv blocks with two parallel branches and a skip connection each, then a classifier."""

    def conv(x: tf.Tensor, cout: int, k: int, name: str, seed: int) -> tf.Tensor:
        w = v1.get_variable(f"{name}/w", (k, k, x.shape[-1], cout),
                            initializer=v1.glorot_uniform_initializer(seed=seed))
        return tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME"))

    def build() -> tuple[list[str], dict[str, np.ndarray]]:
        x = v1.placeholder(tf.float32, (batch, size, size, 3), name="x")
        labels = v1.placeholder(tf.int32, (batch,), name="labels")
        h = conv(x, channels, 3, "stem", 0)
        for i in range(blocks):
            a = conv(h, channels, 3, f"block{i}/a", 10 * i + 1)
            b = conv(conv(h, channels, 1, f"block{i}/b1", 10 * i + 2), channels, 3, f"block{i}/b2", 10 * i + 3)
            h = tf.nn.relu(h + a + b, name=f"block{i}/out")
        pooled = tf.reduce_mean(h, axis=(1, 2))
        logits = _dense(pooled, 10, "head", 99, activation=False)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits),
                              name="loss")
        rng = np.random.default_rng(1)
        feeds = {"x:0": rng.standard_normal((batch, size, size, 3), dtype=np.float32),
                 "labels:0": rng.integers(0, 10, batch).astype(np.int32)}
        return ["loss:0", _train(loss, optimizer)], feeds

    return _graph(build)


def wide_branches(branches: int = 16, elems: int = 1 << 20, depth: int = 3) -> Built:
    """``branches`` independent element-wise chains from one input, each with a large transient, summed.

    Each branch scales the input by its own factor, widens it 4x (the large transient), applies ``depth``
    element-wise ops and reduces to 1024 values. Forward only, no variables: the memory is all transients,
    which is what limiting parallelism saves.
    """

    def build() -> tuple[list[str], dict[str, np.ndarray]]:
        x = v1.placeholder(tf.float32, (elems,), name="x")
        outs = []
        for b in range(branches):
            h = tf.tile((x * float(b + 2))[None, :], (4, 1), name=f"branch{b}/expand")
            for d in range(depth):
                h = tf.math.sin(h * float(d + 1), name=f"branch{b}/sin{d}")
            outs.append(tf.reduce_sum(tf.reshape(h, (-1, 1024)), axis=0, name=f"branch{b}/reduce"))
        tf.add_n(outs, name="y")
        feeds = {"x:0": np.random.default_rng(2).standard_normal(elems, dtype=np.float32)}
        return ["y:0"], feeds

    return _graph(build)


def unrolled_rnn(steps: int = 16, batch: int = 32, hidden: int = 256, inputs: int = 128,
                 optimizer: str = "sgd") -> Built:
    """A tanh RNN statically unrolled over ``steps``, with a loss on every step's output."""

    def build() -> tuple[list[str], dict[str, np.ndarray]]:
        x = v1.placeholder(tf.float32, (steps, batch, inputs), name="x")
        target = v1.placeholder(tf.float32, (steps, batch, hidden), name="target")
        wx = v1.get_variable("rnn/wx", (inputs, hidden), initializer=v1.glorot_uniform_initializer(seed=1))
        wh = v1.get_variable("rnn/wh", (hidden, hidden), initializer=v1.orthogonal_initializer(seed=2))
        h = tf.zeros((batch, hidden))
        losses = []
        for t in range(steps):
            h = tf.tanh(tf.matmul(x[t], wx) + tf.matmul(h, wh), name=f"rnn/h{t}")
            losses.append(tf.reduce_mean(tf.square(h - target[t])))
        loss = tf.add_n(losses, name="loss")
        rng = np.random.default_rng(3)
        feeds = {"x:0": rng.standard_normal((steps, batch, inputs), dtype=np.float32),
                 "target:0": rng.standard_normal((steps, batch, hidden), dtype=np.float32) * 0.5}
        return ["loss:0", _train(loss, optimizer)], feeds

    return _graph(build)


def moe_layer(experts: int = 8, batch: int = 256, d_model: int = 256, d_ff: int = 1024,
              optimizer: str = "sgd") -> Built:
    """One dense-dispatch mixture-of-experts layer (softmax gate, every expert sees the batch) and a loss."""

    def build() -> tuple[list[str], dict[str, np.ndarray]]:
        x = v1.placeholder(tf.float32, (batch, d_model), name="x")
        target = v1.placeholder(tf.float32, (batch, d_model), name="target")
        gate = tf.nn.softmax(_dense(x, experts, "gate", 0, activation=False))
        outs = []
        for e in range(experts):
            h = _dense(x, d_ff, f"expert{e}/in", 100 + e)
            outs.append(_dense(h, d_model, f"expert{e}/out", 200 + e, activation=False) * gate[:, e:e + 1])
        y = tf.add_n(outs, name="y")
        loss = tf.reduce_mean(tf.square(y - target), name="loss")
        rng = np.random.default_rng(4)
        feeds = {"x:0": rng.standard_normal((batch, d_model), dtype=np.float32),
                 "target:0": rng.standard_normal((batch, d_model), dtype=np.float32)}
        return ["loss:0", _train(loss, optimizer)], feeds

    return _graph(build)


def _conv(h: tf.Tensor, cout: int, k: int, name: str, seed: int) -> tf.Tensor:
    w = v1.get_variable(f"{name}/w", (k, k, h.shape[-1], cout), initializer=v1.glorot_uniform_initializer(seed=seed))
    return tf.nn.relu(tf.nn.conv2d(h, w, 1, "SAME"))


def _classify(h: tf.Tensor, labels: tf.Tensor, optimizer: str) -> str:
    logits = _dense(tf.reduce_mean(h, axis=(1, 2)), 10, "head", 99, activation=False)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits), name="loss")
    return _train(loss, optimizer)


def inception_towers(batch: int = 8, size: int = 32, channels: int = 24, modules: int = 2,
                     optimizer: str = "momentum") -> Built:
    """Inception-style modules: four parallel towers (1x1, 3x3, 5x5, pool) concatenated, then batch norm."""

    def build() -> tuple[list[str], dict[str, np.ndarray]]:
        x = v1.placeholder(tf.float32, (batch, size, size, 3), name="x")
        labels = v1.placeholder(tf.int32, (batch,), name="labels")
        h = _conv(x, channels, 3, "stem", 0)
        for i in range(modules):
            a = _conv(h, channels, 1, f"inc{i}/a", 10 * i + 1)
            b = _conv(_conv(h, channels // 2, 1, f"inc{i}/b1", 10 * i + 2), channels, 3, f"inc{i}/b2", 10 * i + 3)
            c = _conv(_conv(h, channels // 2, 1, f"inc{i}/c1", 10 * i + 4), channels, 5, f"inc{i}/c2", 10 * i + 5)
            d = tf.nn.max_pool2d(h, 3, 1, "SAME")
            h = _conv(tf.concat([a, b, c, d], axis=-1), channels, 1, f"inc{i}/proj", 10 * i + 6)
        mean, var = tf.nn.moments(h, axes=[0, 1, 2])
        h = tf.nn.batch_normalization(h, mean, var, None, None, 1e-3)
        rng = np.random.default_rng(5)
        feeds = {"x:0": rng.standard_normal((batch, size, size, 3), dtype=np.float32),
                 "labels:0": rng.integers(0, 10, batch).astype(np.int32)}
        return ["loss:0", _classify(h, labels, optimizer)], feeds

    return _graph(build)


def unet(batch: int = 4, size: int = 64, channels: int = 16, levels: int = 3, optimizer: str = "adam") -> Built:
    """A U-Net: a down path whose activations are concatenated into the up path (long skip connections)."""

    def build() -> tuple[list[str], dict[str, np.ndarray]]:
        x = v1.placeholder(tf.float32, (batch, size, size, 3), name="x")
        target = v1.placeholder(tf.float32, (batch, size, size, 1), name="target")
        skips, h = [], x
        for i in range(levels):
            h = _conv(h, channels * 2**i, 3, f"down{i}", i)
            skips.append(h)
            h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        h = _conv(h, channels * 2**levels, 3, "middle", 9)
        for i in reversed(range(levels)):
            h = tf.image.resize(h, (size // 2**i, size // 2**i), method="nearest")
            h = _conv(tf.concat([h, skips[i]], -1), channels * 2**i, 3, f"up{i}", 20 + i)
        w = v1.get_variable("out/w", (1, 1, channels, 1), initializer=v1.glorot_uniform_initializer(seed=5))
        loss = tf.reduce_mean(tf.square(tf.nn.conv2d(h, w, 1, "SAME") - target), name="loss")
        rng = np.random.default_rng(6)
        feeds = {"x:0": rng.standard_normal((batch, size, size, 3), dtype=np.float32),
                 "target:0": rng.standard_normal((batch, size, size, 1), dtype=np.float32)}
        return ["loss:0", _train(loss, optimizer)], feeds

    return _graph(build)


BUILDERS: dict[str, Callable[..., Built]] = {
    "mlp": mlp,
    "convnet": residual_convnet,
    "wide": wide_branches,
    "rnn": unrolled_rnn,
    "moe": moe_layer,
    "inception": inception_towers,
    "unet": unet,
}
