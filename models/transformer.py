"""Transformer (Vaswani et al. 2017) as a TF1 graph builder: encoder, optional decoder, multi-head attention.

The task is a toy sequence-to-sequence one that a few steps visibly learn: the target is the source reversed
(teacher-forced: the decoder reads ``BOS`` + target[:-1]). With ``decoder_layers=0`` the model is an encoder
that predicts the reversed sequence at every position. Layers are pre-norm (layer norm, sublayer, residual).
The attention and layer helpers here are also used by ``models.moe_transformer``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from models._layers import (
    Seeds,
    build_graph,
    check_optimizer,
    dense,
    layer_norm,
    require,
    sinusoid_positions,
    train_step,
    variable,
)
from tfmem import BadInputError
from tfmem.examples import Built

v1 = tf.compat.v1


def attention(queries: tf.Tensor, memory: tf.Tensor, heads: int, name: str, seeds: Seeds,
              causal: bool = False) -> tf.Tensor:
    """Multi-head scaled dot-product attention of ``queries`` (B, Sq, D) over ``memory`` (B, Sk, D)."""
    batch, sq, d_model = queries.shape.as_list()
    sk = int(memory.shape[1])
    dh = d_model // heads

    def split(t: tf.Tensor, s: int) -> tf.Tensor:   # (B, S, D) -> (B, S, H, Dh)
        return tf.reshape(t, (batch, s, heads, dh))

    # einsum rather than transposes: Transpose's gradient permutes by InvertPermutation(perm), an op whose
    # output shape inference cannot size, so the gradient tensors' sizes would be unknown to the simulator.
    with v1.variable_scope(name):
        q = split(dense(queries, d_model, "q", seeds), sq)
        k = split(dense(memory, d_model, "k", seeds), sk)
        v = split(dense(memory, d_model, "v", seeds), sk)
        logits = tf.einsum("bqhd,bkhd->bhqk", q, k) * (dh ** -0.5)
        if causal:
            mask = np.triu(np.full((sq, sk), -1e9, np.float32), k=1)
            logits = logits + tf.constant(mask, name="causal_mask")
        weights = tf.nn.softmax(logits)
        context = tf.reshape(tf.einsum("bhqk,bkhd->bqhd", weights, v), (batch, sq, d_model))
        return dense(context, d_model, "out", seeds)


def feed_forward(x: tf.Tensor, d_ff: int, name: str, seeds: Seeds) -> tf.Tensor:
    """The position-wise FFN: dense(d_ff, relu) then dense(d_model)."""
    with v1.variable_scope(name):
        return dense(dense(x, d_ff, "in", seeds, tf.nn.relu), int(x.shape[-1]), "out", seeds)


FFN = Callable[[tf.Tensor, str], tf.Tensor]


def encoder_layer(x: tf.Tensor, heads: int, ffn: FFN, name: str, seeds: Seeds, causal: bool = False) -> tf.Tensor:
    """Pre-norm self-attention then ``ffn(x, scope)``, each with a residual connection."""
    with v1.variable_scope(name):
        h = layer_norm(x, "ln_att")
        x = x + attention(h, h, heads, "self_att", seeds, causal)
        return x + ffn(layer_norm(x, "ln_ffn"), "ffn")


def decoder_layer(x: tf.Tensor, memory: tf.Tensor, heads: int, ffn: FFN, name: str, seeds: Seeds) -> tf.Tensor:
    """Causal self-attention, attention over the encoder's output, then ``ffn``; pre-norm, residuals."""
    with v1.variable_scope(name):
        h = layer_norm(x, "ln_self")
        x = x + attention(h, h, heads, "self_att", seeds, causal=True)
        x = x + attention(layer_norm(x, "ln_cross"), memory, heads, "cross_att", seeds)
        return x + ffn(layer_norm(x, "ln_ffn"), "ffn")


def embed(ids: tf.Tensor, vocab: int, d_model: int, name: str, seeds: Seeds) -> tf.Tensor:
    """Token embedding (scaled by sqrt(d_model)) plus fixed sinusoidal positions.

    The lookup is a one-hot matmul, not ``tf.gather``: gather's gradient is ``IndexedSlices``, whose sparse
    optimizer update (``Unique`` and friends) has data-dependent shapes that no memory plan can size.
    """
    table = variable(f"{name}/table", (vocab, d_model), seeds(), "normal")
    batch, seq = ids.shape.as_list()
    positions = tf.constant(sinusoid_positions(seq, d_model), name=f"{name}/positions")
    one_hot = tf.one_hot(tf.reshape(ids, (-1,)), vocab, dtype=tf.float32)
    vectors = tf.reshape(tf.matmul(one_hot, table), (batch, seq, d_model))
    return vectors * (d_model ** 0.5) + positions


