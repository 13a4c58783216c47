"""pin_reassociation: chains of products and sums round as in the user's graph, whatever passes add around them.

Values are checked in the two-device session of ``tests.helpers`` (``CPU:1`` plays the host); a swap is
emulated the way the passes make one: a host ``Identity`` marked ``_grappler_do_not_remove`` between an op and
its reader.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensorflow.core.framework import attr_value_pb2

from passes import LEADING_REWRITES
from passes.pin_reassociation import PinReassociation
from tests.helpers import DEVICE, HOST, THREADS, placed, session_run, train_steps, v1
from tfmem import load
from tfmem.ir.editor import DO_NOT_REMOVE
from tfmem.ir.graph import GraphIR, OpNode
from tfmem.pipeline import PassContext
from tfmem.sim.grappler import runtime_graph_def


def _softmax_gradient_like():
    """``(d - sum(d * s)) * s * 0.3``, as in attention's backward pass (0.3 is no power of two)."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, (64, 128), name="x")
        d = v1.placeholder(tf.float32, (64, 128), name="d")
        s = tf.nn.softmax(x, name="softmax")
        sub = tf.subtract(d, tf.reduce_sum(d * s, axis=-1, keepdims=True), name="sub")
        inner = tf.multiply(sub, s, name="inner")
        tf.multiply(inner, tf.constant(0.3, name="scale"), name="out")
    rng = np.random.default_rng(0)
    feeds = {"x:0": rng.standard_normal((64, 128), np.float32), "d:0": rng.standard_normal((64, 128), np.float32)}
    return placed(g), feeds


def _swapped(graph: GraphIR, op: str) -> GraphIR:
    """``graph`` with ``op``'s output read by its readers through a host copy, as a swap pass makes one."""
    source = graph[op]
    copy = OpNode(f"{op}/host_copy", "Identity", (source.output(),), (), HOST, source.outputs,
                  MappingProxyType({"T": source.attrs.get("T") or source.attrs["dtype"],   # a folded op: Const
                                    DO_NOT_REMOVE: attr_value_pb2.AttrValue(b=True)}))
    nodes = []
    for node in graph.nodes:
        if source.output() in node.inputs:
            node = dataclasses.replace(node, inputs=tuple(copy.output() if t == source.output() else t
                                                           for t in node.inputs))
        nodes.append(node)
        if node.name == op:
            nodes.append(copy)
    return graph.replace_nodes(tuple(nodes))


def _pinned(graph: GraphIR, fetches) -> GraphIR:
    return PinReassociation().run(graph, PassContext(tuple(fetches), device=DEVICE)).graph


def test_a_swapped_inner_product_rounds_as_in_the_users_graph():
    gd, feeds = _softmax_gradient_like()
    vanilla = session_run(gd, ["out:0"], feeds, init=False)[0]
    runtime = {n.name: [s for s in n.input if not s.startswith("^")] for n in runtime_graph_def(gd, ["out:0"]).node}
    assert runtime["inner"] != ["sub", "softmax"]   # Grappler re-associates: the scale is multiplied in first
    graph = load(gd)
    # The premise: a swap of the inner product keeps it out of Grappler's chain, and the chain rounds otherwise.
    unpinned = session_run(_swapped(graph, "inner").to_graph_def(), ["out:0"], feeds, init=False)[0]
    assert not np.array_equal(vanilla, unpinned)
    pinned = _pinned(graph, ["out:0"])
    assert pinned["inner"].attr_bool(DO_NOT_REMOVE) and pinned["out"].attr_bool(DO_NOT_REMOVE)
    for swapped_op in ("inner", "sub", "softmax"):
        after = session_run(_swapped(pinned, swapped_op).to_graph_def(), ["out:0"], feeds, init=False)[0]
        assert np.array_equal(vanilla, after), swapped_op


def test_it_runs_first_among_the_exact_rewrites_that_read_grappler_after_split_addn():
    names = [p.name for p in LEADING_REWRITES]
    assert names.index("pin_fusions") < names.index("split_addn") < names.index("pin_reassociation")


