"""pin_fusions: after any pass list, the session fuses the same kernels as for the user's graph."""

from __future__ import annotations

import pytest

import tfmem
from models import transformer
from tfmem.ir.devices import with_default_device
from tfmem.sim.grappler import runtime_graph_def
from tfmem.testbed import DEVICE, HOST


def _runtime_ops(graph_def, fetches):
    return {n.name: n.op for n in runtime_graph_def(graph_def, fetches).node}


@pytest.mark.slow
def test_moving_passes_keep_grappler_s_fusions():
    built = transformer.build(layers=1, d_model=128, d_ff=512, seq=64, batch=32)
    vanilla = _runtime_ops(with_default_device(built.graph.as_graph_def(), DEVICE), built.fetches)
    fused = {name for name, op in vanilla.items() if op.startswith("_Fused")}
    assert fused, "the remapper fuses the attention projections' MatMul + BiasAdd"
    peak = tfmem.simulate(built.graph, built.fetches, feed_shapes=built.feed_shapes, device=DEVICE,
                          host=HOST).peak_bytes
    opt = tfmem.optimize(built.graph, built.fetches, budget=int(peak * 0.7), feed_shapes=built.feed_shapes,
                         device=DEVICE, host=HOST,
                         passes=["partition", "limit_parallelism", "place_persistent", "swap_activations"])
    assert [r.name for r in opt.report.passes][:2] == ["pin_fusions", "split_addn"]
    after = _runtime_ops(opt.graph_def, built.fetches)
    assert {name: after.get(name) for name in fused} == {name: vanilla[name] for name in fused}



def test_a_residual_add_fusion_is_left_to_the_session(monkeypatch):
    # The remapper's _FusedConv2D [BiasAdd, Add] (oneDNN's kernel, made of TF-Slim ResNet-v2's conv + bias +
    # shortcut) is not pinned: the plain CPU kernel refuses it (the slow test below ran it); [BiasAdd] is.
    import tensorflow as tf
    from tensorflow.core.framework import node_def_pb2

    import passes.pin_fusions as pin
    from tfmem.ir.shapes import annotate
    from tfmem.pipeline import PassContext

    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (2, 8, 8, 4), name="x")
        w, b = tf.ones((1, 1, 4, 4)), tf.ones((4,))
        conv = tf.nn.conv2d(x, w, 1, "SAME", name="conv")
        biased = tf.nn.bias_add(conv, b, name="biased")
        tf.add(biased, x, name="out")
    ir = annotate(with_default_device(g.as_graph_def(), DEVICE))

    def fused(name, data_inputs, ops):
        node = node_def_pb2.NodeDef(name=name, op="_FusedConv2D", input=data_inputs, device=DEVICE)
        node.attr["fused_ops"].list.s.extend(op.encode() for op in ops)
        return node

    runtime = [fused("out", ["x", w.op.name, b.op.name, "x"], ["BiasAdd", "Add"]),
               fused("biased", ["x", w.op.name, b.op.name], ["BiasAdd"])]
    monkeypatch.setattr(pin, "runtime_nodes", lambda *args, **kwargs: runtime)
    result = pin.PinFusions().run(ir, PassContext(("out:0",), None, DEVICE, HOST))
    assert result.graph["out"].op == "AddV2" and result.graph["biased"].op == "_FusedConv2D"


@pytest.mark.slow
def test_a_pinned_slim_resnet_v2_runs_on_the_testbed():
    import tensorflow as tf

    from models import zoo
    from passes.pin_fusions import PinFusions
    from tfmem.ir.shapes import annotate
    from tfmem.pipeline import PassContext
    from tfmem.testbed import Testbed

    if not zoo.available():
        pytest.skip("tf_slim is not installed (make installs it)")
    built = zoo.catalog()["slim/resnet_v2_50"].build()
    graph_def = with_default_device(built.graph.as_graph_def(), DEVICE)
    result = PinFusions().run(annotate(graph_def), PassContext(tuple(built.fetches), None, DEVICE, HOST))
    assert result.changed
    pinned = tf.Graph()
    with pinned.as_default():
        tf.graph_util.import_graph_def(result.graph.to_graph_def(), name="")
    with Testbed(2**30) as tb:
        assert tb.run(pinned, list(built.fetches), built.feeds, steps=1).ran
