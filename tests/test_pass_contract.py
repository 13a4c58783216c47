"""The contract every registered pass keeps, checked on small real graphs for each pass in ``passes.PASSES``.

Each pass gets a graph ``optimize`` would give it: a final rewrite (``fence_transfers``) the output of the single
strategies applied in turn (``STRATEGIES_IN_TURN``, as the budget search chains them: their copies to host are
not fenced yet), another pass of
``DEFAULT_PASSES`` the output of the passes before it there, any other pass the output of ``LEADING_REWRITES``;
all at a target below the simulated peak after ``LEADING_REWRITES``, with a device and a host. Its output must

(a) pass ``tfmem.ir.verify.verify``;
(b) fetch the same values, bit for bit, as the user's graph (two training steps in the two-device session);
(c) simulate no higher than its input where the pass declares ``peak_non_increasing``;
(d) be a fixed point: the pass run again on its output changes nothing (as Grappler's idempotence test asks of
    its optimizers);

and a ``budget_independent`` pass must do the same at another target. A new pass in ``PASSES`` is covered
without editing this file; the last tests show the check fails for passes that break (b), (c), (d) or budget
independence.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, node_def_pb2

import tfmem
from passes import DEFAULT_PASSES, FINAL_REWRITES, PASSES
from tests.helpers import DEVICE, HOST, THREADS, as_optimize_plans, placed, two_device_config, v1
from tfmem import examples
from tfmem.ir.editor import DO_NOT_REMOVE
from tfmem.ir.graph import GraphIR
from tfmem.ir.verify import verify
from tfmem.pipeline import Pass, PassContext, PassReport, PassResult, run_pipeline
from tfmem.search import MIXED_AFTER
from tfmem.testbed import initializer_names

STEPS = 2          # training steps compared: the second one's loss reads every update of the first
FRACTION = 0.8     # the target, as a share of the graph's simulated peak: memory passes have work to do

# Small graphs with what the passes act on; each simulates in well under a second.
GRAPHS: dict[str, Callable[[], examples.Built]] = {
    # fusable MatMul + BiasAdd, Adam's zero slots sharing one initial value
    "mlp_adam": lambda: examples.mlp(batch=1024, dims=(128, 512, 512, 10), optimizer="adam"),
    # a large AddN (the recurrent weight's 6 partial gradients), per-step loss constants Grappler would merge
    "rnn": lambda: examples.unrolled_rnn(steps=6, batch=64, hidden=128, inputs=64),
    # convolutions and their gradients (scratch buffers), a residual sum
    "convnet": lambda: examples.residual_convnet(batch=8, size=16, channels=16, blocks=1),
    # weights idle most of the step (host placement), a sum over experts
    "moe": lambda: examples.moe_layer(experts=4, batch=128, d_model=64, d_ff=128, optimizer="momentum"),
}

# (pass, graph) -> why it fails, for a pass that cannot keep its contract yet: each is expected to fail
# (strict), so a fix shows up as XPASS. None today.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


@dataclasses.dataclass(frozen=True)
class Case:
    """One graph, ready for the passes: the context (target, devices), the values the user's graph fetches, and
    the graph each pass gets."""

    built: examples.Built
    ctx: PassContext
    vanilla: list[Any]
    inputs: dict[str, GraphIR]   # pass name -> the graph optimize would give it

    def input_for(self, p: Pass) -> GraphIR:
        return self.inputs.get(p.name, self.inputs[""])


def fetched(graph_def: Any, built: examples.Built) -> list[Any]:
    """Every fetched tensor's value in each of ``STEPS`` training steps from freshly initialised variables."""
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    tensors = [f for f in built.fetches if ":" in f]
    ops = [f for f in built.fetches if ":" not in f]
    with v1.Session(graph=g, config=two_device_config()) as sess:
        sess.run(initializer_names(graph_def))
        return [sess.run(tensors + ops, built.feeds)[: len(tensors)] for _ in range(STEPS)]


