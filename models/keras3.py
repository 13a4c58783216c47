"""Small Keras 3 models for the TensorFlow 2 measurements: each compiled, with data for a few batches.

Sized so that one training step takes about a second on this machine's CPU and its activations dominate its
device peak (what a plan can move), but for ``moe``, whose experts' weights dominate it. Each builder takes a
seed and a host device and returns ``(model, x, y, batch_size)``; building under ``tf.device(...)`` puts the
variables there, and ``moe`` creates its experts (and so Adam's slots for them) on ``host`` when one is given.

    model, x, y, batch = build("conv", seed=0)
    model.fit(x, y, batch_size=batch, epochs=1)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np


def _compiled(model: Any) -> Any:
    import keras

    model.compile(optimizer=keras.optimizers.Adam(), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def mlp(rng: np.random.Generator, host: str | None = None) -> tuple[Any, np.ndarray, np.ndarray, int]:
    """Eight 256-wide ReLU layers on 128 features, batches of 4096."""
    import keras

    model = keras.Sequential([keras.Input((128,)), *(keras.layers.Dense(256, activation="relu") for _ in range(8)),
                              keras.layers.Dense(10)])
    return _compiled(model), rng.random((3 * 4096, 128), np.float32), rng.integers(0, 10, 3 * 4096), 4096


def conv(rng: np.random.Generator, host: str | None = None) -> tuple[Any, np.ndarray, np.ndarray, int]:
    """Three conv blocks (conv, batch norm in training mode, ReLU, pooling) and dropout with a fixed seed."""
    import keras

    layers: list[Any] = [keras.Input((32, 32, 3))]
    for width in (32, 64, 128):
        layers += [keras.layers.Conv2D(width, 3, padding="same", use_bias=False), keras.layers.BatchNormalization(),
                   keras.layers.ReLU(), keras.layers.MaxPooling2D()]
    layers += [keras.layers.Flatten(), keras.layers.Dropout(0.3, seed=1), keras.layers.Dense(10)]
    model = keras.Sequential(layers)
    return _compiled(model), rng.random((3 * 64, 32, 32, 3), np.float32), rng.integers(0, 10, 3 * 64), 64


def attention(rng: np.random.Generator, host: str | None = None) -> tuple[Any, np.ndarray, np.ndarray, int]:
    """Token embeddings, two self-attention blocks (4 heads) with feed-forward layers, mean pooling."""
    import keras

    tokens = keras.Input((128,), dtype="int32")
    h = keras.layers.Embedding(1000, 128)(tokens)
    for _ in range(2):
        a = keras.layers.MultiHeadAttention(num_heads=4, key_dim=32)(h, h)
        h = keras.layers.LayerNormalization()(h + a)
        f = keras.layers.Dense(512, activation="relu")(h)
        h = keras.layers.LayerNormalization()(h + keras.layers.Dense(128)(f))
    logits = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(tokens, logits)
    return (_compiled(model), rng.integers(0, 1000, (3 * 32, 128)).astype(np.int32), rng.integers(0, 10, 3 * 32),
            32)


def lstm(rng: np.random.Generator, host: str | None = None) -> tuple[Any, np.ndarray, np.ndarray, int]:
    """Two stacked LSTM layers (64 units) over 64 steps of 32 features: the loop keeps every step's activations
    in TensorLists for the gradient."""
    import keras

    model = keras.Sequential([keras.Input((64, 32)), keras.layers.LSTM(64, return_sequences=True),
                              keras.layers.LSTM(64), keras.layers.Dense(10)])
    return _compiled(model), rng.random((3 * 128, 64, 32), np.float32), rng.integers(0, 10, 3 * 128), 128


def moe(rng: np.random.Generator, host: str | None = None, *, experts: int = 24, hidden: int = 1024,
        width: int = 256, batch: int = 256) -> tuple[Any, np.ndarray, np.ndarray, int]:
    """A mixture of ``experts`` experts (each ``width -> hidden -> width``, ReLU) between two dense layers, with a
    softmax gate that weighs every expert's output for every token: each step reads and updates all experts,
    one after another. With ``host``, the experts are created there (``tfmem.on_host``), and so are Adam's
    slots for them: they visit the device only while used."""
    import contextlib

    import keras

    from tfmem.host_variables import on_host

    tokens = keras.Input((width,))
    h = keras.layers.Dense(width, activation="relu")(tokens)
    gates = keras.layers.Dense(experts, activation="softmax")(h)
    with on_host(host) if host else contextlib.nullcontext():
        mixed = experts_layer(experts, hidden)(h, gates)
    model = keras.Model(tokens, keras.layers.Dense(10)(h + mixed))
    return (_compiled(model), rng.random((3 * batch, width), np.float32), rng.integers(0, 10, 3 * batch),
            batch)


@functools.cache   # one class (Keras is imported on first use)
def _experts_layer() -> type:
    import keras

    class _Experts(keras.layers.Layer):  # type: ignore[misc]
        """``experts`` two-layer ReLU networks, each its own variables, mixed by the gate's weights."""

        def __init__(self, experts: int, hidden: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.experts, self.hidden = experts, hidden

        def build(self, x_shape: Any, gates_shape: Any = None) -> None:
            width = x_shape[-1]
            self.w_in = [self.add_weight((width, self.hidden), name=f"expert{e}_in") for e in range(self.experts)]
            self.w_out = [self.add_weight((self.hidden, width), name=f"expert{e}_out") for e in range(self.experts)]

        def call(self, x: Any, gates: Any) -> Any:
            from keras import ops

            out = None
            for e in range(self.experts):
                y = ops.matmul(ops.relu(ops.matmul(x, self.w_in[e])), self.w_out[e]) * gates[:, e:e + 1]
                out = y if out is None else out + y
            return out

    return _Experts


def experts_layer(experts: int, hidden: int) -> Any:
    """The experts of ``moe``: a Keras layer called on ``(x, gates)``."""
    return _experts_layer()(experts, hidden)


BUILDERS: dict[str, Callable[[np.random.Generator, str | None], tuple[Any, np.ndarray, np.ndarray, int]]] = {
    "mlp": mlp, "conv": conv, "attention": attention, "lstm": lstm, "moe": moe}


def build(name: str, seed: int = 0, host: str | None = None) -> tuple[Any, np.ndarray, np.ndarray, int]:
    """The model ``name`` (one of ``BUILDERS``) with Keras' seeds set to ``seed``, its inputs and labels (int32)
    and its batch size (which divides the data: every step is planned). ``host``: where ``moe`` creates its
    experts (the others ignore it)."""
    import keras

    if name not in BUILDERS:
        raise ValueError(f"no Keras 3 model {name!r}; choose from {', '.join(BUILDERS)}")
    keras.utils.set_random_seed(seed)
    model, x, y, batch = BUILDERS[name](np.random.default_rng(seed), host)
    return model, x, y.astype(np.int32), batch
