"""Small Keras 3 models for the TensorFlow 2 measurements: each compiled, with data for a few batches.

Sized so that one training step takes about a second on this machine's CPU and its activations dominate its
device peak (what a plan can move). Each builder takes a seed and returns ``(model, x, y, batch_size)``;
building under ``tf.device(...)`` puts the variables there.

    model, x, y, batch = build("conv", seed=0)
    model.fit(x, y, batch_size=batch, epochs=1)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def _compiled(model: Any) -> Any:
    import keras

    model.compile(optimizer=keras.optimizers.Adam(), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def mlp(rng: np.random.Generator) -> tuple[Any, np.ndarray, np.ndarray, int]:
    """Eight 256-wide ReLU layers on 128 features, batches of 4096."""
    import keras

    model = keras.Sequential([keras.Input((128,)), *(keras.layers.Dense(256, activation="relu") for _ in range(8)),
                              keras.layers.Dense(10)])
    return _compiled(model), rng.random((3 * 4096, 128), np.float32), rng.integers(0, 10, 3 * 4096), 4096


def conv(rng: np.random.Generator) -> tuple[Any, np.ndarray, np.ndarray, int]:
    """Three conv blocks (conv, batch norm in training mode, ReLU, pooling) and dropout with a fixed seed."""
    import keras

    layers: list[Any] = [keras.Input((32, 32, 3))]
    for width in (32, 64, 128):
        layers += [keras.layers.Conv2D(width, 3, padding="same", use_bias=False), keras.layers.BatchNormalization(),
                   keras.layers.ReLU(), keras.layers.MaxPooling2D()]
    layers += [keras.layers.Flatten(), keras.layers.Dropout(0.3, seed=1), keras.layers.Dense(10)]
    model = keras.Sequential(layers)
    return _compiled(model), rng.random((3 * 64, 32, 32, 3), np.float32), rng.integers(0, 10, 3 * 64), 64


def attention(rng: np.random.Generator) -> tuple[Any, np.ndarray, np.ndarray, int]:
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


def lstm(rng: np.random.Generator) -> tuple[Any, np.ndarray, np.ndarray, int]:
    """Two stacked LSTM layers (64 units) over 64 steps of 32 features: the loop keeps every step's activations
    in TensorLists for the gradient."""
    import keras

    model = keras.Sequential([keras.Input((64, 32)), keras.layers.LSTM(64, return_sequences=True),
                              keras.layers.LSTM(64), keras.layers.Dense(10)])
    return _compiled(model), rng.random((3 * 128, 64, 32), np.float32), rng.integers(0, 10, 3 * 128), 128


BUILDERS: dict[str, Callable[[np.random.Generator], tuple[Any, np.ndarray, np.ndarray, int]]] = {
    "mlp": mlp, "conv": conv, "attention": attention, "lstm": lstm}


def build(name: str, seed: int = 0) -> tuple[Any, np.ndarray, np.ndarray, int]:
    """The model ``name`` (one of ``BUILDERS``) with Keras' seeds set to ``seed``, its inputs and labels (int32)
    and its batch size (which divides the data: every step is planned)."""
    import keras

    if name not in BUILDERS:
        raise ValueError(f"no Keras 3 model {name!r}; choose from {', '.join(BUILDERS)}")
    keras.utils.set_random_seed(seed)
    model, x, y, batch = BUILDERS[name](np.random.default_rng(seed))
    return model, x, y.astype(np.int32), batch
