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
