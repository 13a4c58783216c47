"""A Transformer LM whose MoE layers are spread over machines: expert parallelism for the experts, data
parallelism for the rest.

Machine ``m`` (``machine_device(m)``, the testbed's name for it, or any device strings given) takes the
``m``-th slice of the batch (its *group*) through the dense layers, whose variables live once, on machine 0, and
are read by every group. Each MoE layer's experts are split evenly: machine ``m`` owns experts ``m * E/M ... (m+1) * E/M - 1``,
their variables and (through TensorFlow's colocation) their optimizer slots. Routing is per group, as in
GShard: each group's gate picks every token's ``top_k`` experts, and each expert takes at most ``capacity``
tokens of each group (earlier tokens first; later ones are dropped by that expert and keep their residual
path). A group's rows for expert ``e`` are sent to ``e``'s owner, which runs the expert once over all groups'
rows stacked, and sends each group its rows back; the group combines them, weighted by its gate.

Two dispatches, with the same arithmetic:

- ``"dense"``: a group selects its rows with a one-hot ``(E * C, T)`` matrix product and combines them with
  its transpose (``models.moe_transformer``'s way);
- ``"sparse"``: the same rows by ``tf.gather`` and back by ``tf.math.unsorted_segment_sum``, so no tensor of
  size tokens x (experts x capacity) exists on any device, and routing keeps one ``(T,)`` mask per expert
  rather than one-hot ``(T, k, E)`` and ``(T, E)`` tensors.

A selected row is a copy either way, and a token's combined output sums at most ``top_k`` non-zero rows, so
both dispatches give bit-identical losses and updates (tests/test_distributed_moe.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from models._layers import OPTIMIZERS, Seeds, build_graph, check_optimizer, dense, layer_norm, require
from models.moe_transformer import expert_capacity, lm_feeds
from models.transformer import attention, embed, feed_forward
from tfmem import BadInputError
from tfmem.examples import Built

v1 = tf.compat.v1
DISPATCHES = ("dense", "sparse")


def machine_device(machine: int) -> str:
    """Machine ``machine``'s device as the multi-machine testbed names it (``tfmem.testbed.graph.device_name``,
    which models may not import; tests/test_distributed_moe.py checks they agree)."""
    return f"/job:worker/replica:0/task:{machine}/device:CPU:0"


def expert_owner(expert: int, experts: int, machines: int) -> int:
    """The machine that owns ``expert``: experts are split into ``machines`` equal consecutive blocks.

    >>> [expert_owner(e, 8, 4) for e in range(8)]
    [0, 0, 1, 1, 2, 2, 3, 3]
    """
    return expert // (experts // machines)


def _route(gates: tf.Tensor, experts: int, top_k: int, capacity: int,
           dispatch: str) -> tuple[list[tf.Tensor], list[tf.Tensor], tf.Tensor]:
    """Per expert, the indices (C,) of the group's tokens it takes and their 0/1 mask (C,) (0: an empty slot);
    and the routed fraction per expert (E,), for the balance loss."""
    tokens = int(gates.shape[0])
    _, top = tf.math.top_k(gates, k=top_k)                                                   # (T, k)
    order = tf.constant(np.arange(tokens, 0, -1, dtype=np.float32), name="token_order")     # earlier first
    if dispatch == "dense":
        routed = tf.reduce_sum(tf.one_hot(top, experts, dtype=tf.float32), axis=1)           # (T, E)
        per_expert = tf.unstack(routed * order[:, None], axis=1)
        fraction = tf.reduce_mean(routed, axis=0)
    else:
        chosen = [tf.cast(tf.reduce_any(tf.equal(top, e), axis=1), tf.float32) for e in range(experts)]  # (T,)
        per_expert = [c * order for c in chosen]
        fraction = tf.stack([tf.reduce_mean(c) for c in chosen])
    indices, masks = [], []
    for e in range(experts):
        kept, index = tf.math.top_k(per_expert[e], k=capacity, sorted=True, name=f"dispatch{e}")
        indices.append(index)
        masks.append(tf.cast(kept > 0.0, tf.float32))
    return indices, masks, fraction / top_k


def _gate_weights(gates: tf.Tensor, indices: list[tf.Tensor], masks: list[tf.Tensor], top_k: int,
                  dispatch: str) -> list[tf.Tensor]:
    """Each slot's gate weight (C, 1): the token's gate for that expert, renormalised over its top_k."""
    top_gates, _ = tf.math.top_k(gates, k=top_k)
    total = tf.reduce_sum(top_gates, axis=1, keepdims=True)                                   # (T, 1)
    experts = int(gates.shape[1])
    columns = tf.split(gates / total, experts, axis=1)                                       # E x (T, 1)
    tokens = int(gates.shape[0])
    if dispatch == "dense":
        return [tf.matmul(tf.one_hot(indices[e], tokens) * masks[e][:, None], columns[e]) for e in range(experts)]
    return [tf.gather(columns[e], indices[e]) * masks[e][:, None] for e in range(experts)]


def moe_layer(groups: Sequence[tf.Tensor], experts: int, d_ff: int, top_k: int, capacity: int, name: str,
              seeds: Seeds, devices: Sequence[str | None], dispatch: str) -> tuple[list[tf.Tensor], tf.Tensor]:
    """Route each group's rows (on ``devices[g]``) to the experts' owners and back; returns each group's output
    and the balance loss (on ``devices[0]``)."""
    machines = len(devices)
    d_model = int(groups[0].shape[-1])
    rows_of: list[list[tf.Tensor]] = []      # [group][expert] -> (C, d_model), on the group's machine
    slot_weights: list[list[tf.Tensor]] = []
    indices_of: list[list[tf.Tensor]] = []
    balances = []
    with v1.variable_scope(name, reuse=v1.AUTO_REUSE):
        for g, x in enumerate(groups):
            with tf.device(devices[g]), tf.name_scope(f"group{g}"):
                flat = tf.reshape(x, (-1, d_model))
                gates = tf.nn.softmax(dense(flat, experts, "gate", seeds, bias=False))          # (T, E)
                indices, masks, fraction = _route(gates, experts, top_k, capacity, dispatch)
                slot_weights.append(_gate_weights(gates, indices, masks, top_k, dispatch))
                indices_of.append(indices)
                if dispatch == "dense":
                    selection = tf.reshape(tf.stack([tf.one_hot(i, int(flat.shape[0])) * m[:, None]
                                                     for i, m in zip(indices, masks, strict=True)]),
                                           (experts * capacity, -1), name="dispatch_all")   # (E*C, T)
                    rows = tf.matmul(selection, flat)
                else:
                    rows = tf.gather(flat, tf.concat(indices, 0)) * tf.concat(masks, 0)[:, None]
                rows_of.append(tf.unstack(tf.reshape(rows, (experts, capacity, d_model))))
                balances.append(experts * tf.reduce_sum(fraction * tf.reduce_mean(gates, axis=0)))
        outputs_of: list[list[tf.Tensor]] = [[] for _ in groups]
        for e in range(experts):
            with tf.device(devices[expert_owner(e, experts, machines)]), tf.name_scope(f"expert{e}_rows"):
                stacked = tf.reshape(tf.stack([rows_of[g][e] for g in range(len(groups))]), (-1, d_model))
                out = feed_forward(stacked, d_ff, f"expert{e}", seeds)
                for g, piece in enumerate(tf.unstack(tf.reshape(out, (len(groups), capacity, d_model)))):
                    outputs_of[g].append(piece)
        results = []
        for g, x in enumerate(groups):
            with tf.device(devices[g]), tf.name_scope(f"group{g}_combine"):
                weighted = tf.reshape(tf.stack([o * w for o, w in zip(outputs_of[g], slot_weights[g], strict=True)]),
                                      (experts * capacity, d_model))
                tokens = int(np.prod(x.shape.as_list()[:-1]))
                if dispatch == "dense":
                    selection = tf.reshape(tf.stack([tf.one_hot(i, tokens) for i in indices_of[g]]),
                                           (experts * capacity, tokens))
                    combined = tf.matmul(selection, weighted, transpose_a=True)
                else:
                    combined = tf.math.unsorted_segment_sum(weighted, tf.concat(indices_of[g], 0), tokens)
                results.append(tf.reshape(combined, x.shape))
    with tf.device(devices[0]):
        balance = tf.add_n(balances) / float(len(groups))
    return results, balance


def build(machines: int = 4, experts: int = 8, layers: int = 2, top_k: int = 2, d_model: int = 64,
          d_ff: int = 128, heads: int = 4, seq: int = 32, batch: int = 8, vocab: int = 128,
          capacity_factor: float = 1.25, moe_every: int = 1, balance_weight: float = 0.01,
          dispatch: str = "dense", devices: Sequence[str | None] | None = None, optimizer: str = "adam",
          lr: float = 1e-3, seed: int = 0) -> Built:
    """The model above and one training step, over ``machines`` machines.

    Parameters
    ----------
    machines : groups of the batch and owners of the experts; divides ``batch`` and ``experts``
    experts : experts per MoE layer, at least ``top_k`` and a multiple of ``machines``
    layers, moe_every, top_k, d_model, d_ff, heads, seq, vocab, capacity_factor, balance_weight, optimizer, lr,
        seed : as in ``models.moe_transformer.build``; ``batch`` is the whole step's, split evenly
    dispatch : ``"dense"`` or ``"sparse"`` (module docstring)
    devices : one device string per machine; default the testbed's (``machine_device(m)``);
        ``[None] * machines`` leaves every op unplaced (one device)

    Returns
    -------
    Built
        fetches ``["loss:0", "train_op"]``, feeds ``tokens:0`` and ``targets:0`` (the whole batch, on machine
        0), ``params`` every trainable parameter.

    Raises
    ------
    BadInputError
        For sizes below their minimum, a ``machines`` that does not divide ``batch`` and ``experts``, an
        unknown ``dispatch``, or ``devices`` of another length.

    Examples
    --------
    >>> m = build(machines=2, experts=4, layers=1, d_model=16, d_ff=32, heads=2, seq=8, batch=2, vocab=16)
    >>> m.fetches, m.params
    (['loss:0', 'train_op'], 6224)
    >>> build(machines=3, experts=4)
    Traceback (most recent call last):
    ...
    tfmem.errors.BadInputError: distributed_moe: machines (3) must divide batch (8) and experts (4)
    """
    require("distributed_moe", machines=(machines, 1), experts=(experts, 1), layers=(layers, 1),
            d_model=(d_model, 1), d_ff=(d_ff, 1), heads=(heads, 1), seq=(seq, 2), batch=(batch, 1),
            vocab=(vocab, 2), moe_every=(moe_every, 1), capacity_factor=(capacity_factor, 1e-9),
            balance_weight=(balance_weight, 0.0))
    check_optimizer("distributed_moe", optimizer)
    if batch % machines or experts % machines:
        raise BadInputError(f"distributed_moe: machines ({machines}) must divide batch ({batch}) and experts "
                            f"({experts})")
    if top_k not in (1, 2) or experts < top_k:
        raise BadInputError(f"distributed_moe: top_k must be 1 or 2 and at most experts ({experts}), got {top_k!r}")
    if d_model % heads:
        raise BadInputError(f"distributed_moe: heads ({heads}) must divide d_model ({d_model})")
    if dispatch not in DISPATCHES:
        raise BadInputError(f"distributed_moe: dispatch must be one of {DISPATCHES}, got {dispatch!r}")
    placed = [machine_device(m) for m in range(machines)] if devices is None else list(devices)
    if len(placed) != machines:
        raise BadInputError(f"distributed_moe: devices has {len(placed)} entries for {machines} machines")
    group_batch = batch // machines
    capacity = expert_capacity(group_batch * seq, experts, top_k, capacity_factor)

    def body() -> tuple[list[str], dict[str, np.ndarray]]:
        seeds = Seeds(seed)
        with tf.device(placed[0]):
            tokens = v1.placeholder(tf.int32, (batch, seq), name="tokens")
            targets = v1.placeholder(tf.int32, (batch, seq), name="targets")
            token_groups = tf.split(tokens, machines)
            target_groups = tf.split(targets, machines)
        hs = []
        with v1.variable_scope("model", reuse=v1.AUTO_REUSE):
            for g in range(machines):
                with tf.device(placed[g]), tf.name_scope(f"group{g}"):
                    hs.append(embed(token_groups[g], vocab, d_model, "embed", seeds))
            balances = []
            for i in range(layers):
                with v1.variable_scope(f"layer{i}"):
                    for g in range(machines):
                        with tf.device(placed[g]), tf.name_scope(f"group{g}"):
                            h = layer_norm(hs[g], "ln_att")
                            hs[g] = hs[g] + attention(h, h, heads, "self_att", seeds, causal=True)
                    normed = []
                    for g in range(machines):
                        with tf.device(placed[g]), tf.name_scope(f"group{g}"):
                            normed.append(layer_norm(hs[g], "ln_ffn"))
                    if i % moe_every == 0:
                        outs, balance = moe_layer(normed, experts, d_ff, top_k, capacity, "moe", seeds, placed,
                                                  dispatch)
                        balances.append(balance)
                    else:
                        outs = []
                        for g in range(machines):
                            with tf.device(placed[g]), tf.name_scope(f"group{g}"):
                                outs.append(feed_forward(normed[g], d_ff, "ffn", seeds))
                    for g in range(machines):
                        with tf.device(placed[g]), tf.name_scope(f"group{g}"):
                            hs[g] = hs[g] + outs[g]
            sums = []
            for g in range(machines):
                with tf.device(placed[g]), tf.name_scope(f"group{g}"):
                    logits = dense(layer_norm(hs[g], "ln_final"), vocab, "logits", seeds)
                    sums.append(tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
                        labels=target_groups[g], logits=logits)))
        with tf.device(placed[0]):
            lm = tf.divide(tf.add_n(sums), float(batch * seq), name="loss")
            total = tf.add(lm, balance_weight * tf.add_n(balances), name="total_loss") if balances else lm
            train = OPTIMIZERS[optimizer](lr).minimize(total, colocate_gradients_with_ops=True, name="train_op")
        return ["loss:0", train.name], lm_feeds(seed, batch, seq, vocab)

    return build_graph("distributed_moe", body, seed)