def test_a_graph_without_float_products_is_left_alone():
    g = tf.Graph()
    with g.as_default():
        a = v1.placeholder(tf.int32, (4,), name="a")
        tf.multiply(a * 3, a, name="out")
    graph = load(placed(g))
    result = PinReassociation().run(graph, PassContext(("out:0",), device=DEVICE))
    assert not result.changed and "no float" in result.report.notes[0]


SHAPES = ((), (1,), (32,), (16, 32))
OPS = ("Mul", "AddV2")


@st.composite
def chains(draw):
    """A random tree of float ``Mul``/``AddV2`` ops over placeholders and constants of broadcastable shapes."""
    leaves = draw(st.lists(st.sampled_from(SHAPES), min_size=3, max_size=7))
    constants = draw(st.lists(st.sampled_from([0.3, 1.7, -2.9, 0.11]), max_size=2))
    merges = [(draw(st.integers(0, 10**6)), draw(st.sampled_from(OPS)))
              for _ in range(len(leaves) + len(constants) - 1)]
    swaps = draw(st.lists(st.integers(0, 10**6), min_size=1, max_size=3))
    return leaves, constants, merges, swaps


def _build_chain(leaves, constants, merges):
    g = tf.Graph()
    rng = np.random.default_rng(len(leaves))
    feeds = {}
    with g.as_default():
        terms = []
        for i, shape in enumerate(leaves):
            terms.append(v1.placeholder(tf.float32, shape, name=f"p{i}"))
            feeds[f"p{i}:0"] = rng.standard_normal(shape).astype(np.float32)
        terms += [tf.constant(c, tf.float32, name=f"c{i}") for i, c in enumerate(constants)]
        ops = []
        for k, (pick, op) in enumerate(merges):
            a = terms.pop(pick % len(terms))
            b = terms.pop(pick // 7 % len(terms))
            t = tf.multiply(a, b, name=f"m{k}") if op == "Mul" else tf.add(a, b, name=f"a{k}")
            terms.append(t)
            ops.append(t.op.name)
        tf.identity(terms[0], name="out")
    return placed(g), feeds, ops


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_random_chains_keep_their_values_whatever_is_swapped(chain):
    leaves, constants, merges, swaps = chain
    gd, feeds, ops = _build_chain(leaves, constants, merges)
    vanilla = session_run(gd, ["out:0"], feeds, init=False)[0]
    graph = _pinned(load(gd), ["out:0"])
    for pick in swaps:
        op = ops[pick % len(ops)]
        if f"{op}/host_copy" not in graph:
            graph = _swapped(graph, op)
    after = session_run(graph.to_graph_def(), ["out:0"], feeds, init=False)[0]
    assert np.array_equal(vanilla, after)


@pytest.mark.slow
def test_an_moe_transformer_with_swapped_activations_trains_as_vanilla():
    """Measured without this pass: the second step's loss differed from vanilla's in its last bit (the attention
    softmax's gradient chain, scaled by 1/sqrt(24), was rebuilt in another order around a swap)."""
    import tfmem
    from models import moe_transformer

    built = moe_transformer.build(experts=8, layers=2, d_model=96, heads=4, d_ff=192, seq=64, batch=8)
    written = placed(built.graph)
    peak = tfmem.simulate(written, built.fetches, feed_shapes=built.feed_shapes, device=DEVICE, host=HOST,
                          inter_op_threads=THREADS).peak_bytes
    opt = tfmem.optimize(written, built.fetches, budget=int(peak * 0.8), feed_shapes=built.feed_shapes,
                         device=DEVICE, host=HOST, passes=["swap_activations"], inter_op_threads=THREADS)
    assert any(r.name == "pin_reassociation" and r.details.get("rewired") for r in opt.report.passes)
    assert (train_steps(opt.graph_def, built.fetches, built.feeds, opt.config)
            == train_steps(written, built.fetches, built.feeds))