def token_loss(h: tf.Tensor, targets: tf.Tensor, vocab: int, seeds: Seeds) -> tf.Tensor:
    """Mean softmax cross-entropy of a vocabulary projection of ``h`` against integer ``targets``."""
    logits = dense(layer_norm(h, "ln_final"), vocab, "logits", seeds)
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits)
    return tf.reduce_mean(xent, name="loss")


def build(layers: int = 2, heads: int = 4, d_model: int = 64, d_ff: int = 256, seq: int = 32, batch: int = 8,
          vocab: int = 128, decoder_layers: int | None = None, optimizer: str = "adam", lr: float = 1e-3,
          seed: int = 0) -> Built:
    """An encoder(-decoder) Transformer and one training step on a reverse-the-sequence task.

    Parameters
    ----------
    layers : encoder layers
    heads : attention heads; must divide ``d_model``
    d_model, d_ff : model and feed-forward widths
    seq, batch : sequence length and batch size (placeholders ``src`` and ``tgt`` are ``(batch, seq)`` int32)
    vocab : vocabulary size, at least 3 (token 0 is BOS)
    decoder_layers : decoder layers; default ``layers``; 0 builds an encoder only
    optimizer : ``"sgd"``, ``"momentum"`` or ``"adam"``; lr: its learning rate
    seed : graph seed and feed seed

    Returns
    -------
    Built
        fetches ``["loss:0", "train_op"]``; feeds ``src:0``, ``tgt:0`` (and ``tgt_in:0`` with a decoder).

    Raises
    ------
    BadInputError
        For sizes below their minimum, or ``heads`` not dividing ``d_model``.

    Examples
    --------
    >>> m = build(layers=1, heads=2, d_model=16, d_ff=32, seq=8, batch=2, vocab=16)
    >>> m.fetches, sorted(m.feeds), m.params > 0
    (['loss:0', 'train_op'], ['src:0', 'tgt:0', 'tgt_in:0'], True)
    """
    decoder_layers = layers if decoder_layers is None else decoder_layers
    require("transformer", layers=(layers, 1), heads=(heads, 1), d_model=(d_model, 1), d_ff=(d_ff, 1),
            seq=(seq, 1), batch=(batch, 1), vocab=(vocab, 3), decoder_layers=(decoder_layers, 0))
    check_optimizer("transformer", optimizer)
    if d_model % heads:
        raise BadInputError(f"transformer: heads ({heads}) must divide d_model ({d_model})")

    def body() -> tuple[list[str], dict[str, np.ndarray]]:
        seeds = Seeds(seed)
        src = v1.placeholder(tf.int32, (batch, seq), name="src")
        tgt = v1.placeholder(tf.int32, (batch, seq), name="tgt")

        def ffn(x: tf.Tensor, scope: str) -> tf.Tensor:
            return feed_forward(x, d_ff, scope, seeds)

        h = embed(src, vocab, d_model, "src_embed", seeds)
        for i in range(layers):
            h = encoder_layer(h, heads, ffn, f"encoder{i}", seeds)
        feeds = _reverse_task(seed, batch, seq, vocab)
        if decoder_layers:
            memory = layer_norm(h, "ln_memory")
            tgt_in = v1.placeholder(tf.int32, (batch, seq), name="tgt_in")
            h = embed(tgt_in, vocab, d_model, "tgt_embed", seeds)
            for i in range(decoder_layers):
                h = decoder_layer(h, memory, heads, ffn, f"decoder{i}", seeds)
        else:
            del feeds["tgt_in:0"]
        loss = token_loss(h, tgt, vocab, seeds)
        return ["loss:0", train_step(loss, optimizer, lr)], feeds

    return build_graph("transformer", body, seed)


def _reverse_task(seed: int, batch: int, seq: int, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = rng.integers(1, vocab, (batch, seq)).astype(np.int32)
    tgt = src[:, ::-1].copy()
    tgt_in = np.concatenate([np.zeros((batch, 1), np.int32), tgt[:, :-1]], axis=1)
    return {"src:0": src, "tgt:0": tgt, "tgt_in:0": tgt_in}