@functools.cache
def case(name: str) -> Case:
    built = GRAPHS[name]()
    gd = placed(built.graph)
    written = tfmem.load(gd, built.feed_shapes)
    roomy = PassContext(tuple(built.fetches), None, DEVICE, HOST, dict(built.feed_shapes or {}),
                        inter_op_threads=THREADS)
    # The target is below the peak of what the passes after LEADING_REWRITES get (serialize_scratch alone halves
    # the convnet's), so each memory pass has something to do.
    leading = as_optimize_plans(written, roomy)
    ctx = dataclasses.replace(roomy, target_bytes=int(roomy.simulate(leading).peak_bytes * FRACTION))
    # Each pass of DEFAULT_PASSES gets what the passes before it made; any other, what LEADING_REWRITES made.
    inputs: dict[str, GraphIR] = {"": leading}
    graph = written
    for p in DEFAULT_PASSES:
        inputs[p.name] = graph
        graph = p.run(graph, ctx).graph
    # The planner fences the copies of the plans it makes; the strategies applied in turn (one of the budget
    # search's attempts, tfmem.search.MIXED_AFTER) leave theirs to the final rewrites.
    alternative = run_pipeline(leading, [PASSES[n] for n in STRATEGIES_IN_TURN], ctx)[0]
    inputs.update({p.name: alternative for p in FINAL_REWRITES})
    return Case(built, ctx, fetched(gd, built), inputs)


STRATEGIES_IN_TURN = ("place_persistent", *MIXED_AFTER["place_persistent"])


def check_contract(p: Pass, c: Case) -> dict[str, Any]:
    """Assert (a)-(d) and budget independence for pass ``p`` on case ``c``; returns what was measured."""
    ctx, given = c.ctx, c.input_for(p)
    result = p.run(given, ctx)
    out = result.graph
    verify(out)                                                                          # (a)
    out_def, given_def = out.to_graph_def(), given.to_graph_def()
    if out_def != given_def:                                                             # (b)
        after = fetched(out_def, c.built)
        equal = [np.array_equal(a, b) for step_a, step_b in zip(c.vanilla, after, strict=True)
                 for a, b in zip(step_a, step_b, strict=True)]
        assert all(equal), f"{p.name}: fetched values differ from the user's graph (per step and fetch: {equal})"
    peak_in, peak_out = ctx.simulate(given).peak_bytes, ctx.simulate(out).peak_bytes
    if type(p).peak_non_increasing:                                                      # (c)
        assert peak_out <= peak_in, f"{p.name}: simulated peak rose from {peak_in} to {peak_out} bytes"
    again = p.run(out, ctx)                                                              # (d)
    fixed_point = not again.changed or again.graph.to_graph_def() == out_def
    assert fixed_point, (
        f"{p.name} is not idempotent: run again on its own output it changed it ({again.report.notes})")
    if type(p).budget_independent:
        for target in (None, ctx.target_bytes // 2):
            other = p.run(given, dataclasses.replace(ctx, target_bytes=target))
            same = other.changed == result.changed and other.graph.to_graph_def() == out_def
            assert same, (
                f"{p.name} is declared budget_independent but its output differs at target {target}")
    return {"changed": result.changed, "peak_in": peak_in, "peak_out": peak_out}


def _params() -> list[Any]:
    out = []
    for pass_name in sorted(PASSES):
        for graph in GRAPHS:
            reason = KNOWN_FAILURES.get((pass_name, graph))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            out.append(pytest.param(pass_name, graph, marks=marks, id=f"{pass_name}-{graph}"))
    return out


@pytest.mark.parametrize(("pass_name", "graph"), _params())
def test_pass_keeps_its_contract(pass_name: str, graph: str) -> None:
    check_contract(PASSES[pass_name], case(graph))


def test_every_pass_declares_its_properties() -> None:
    for p in PASSES.values():
        assert isinstance(type(p).budget_independent, bool), p.name
        assert isinstance(type(p).peak_non_increasing, bool), p.name


# --- the check can fail: passes broken on purpose ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Broken:
    """A pass that edits the graph's GraphDef in place with ``edit(graph_def, ctx)``, which says if it changed it."""

    edit: Callable[[Any, PassContext], bool]
    name: ClassVar[str] = "broken"
    budget_independent: ClassVar[bool] = True
    peak_non_increasing: ClassVar[bool] = True

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        gd = graph.to_graph_def()
        if not self.edit(gd, ctx):
            return PassResult(graph, False, PassReport.empty(self.name))
        return PassResult(tfmem.load(gd, ctx.feed_shapes), True, PassReport(self.name, changed=True))


def _doubled_learning_rate(gd: Any, ctx: PassContext) -> bool:
    """Doubles the optimizer's learning rate: the first step's loss stays, the second's changes."""
    rates = [n for n in gd.node if n.op == "Const" and n.name.endswith("learning_rate")]
    for n in rates:
        n.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(2 * tf.make_ndarray(n.attr["value"].tensor)))
    return bool(rates)


