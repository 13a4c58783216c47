"""A Transformer language model whose feed-forward blocks are sparsely gated Mixtures of Experts.

Each MoE layer (Shazeer et al. 2017; GShard's fixed-capacity dispatch) has ``experts`` FFNs, each with its
own variables. A softmax gate picks each token's ``top_k`` experts and renormalises their weights. Dispatch is
sparse and static-shaped: expert ``e`` takes the first ``capacity`` tokens routed to it (``tf.math.top_k`` over
a routed-first score gives their indices), selects just those rows (a one-hot ``(capacity, tokens)`` matmul,
whose gradient has static shapes, unlike gather's), runs its FFN on ``(capacity, d_model)`` and the weighted
results go back to their tokens through the transposed selection. Tokens beyond an expert's
capacity are dropped by that expert (they keep their residual path), as in GShard and Switch Transformer.
A load-balancing loss (Switch Transformer's ``experts * sum(fraction_routed * mean_gate)``) is added.

Memory grows with ``experts`` through the expert variables and their optimizer slots: the parameters per
expert are ``2 * d_model * d_ff + d_ff + d_model``, while the activations per layer stay about
``capacity_factor * top_k`` token-FFNs whatever the number of experts.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from models._layers import Seeds, build_graph, check_optimizer, dense, require, train_step
from models.transformer import FFN, embed, encoder_layer, feed_forward, token_loss
from tfmem import BadInputError
from tfmem.examples import Built

v1 = tf.compat.v1


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Rows each expert processes: ``ceil(capacity_factor * tokens * top_k / experts)``, at most ``tokens``.

    Examples
    --------
    >>> expert_capacity(tokens=256, experts=8, top_k=2, capacity_factor=1.25)
    80
    """
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / experts)))


def moe_layer(x: tf.Tensor, experts: int, d_ff: int, top_k: int, capacity: int, name: str,
              seeds: Seeds) -> tuple[tf.Tensor, tf.Tensor]:
    """Route each row of ``x`` (..., d_model) to its top-k experts; returns the output and the balance loss."""
    shape = x.shape.as_list()
    d_model, tokens = shape[-1], int(np.prod(shape[:-1]))
    with v1.variable_scope(name):
        flat = tf.reshape(x, (tokens, d_model))
        gates = tf.nn.softmax(dense(flat, experts, "gate", seeds, bias=False))             # (T, E)
        _, top_experts = tf.math.top_k(gates, k=top_k)                                      # (T, k)
        routed = tf.reduce_sum(tf.one_hot(top_experts, experts, dtype=tf.float32), axis=1)  # (T, E) 0/1
        weight = gates * routed
        weight = weight / tf.reduce_sum(weight, axis=1, keepdims=True)                      # top-k renormalised
        # Earlier tokens first: score = routed * (T - position); top_k of it lists routed tokens in order.
        order = tf.constant(np.arange(tokens, 0, -1, dtype=np.float32)[:, None], name="token_order")
        scores = tf.unstack(routed * order, axis=1)                                          # E x (T,)
        weights = tf.split(weight, experts, axis=1)                                          # E x (T, 1)
        dispatches = []
        for e in range(experts):
            kept, index = tf.math.top_k(scores[e], k=capacity, sorted=True, name=f"dispatch{e}")
            # (C, T) one-hot rows of the kept tokens. Matmuls rather than gather/scatter: their gradients
            # (IndexedSlices, UnsortedSegmentSum) have shapes computed at run time, which no plan can size.
            dispatches.append(tf.one_hot(index, tokens) * tf.cast(kept > 0.0, tf.float32)[:, None])
        # Dispatch and combine are one matmul each over all experts' rows, (E*C, T): per-expert matmuls against
        # the shared (T, d_model) tokens would make E gradients of that full size, all alive until summed, so
        # memory would grow with the expert count. (tf.stack, not tf.concat: concat's gradient splits at sizes
        # known only at run time.)
        rows = experts * capacity
        dispatch_all = tf.reshape(tf.stack(dispatches), (rows, tokens), name="dispatch_all")
        expert_inputs = tf.unstack(tf.reshape(tf.matmul(dispatch_all, flat), (experts, capacity, d_model)))
        expert_outputs = []
        for e in range(experts):
            h = feed_forward(expert_inputs[e], d_ff, f"expert{e}", seeds)                  # (C, d_model)
            expert_outputs.append(h * tf.matmul(dispatches[e], weights[e]))                # gate-weighted
        combined = tf.matmul(dispatch_all, tf.reshape(tf.stack(expert_outputs), (rows, d_model)),
                             transpose_a=True, name="combine")                            # (T, d_model)
        fraction = tf.reduce_mean(routed, axis=0) / top_k
        balance = experts * tf.reduce_sum(fraction * tf.reduce_mean(gates, axis=0), name="balance_loss")
        return tf.reshape(combined, shape), balance


