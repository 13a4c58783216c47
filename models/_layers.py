"""Layers the benchmark models share, written as plain TF ops (tf.compat.v1 graph mode, seeded initialisers).

Every variable gets its own seed so that a model built twice has identical weights whatever the build order,
and normalisations are spelled out (moments, scale, shift) rather than fused kernels, so the graphs run on
TensorFlow's CPU kernels and every tensor has a static shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from tfmem import BadInputError
from tfmem.examples import Built

v1 = tf.compat.v1

OPTIMIZERS: dict[str, Callable[[float], v1.train.Optimizer]] = {
    "sgd": lambda lr: v1.train.GradientDescentOptimizer(lr),
    "momentum": lambda lr: v1.train.MomentumOptimizer(lr, 0.9),
    "adam": lambda lr: v1.train.AdamOptimizer(lr),
}


def build_graph(model: str, build: Callable[[], tuple[list[str], dict[str, np.ndarray]]], seed: int) -> Built:
    """Run ``build`` in a fresh graph with graph-level seed ``seed``; count the trainable parameters."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(seed)
        fetches, feeds = build()
        params = sum(int(np.prod(v.shape)) for v in v1.trainable_variables())
    return Built(graph, fetches, feeds, params)


def require(model: str, **values: tuple[int | float, int | float]) -> None:
    """Raise ``BadInputError`` naming the argument when ``value < minimum`` for any ``name=(value, minimum)``."""
    for name, (value, minimum) in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < minimum:
            raise BadInputError(f"{model}: {name} must be a number >= {minimum}, got {value!r}")


def check_optimizer(model: str, optimizer: str) -> None:
    if optimizer not in OPTIMIZERS:
        raise BadInputError(f"{model}: unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")


class Seeds:
    """Hands out a distinct, deterministic op-level seed per variable (in creation order)."""

    def __init__(self, base: int) -> None:
        self.next_seed = base * 100_003

    def __call__(self) -> int:
        self.next_seed += 1
        return self.next_seed


def variable(name: str, shape: tuple[int, ...], seed: int | None, init: str = "glorot") -> tf.Variable:
    initializer = {
        "glorot": lambda: v1.glorot_uniform_initializer(seed=seed),
        "he": lambda: v1.variance_scaling_initializer(2.0, "fan_in", "truncated_normal", seed=seed),
        "normal": lambda: v1.random_normal_initializer(0.0, 0.02, seed=seed),
        "zeros": v1.zeros_initializer,
        "ones": v1.ones_initializer,
    }[init]()
    return v1.get_variable(name, shape, initializer=initializer)


def dense(x: tf.Tensor, units: int, name: str, seeds: Seeds, activation: Callable | None = None,
          bias: bool = True) -> tf.Tensor:
    """``activation(x @ w + b)`` over the last axis of ``x`` (any rank)."""
    w = variable(f"{name}/w", (int(x.shape[-1]), units), seeds())
    flat = tf.reshape(x, (-1, int(x.shape[-1]))) if x.shape.rank != 2 else x
    y = tf.matmul(flat, w)
    if bias:
        y = tf.nn.bias_add(y, variable(f"{name}/b", (units,), None, "zeros"))
    if x.shape.rank != 2:
        y = tf.reshape(y, [*x.shape.as_list()[:-1], units])
    return activation(y) if activation is not None else y


def layer_norm(x: tf.Tensor, name: str, eps: float = 1e-5) -> tf.Tensor:
    """Normalise over the last axis with a learned scale and shift."""
    with v1.variable_scope(name):
        mean, var = tf.nn.moments(x, axes=[x.shape.rank - 1], keepdims=True)
        gamma = variable("gamma", (int(x.shape[-1]),), None, "ones")
        beta = variable("beta", (int(x.shape[-1]),), None, "zeros")
        return tf.nn.batch_normalization(x, mean, var, beta, gamma, eps)


def batch_norm(x: tf.Tensor, name: str, eps: float = 1e-5) -> tf.Tensor:
    """Training-mode batch norm over every axis but the channels, as plain ops (no fused kernel)."""
    with v1.variable_scope(name):
        mean, var = tf.nn.moments(x, axes=list(range(x.shape.rank - 1)))
        gamma = variable("gamma", (int(x.shape[-1]),), None, "ones")
        beta = variable("beta", (int(x.shape[-1]),), None, "zeros")
        return tf.nn.batch_normalization(x, mean, var, beta, gamma, eps)


def conv2d(x: tf.Tensor, cout: int, kernel: int | tuple[int, int], stride: int | tuple[int, int], name: str,
           seeds: Seeds) -> tf.Tensor:
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    w = variable(f"{name}/w", (kh, kw, int(x.shape[-1]), cout), seeds(), "he")
    return tf.nn.conv2d(x, w, stride, "SAME", name=name)


def train_step(loss: tf.Tensor, optimizer: str, lr: float, var_list: list[tf.Variable] | None = None,
               name: str = "train_op") -> str:
    """One optimizer step on ``loss``; returns the train op's name."""
    return OPTIMIZERS[optimizer](lr).minimize(loss, var_list=var_list, name=name).name


def sinusoid_positions(seq: int, d_model: int) -> np.ndarray:
    """The Transformer's fixed sinusoidal position encodings, ``(seq, d_model)`` float32."""
    pos = np.arange(seq, dtype=np.float64)[:, None]
    rates = np.exp(-math.log(10000.0) * (np.arange(0, d_model, 2) / d_model))[None, :]
    table = np.zeros((seq, d_model))
    table[:, 0::2] = np.sin(pos * rates)
    table[:, 1::2] = np.cos(pos * rates)[:, : d_model // 2]
    return table.astype(np.float32)
