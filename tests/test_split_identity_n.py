"""split_identity_n: an IdentityN's tensors flow on one by one, with the same values (passes/split_identity_n.py)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from passes.split_identity_n import SplitIdentityN
from tests.helpers import train_steps, v1
from tfmem.ir.loading import load
from tfmem.ir.verify import verify
from tfmem.optimizer import lower_bound_bytes
from tfmem.pipeline import PassContext

MiB = 2**20


def _updates_through_identity_n(layers: int = 6, control_reader: bool = False) -> tuple[tf.Graph, list[str]]:
    """A chain of ``layers`` 512x512 matmuls whose weight gradients all pass one IdentityN before their updates
    (as Keras 3's optimizers pass them); ``control_reader``: an op also waits for the IdentityN."""
    g = tf.Graph()
    with g.as_default():
        rng = np.random.default_rng(0)
        x = v1.placeholder(tf.float32, (512, 512), name="x")
        ws = [v1.get_variable(f"w{i}", initializer=rng.standard_normal((512, 512)).astype(np.float32) / 32,
                              use_resource=True) for i in range(layers)]
        hs = [x]
        for w in ws:
            hs.append(tf.tanh(tf.matmul(hs[-1], w)))
        loss = tf.reduce_sum(hs[-1], name="loss")
        grads = tf.gradients(loss, ws)
        passed = tf.identity_n(grads, name="barrier")
        updates = [w.assign_sub(0.01 * gr) for w, gr in zip(ws, passed, strict=True)]
        if control_reader:
            with tf.control_dependencies([passed[0].op]):
                updates.append(tf.no_op(name="after_barrier"))
        tf.group(*updates, name="train")
    return g, ["loss:0", "train"]


def test_each_tensor_flows_on_alone_with_the_same_values() -> None:
    g, fetches = _updates_through_identity_n()
    ir = load(g, {"x:0": (512, 512)})
    ctx = PassContext(tuple(fetches), feed_shapes={"x:0": (512, 512)})
    result = SplitIdentityN().run(ir, ctx)
    assert result.changed and "barrier" not in result.graph
    assert [n.op for n in result.graph.nodes if n.name.startswith("barrier/")] == ["Identity"] * 6
    verify(result.graph)
    # The barrier made all six 1 MiB gradients one op's working set, the lower bound of any plan.
    before, op = lower_bound_bytes(ir, ctx)
    after, _ = lower_bound_bytes(result.graph, ctx)
    assert op == "barrier" and before >= 6 * MiB > after
    x = np.random.default_rng(1).standard_normal((512, 512)).astype(np.float32)
    # three steps: each step's loss reads the weights the step before updated through the split gradients
    got = train_steps(result.graph.to_graph_def(), fetches, {"x:0": x})
    want = train_steps(g.as_graph_def(), fetches, {"x:0": x})
    assert len(set(map(float, want))) == 3 and all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_barrier_smaller_than_another_ops_working_set_is_kept() -> None:
    # two 1 MiB gradients: a 512x512 matmul (two inputs and its output, 3 MiB) bounds the plan, not the barrier
    g, fetches = _updates_through_identity_n(layers=2)
    ctx = PassContext(tuple(fetches), feed_shapes={"x:0": (512, 512)})
    result = SplitIdentityN().run(load(g, {"x:0": (512, 512)}), ctx)
    assert not result.changed and "bounds the plan" in result.report.notes[0]


def test_a_barrier_others_wait_for_or_fetch_is_kept() -> None:
    g, fetches = _updates_through_identity_n(control_reader=True)
    ctx = PassContext(tuple(fetches), feed_shapes={"x:0": (512, 512)})
    assert not SplitIdentityN().run(load(g, {"x:0": (512, 512)}), ctx).changed
    g, fetches = _updates_through_identity_n()
    ctx = PassContext((*fetches, "barrier:0"), feed_shapes={"x:0": (512, 512)})
    assert not SplitIdentityN().run(load(g, {"x:0": (512, 512)}), ctx).changed