def build(experts: int = 8, layers: int = 2, top_k: int = 2, d_model: int = 64, d_ff: int = 128, heads: int = 4,
          seq: int = 32, batch: int = 8, vocab: int = 128, capacity_factor: float = 1.25, moe_every: int = 1,
          balance_weight: float = 0.01, optimizer: str = "adam", lr: float = 1e-3, seed: int = 0) -> Built:
    """A causal Transformer LM with MoE feed-forward layers, and one training step (next-token prediction).

    Parameters
    ----------
    experts : experts per MoE layer, at least ``top_k``
    layers : Transformer layers; every ``moe_every``-th one (counting from the first) has an MoE FFN,
        the others a dense FFN of width ``d_ff``
    top_k : experts per token, 1 (Switch) or 2 (GShard)
    d_model, d_ff, heads : widths and attention heads; each expert is an FFN ``d_model -> d_ff -> d_model``
    seq, batch : tokens per sequence and sequences per step (placeholders ``tokens``/``targets``, int32)
    vocab : vocabulary size
    capacity_factor : expert capacity relative to an even split of the ``batch * seq * top_k`` assignments
    balance_weight : weight of the load-balancing loss
    optimizer, lr : ``"sgd"``, ``"momentum"`` or ``"adam"`` and its learning rate
    seed : graph seed and feed seed

    Returns
    -------
    Built
        fetches ``["loss:0", "train_op"]`` (``loss`` is the LM loss; the step minimises ``total_loss``, which
        adds the balance term); feeds ``tokens:0``,
        ``targets:0``; ``params`` counts every trainable parameter.

    Raises
    ------
    BadInputError
        For sizes below their minimum, ``top_k`` not 1 or 2, ``experts < top_k`` or ``heads`` not dividing
        ``d_model``.

    Examples
    --------
    >>> m = build(experts=4, layers=1, d_model=16, d_ff=32, heads=2, seq=8, batch=2, vocab=16)
    >>> m.fetches, sorted(m.feeds)
    (['loss:0', 'train_op'], ['targets:0', 'tokens:0'])
    >>> build(experts=1, top_k=2)
    Traceback (most recent call last):
    ...
    tfmem.errors.BadInputError: moe_transformer: experts (1) must be >= top_k (2)
    """
    require("moe_transformer", experts=(experts, 1), layers=(layers, 1), d_model=(d_model, 1), d_ff=(d_ff, 1),
            heads=(heads, 1), seq=(seq, 2), batch=(batch, 1), vocab=(vocab, 2), moe_every=(moe_every, 1),
            capacity_factor=(capacity_factor, 1e-9), balance_weight=(balance_weight, 0.0))
    check_optimizer("moe_transformer", optimizer)
    if top_k not in (1, 2):
        raise BadInputError(f"moe_transformer: top_k must be 1 or 2, got {top_k!r}")
    if experts < top_k:
        raise BadInputError(f"moe_transformer: experts ({experts}) must be >= top_k ({top_k})")
    if d_model % heads:
        raise BadInputError(f"moe_transformer: heads ({heads}) must divide d_model ({d_model})")
    capacity = expert_capacity(batch * seq, experts, top_k, capacity_factor)

    def body() -> tuple[list[str], dict[str, np.ndarray]]:
        seeds = Seeds(seed)
        tokens = v1.placeholder(tf.int32, (batch, seq), name="tokens")
        targets = v1.placeholder(tf.int32, (batch, seq), name="targets")
        balance: list[tf.Tensor] = []

        def make_ffn(moe: bool) -> FFN:
            def ffn(x: tf.Tensor, scope: str) -> tf.Tensor:
                if not moe:
                    return feed_forward(x, d_ff, scope, seeds)
                y, aux = moe_layer(x, experts, d_ff, top_k, capacity, f"{scope}/moe", seeds)
                balance.append(aux)
                return y
            return ffn

        h = embed(tokens, vocab, d_model, "embed", seeds)
        for i in range(layers):
            h = encoder_layer(h, heads, make_ffn(i % moe_every == 0), f"layer{i}", seeds, causal=True)
        lm = token_loss(h, targets, vocab, seeds)
        total = tf.add(lm, balance_weight * tf.add_n(balance), name="total_loss")
        return ["loss:0", train_step(total, optimizer, lr)], lm_feeds(seed, batch, seq, vocab)

    return build_graph("moe_transformer", body, seed)


def lm_feeds(seed: int, batch: int, seq: int, vocab: int) -> dict[str, np.ndarray]:
    """Feeds ``tokens:0`` and ``targets:0`` (int32, ``(batch, seq)``) of a learnable stream: each sequence counts
    up from a random start with a random stride (mod ``vocab``); targets are the next tokens."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, vocab, (batch, 1))
    stride = rng.integers(1, 4, (batch, 1))
    stream = (start + stride * np.arange(seq + 1)[None, :]) % vocab
    return {"tokens:0": stream[:, :-1].astype(np.int32), "targets:0": stream[:, 1:].astype(np.int32)}