def _one_more_noop(gd: Any, ctx: PassContext) -> bool:
    """Adds another ``NoOp`` on every run: harmless, but never a fixed point."""
    noops = sum(n.name.startswith("broken_noop") for n in gd.node)
    gd.node.add(name=f"broken_noop{noops}", op="NoOp", device=DEVICE)
    return True


def _a_large_tile(gd: Any, ctx: PassContext) -> bool:
    """Makes the fetched loss wait for tiles of the fed ``x`` (of an MLP) twice the target's size, which is more
    than the graph's whole peak (from a fed input and marked to keep, so Grappler neither folds nor prunes it)."""
    if any(n.name == "broken_tile" for n in gd.node):
        return False
    x = next(n for n in gd.node if n.name == "x")
    x_bytes = int(np.prod([d.size for d in x.attr["shape"].shape.dim])) * 4
    multiples = tf.make_tensor_proto(np.array([2 * (ctx.target_bytes or 0) // x_bytes + 1, 1], np.int32))
    gd.node.append(node_def_pb2.NodeDef(name="broken_tile/multiples", op="Const", device=DEVICE, attr={
        "dtype": attr_value_pb2.AttrValue(type=multiples.dtype), "value": attr_value_pb2.AttrValue(tensor=multiples)}))
    gd.node.append(node_def_pb2.NodeDef(name="broken_tile", op="Tile", device=DEVICE,
                                        input=["x", "broken_tile/multiples"],
                                        attr={"T": attr_value_pb2.AttrValue(type=x.attr["dtype"].type),
                                              "Tmultiples": attr_value_pb2.AttrValue(type=multiples.dtype),
                                              DO_NOT_REMOVE: attr_value_pb2.AttrValue(b=True)}))
    next(n for n in gd.node if n.name == "loss").input.append("^broken_tile")
    return True


def _depends_on_the_target(gd: Any, ctx: PassContext) -> bool:
    """Adds a ``NoOp`` only when there is a target: budget-dependent while declared independent."""
    if ctx.target_bytes is None or any(n.name == "broken_noop" for n in gd.node):
        return False
    gd.node.add(name="broken_noop", op="NoOp", device=DEVICE)
    return True


@pytest.mark.parametrize(("edit", "message"), [
    (_doubled_learning_rate, "fetched values differ"),
    (_one_more_noop, "not idempotent"),
    (_a_large_tile, "simulated peak rose"),
    (_depends_on_the_target, "budget_independent"),
], ids=["changes-a-value", "not-idempotent", "raises-the-peak", "depends-on-the-target"])
def test_the_contract_fails_for_a_broken_pass(edit: Callable[[Any, PassContext], bool], message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_contract(_Broken(edit), case("mlp_adam"))
