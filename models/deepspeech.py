"""DeepSpeech2-style speech model (Amodei et al. 2016) with a statically unrolled recurrence and CTC loss.

Spectrogram frames ``(batch, seq_len, freq)`` go through 2-D convolutions over (time, frequency) (stride 1 in
time, 2 in frequency; batch norm; clipped ReLU, ``min(relu(x), 20)``), then ``rnn_layers`` bidirectional
recurrent layers (GRU or clipped-ReLU RNN, forward and backward outputs summed, as in DS2), each unrolled over
every frame as separate ops, so memory grows linearly with ``seq_len`` as in the TensorFlowMem experiment;
then a per-frame classifier and TensorFlow's CTC loss (``CTCLoss``, blank = last class) against fixed-length
label sequences. All shapes are static: the labels' sparse indices are constants.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from models._layers import Seeds, batch_norm, build_graph, check_optimizer, conv2d, dense, require, train_step
from models._layers import variable as make_variable
from tfmem import BadInputError
from tfmem.examples import Built

v1 = tf.compat.v1

CELLS = ("gru", "rnn")


def _clipped_relu(x: tf.Tensor) -> tf.Tensor:
    return tf.minimum(tf.nn.relu(x), 20.0)


def _cell(kind: str, hidden: int, name: str, seeds: Seeds) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """A step function ``(projected input, h) -> h'``; the input projection is done for all frames at once.

    Splits use ``tf.split`` and the recurrent weights are separate variables: slicing a tensor per step
    would give every step's gradient the full tensor's size.
    """
    if kind == "rnn":
        u = make_variable(f"{name}/u", (hidden, hidden), seeds())
        return lambda xw, h: _clipped_relu(xw + tf.matmul(h, u))
    u_zr = make_variable(f"{name}/u_zr", (hidden, 2 * hidden), seeds())
    u_n = make_variable(f"{name}/u_n", (hidden, hidden), seeds())

    def gru(xw: tf.Tensor, h: tf.Tensor) -> tf.Tensor:
        x_zr, x_n = tf.split(xw, [2 * hidden, hidden], axis=1)
        z, r = tf.split(tf.sigmoid(x_zr + tf.matmul(h, u_zr)), 2, axis=1)
        n = tf.tanh(x_n + tf.matmul(r * h, u_n))
        return (1.0 - z) * n + z * h

    return gru


def bidirectional_layer(frames: list[tf.Tensor], kind: str, hidden: int, name: str, seeds: Seeds) -> list[tf.Tensor]:
    """One bidirectional recurrent layer unrolled over ``frames`` (each ``(batch, features)``); outputs summed."""
    batch = int(frames[0].shape[0])
    width = (3 if kind == "gru" else 1) * hidden
    with v1.variable_scope(name):
        outputs = []
        for direction in ("fw", "bw"):
            with v1.variable_scope(direction):
                # One matmul projects every frame's input; the recurrence then unrolls over the slices.
                projected = tf.unstack(dense(tf.stack(frames, axis=0), width, "w", seeds))  # T x (B, width)
                step = _cell(kind, hidden, "cell", seeds)
                order = range(len(frames)) if direction == "fw" else reversed(range(len(frames)))
                h, states = tf.zeros((batch, hidden)), {}
                for t in order:
                    h = step(projected[t], h)
                    states[t] = h
                outputs.append([states[t] for t in range(len(frames))])
        return [tf.add(f, b, name=f"out{t}") for t, (f, b) in enumerate(zip(*outputs, strict=True))]


def build(seq_len: int = 32, batch: int = 4, freq: int = 32, conv_channels: int = 8, conv_layers: int = 2,
          rnn_layers: int = 2, hidden: int = 64, cell: str = "gru", classes: int = 29, label_len: int | None = None,
          optimizer: str = "adam", lr: float = 1e-3, seed: int = 0) -> Built:
    """A DeepSpeech2-like acoustic model and one CTC training step.

    Parameters
    ----------
    seq_len : spectrogram frames per utterance; the recurrence is unrolled over all of them
    batch : utterances per step (placeholder ``spectrogram`` is ``(batch, seq_len, freq)``)
    freq : frequency bins per frame; halved by each convolution
    conv_channels, conv_layers : the convolutional front end (kernel 5 x 11, stride 1 x 2)
    rnn_layers, hidden, cell : bidirectional recurrent layers, their width, ``"gru"`` or ``"rnn"``
    classes : output symbols including the CTC blank (the last one)
    label_len : symbols per transcript (placeholder ``labels`` is ``(batch, label_len)``); default ``seq_len // 4``
    optimizer, lr : ``"sgd"``, ``"momentum"`` or ``"adam"`` and its learning rate
    seed : graph seed and feed seed

    Returns
    -------
    Built
        fetches ``["loss:0", "train_op"]`` (mean CTC loss); feeds ``spectrogram:0`` and ``labels:0``.

    Raises
    ------
    BadInputError
        For sizes below their minimum, an unknown cell, or transcripts too long for ``seq_len`` frames.

    Examples
    --------
    >>> m = build(seq_len=8, batch=2, freq=8, rnn_layers=1, hidden=8)
    >>> m.fetches, m.feed_shapes
    (['loss:0', 'train_op'], {'spectrogram:0': (2, 8, 8), 'labels:0': (2, 2)})
    """
    label_len = max(1, seq_len // 4) if label_len is None else label_len
    require("deepspeech", seq_len=(seq_len, 1), batch=(batch, 1), freq=(freq, 1), conv_channels=(conv_channels, 1),
            conv_layers=(conv_layers, 0), rnn_layers=(rnn_layers, 1), hidden=(hidden, 1), classes=(classes, 2),
            label_len=(label_len, 1))
    check_optimizer("deepspeech", optimizer)
    if cell not in CELLS:
        raise BadInputError(f"deepspeech: cell must be one of {', '.join(CELLS)}, got {cell!r}")
    if 2 * label_len > seq_len:
        # CTC needs a frame per symbol plus a blank between repeats; random labels may repeat anywhere.
        raise BadInputError(f"deepspeech: label_len ({label_len}) must be at most seq_len / 2 ({seq_len // 2})")

    def body() -> tuple[list[str], dict[str, np.ndarray]]:
        seeds = Seeds(seed)
        spectrogram = v1.placeholder(tf.float32, (batch, seq_len, freq), name="spectrogram")
        labels = v1.placeholder(tf.int32, (batch, label_len), name="labels")
        h = spectrogram[..., None]
        for i in range(conv_layers):
            h = conv2d(h, conv_channels, (5, 11), (1, 2), f"conv{i}", seeds)
            h = _clipped_relu(batch_norm(h, f"conv{i}_bn"))
        features = tf.reshape(h, (batch, seq_len, int(h.shape[2]) * int(h.shape[3])))
        frames = tf.unstack(features, axis=1)
        for i in range(rnn_layers):
            frames = bidirectional_layer(frames, cell, hidden, f"birnn{i}", seeds)
        logits = dense(tf.stack(frames, axis=0), classes, "fc", seeds)                   # (T, B, classes)
        sparse = tf.SparseTensor(_label_indices(batch, label_len), tf.reshape(labels, (-1,)), (batch, label_len))
        lengths = tf.constant(np.full(batch, seq_len, np.int32), name="seq_lengths")
        ctc = v1.nn.ctc_loss(sparse, logits, lengths, time_major=True)
        loss = tf.reduce_mean(ctc, name="loss")
        return ["loss:0", train_step(loss, optimizer, lr)], _feeds(seed, batch, seq_len, freq, classes, label_len)

    return build_graph("deepspeech", body, seed)


def _label_indices(batch: int, label_len: int) -> np.ndarray:
    rows, cols = np.meshgrid(np.arange(batch), np.arange(label_len), indexing="ij")
    return np.stack([rows.ravel(), cols.ravel()], axis=1).astype(np.int64)


def _feeds(seed: int, batch: int, seq_len: int, freq: int, classes: int, label_len: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"spectrogram:0": rng.standard_normal((batch, seq_len, freq)).astype(np.float32),
            "labels:0": rng.integers(0, classes - 1, (batch, label_len)).astype(np.int32)}
