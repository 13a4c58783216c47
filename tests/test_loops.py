"""Loops and the graphs whose shapes come from shape-computing subgraphs: ``optimize`` plans them (issue 39).

TF1 while loops (v1 frames: ``Enter``/``Exit``/``Merge``/``Switch``/``NextIteration``) are cycles; every pass
leaves a frame's ops as they are and plans around it. A TF2 ``While`` with a gradient, op determinism and
``tf.debugging.assert_*`` build tensors whose shapes only constant evaluation of a shape subgraph reveals.
Each case is optimized with no budget and, where the graph is large enough, with one that needs a rewrite (0.6x
the simulated peak, with a host to swap to), and trained for three steps next to the original: the fetched
values must be identical.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import networkx as nx
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

import tfmem
from passes.fence_transfers import FenceTransfers
from passes.limit_parallelism import _exits
from passes.place_persistent import TO_HOST_TAG, PersistentGroup, chain_to_host
from passes.timeline import StepTimeline
from tests.helpers import DEVICE, HOST, THREADS, placed, session_run, train_steps, values_equal
from tfmem import cli, examples
from tfmem.errors import MalformedGraphError
from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.frames import find_regions, may_be_dead, maybe_dead, topological_order, whole_frame_preds
from tfmem.ir.graph import GraphIR, OpNode, TensorRef, TensorSpec
from tfmem.ir.shapes import annotate
from tfmem.ir.verify import verify
from tfmem.pipeline import PassContext

v1 = tf.compat.v1
BATCH, WIDTH, LAYERS, STEPS, LOOP_WIDTH = 512, 512, 8, 4, 64
FETCHES = ["loss:0", "train"]


def _layers(x: tf.Tensor) -> tf.Tensor:
    """Dense layers before the loop: the activations a plan can swap (the loop itself is left whole)."""
    h = x
    for i in range(LAYERS):
        w = v1.get_variable(f"dense{i}/w", (WIDTH, WIDTH), initializer=v1.glorot_uniform_initializer(seed=i))
        h = tf.nn.relu(tf.matmul(h, w))
    return tf.matmul(h, v1.get_variable("proj", (WIDTH, LOOP_WIDTH),
                                        initializer=v1.glorot_uniform_initializer(seed=99)))


def loop_graph(v2: bool = False, optimizer: bool = True) -> tf.Graph:
    """Dense layers, a while loop of ``tanh(h @ w)`` over their output, a loss and a training op.

    ``v2``: a functional ``While`` (TF2's default) instead of a v1 frame; ``optimizer``: train with an
    optimizer's ``minimize``, else with ``tf.gradients`` and explicit updates.
    """
    g = tf.Graph()
    with g.as_default():
        if not v2:
            v1.disable_control_flow_v2()
        try:
            x = v1.placeholder(tf.float32, (BATCH, WIDTH), name="x")
            h = _layers(x)
            w = v1.get_variable("loop_w", (LOOP_WIDTH, LOOP_WIDTH), initializer=v1.glorot_uniform_initializer(seed=7))
            _, h = v1.while_loop(lambda i, h: i < STEPS, lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w))),
                                 [tf.constant(0), h], name="loop")
            loss = tf.reduce_mean(tf.square(h), name="loss")
            if optimizer:
                v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
            else:
                variables = v1.trainable_variables()
                grads = tf.gradients(loss, variables)
                tf.group(*[v.assign_sub(0.1 * gr) for v, gr in zip(variables, grads, strict=True)], name="train")
        finally:
            v1.enable_control_flow_v2()
    return g


def _feeds() -> dict[str, np.ndarray]:
    return {"x:0": np.random.default_rng(0).standard_normal((BATCH, WIDTH), dtype=np.float32)}


def _optimize(graph: tf.Graph, budget_share: float | None, fetches: list[str] = FETCHES,
              **kwargs: object) -> tfmem.Optimized:
    source = placed(graph)
    budget = None
    if budget_share is not None:
        peak = tfmem.simulate(source, fetches, device=DEVICE, host=HOST, inter_op_threads=THREADS, **kwargs)
        budget = int(peak.peak_bytes * budget_share)
    return tfmem.optimize(source, fetches, budget=budget, device=DEVICE, host=HOST, inter_op_threads=THREADS,
                          **kwargs)


def _assert_same_training(graph: tf.Graph, opt: tfmem.Optimized, feeds: dict[str, np.ndarray],
                          fetches: list[str] = FETCHES) -> None:
    assert values_equal(train_steps(graph, fetches, feeds), train_steps(opt.graph, fetches, feeds, opt.config))


# -- TF1 while loops ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def v1_loop() -> tf.Graph:
    return loop_graph()


@pytest.mark.parametrize("budget_share", [None, 0.6])
def test_v1_loop_with_gradient_is_planned_around_and_trains_identically(v1_loop, budget_share):
    opt = _optimize(v1_loop, budget_share)
    _assert_same_training(v1_loop, opt, _feeds())
    verify(opt.ir)
    # every op of both loops (forward and gradient) is exactly as the user built it
    original = GraphIR.from_graph_def(placed(v1_loop))
    frames = find_regions(original)
    assert set(frames.values()) == {"loop/while_context", "gradients/loop/while_context"}
    after = {n.name: n for n in opt.graph_def.node}
    for name in frames:
        assert after[name] == original[name].to_node_def(), name
    partition = next(r for r in opt.report.passes if r.name == "partition")
    assert partition.details["frames"] == ["gradients/loop/while_context", "loop/while_context"]
    assert "2 v1 loop frame(s) kept whole" in opt.report.to_markdown()
    if budget_share is not None:   # the budget needed a rewrite, and it is met outside the loops
        assert opt.report.after.peak_bytes < 0.6 * opt.report.before.peak_bytes
        assert any(r.changed for r in opt.report.passes if r.name == "planner")


def test_exit_belongs_to_its_frame_and_units_sort_topologically(v1_loop):
    ir = annotate(v1_loop.as_graph_def())
    frames = find_regions(ir)
    exits = [n.name for n in ir.nodes if n.op == "Exit"]
    assert exits and all(e in frames for e in exits)
    assert "loss" not in frames and "train" not in frames   # readers of an Exit are outside again
    eg = ExecutionGraph.build(ir, FETCHES)
    order = eg.topological_units
    position = {u: i for i, u in enumerate(order)}
    assert sorted(order) == sorted(eg.units)
    assert all(position[p] < position[u] for u in order for p in eg.unit_preds[u])
    # the gradient's stacks come after the forward frame in GraphDef order, but run before it
    stack = next(u for u in eg.units if ir[eg.members[u][0]].op == "StackV2")
    assert eg.units.index(stack) > eg.units.index("frame:loop/while_context")
    assert position[stack] < position["frame:loop/while_context"]


class _TanhCell:
    """The least ``dynamic_rnn`` takes as a cell (Keras 3 ships no TF1 cells): ``h' = tanh([x, h] @ w)``."""

    def __init__(self, units: int) -> None:
        self.units = units
        self.w: tf.Variable | None = None

    @property
    def state_size(self) -> int:
        return self.units

    @property
    def output_size(self) -> int:
        return self.units

    def zero_state(self, batch: int, dtype: tf.DType) -> tf.Tensor:
        return tf.zeros((batch, self.units), dtype)

    def __call__(self, x: tf.Tensor, h: tf.Tensor, scope: object = None) -> tuple[tf.Tensor, tf.Tensor]:
        if self.w is None:
            self.w = v1.get_variable("cell/w", (int(x.shape[-1]) + self.units, self.units),
                                     initializer=v1.glorot_uniform_initializer(seed=3))
        out = tf.tanh(tf.matmul(tf.concat([x, h], 1), self.w))
        return out, out


def test_dynamic_rnn_trains_identically():
    g = tf.Graph()
    with g.as_default():
        v1.disable_control_flow_v2()
        try:
            x = v1.placeholder(tf.float32, (4, 8, 16), name="x")
            out, _ = v1.nn.dynamic_rnn(_TanhCell(16), x, dtype=tf.float32)
            loss = tf.reduce_mean(tf.square(out), name="loss")
            v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        finally:
            v1.enable_control_flow_v2()
    feeds = {"x:0": np.random.default_rng(0).standard_normal((4, 8, 16), dtype=np.float32)}
    for budget in (None, "64MiB"):  # too small a graph to need a rewrite: the budget path runs all the same
        opt = tfmem.optimize(placed(g), FETCHES, budget=budget, device=DEVICE, host=HOST, inter_op_threads=THREADS)
        _assert_same_training(g, opt, feeds)
        if budget is None:
            partition = next(r for r in opt.report.passes if r.name == "partition")
            assert partition.details["frames"] == ["gradients/rnn/while/while_context", "rnn/while/while_context"]


def test_cli_optimizes_a_v1_loop_graph(v1_loop, tmp_path, capsys):
    tf.io.write_graph(v1_loop, str(tmp_path), "loop.pb", as_text=False)
    out = tmp_path / "opt.pb"
    code = cli.main(["optimize", str(tmp_path / "loop.pb"), "-o", str(out), "--fetch", "loss:0", "--fetch", "train"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    gd = v1.GraphDef()
    gd.ParseFromString(out.read_bytes())
    assert {"loop/Exit_1", "loop/NextIteration_1", "loss", "train"} <= {n.name for n in gd.node}
    assert "v1 loop frame(s) kept whole" in stdout


# -- TF2 While with a gradient --------------------------------------------------------------------------------


@pytest.mark.parametrize(("optimizer", "budget_share"),
                         [(True, None), pytest.param(True, 0.6, marks=pytest.mark.slow), (False, None)],
                         ids=["minimize", "minimize-budget", "tf.gradients"])
def test_v2_while_with_gradient_trains_identically(optimizer, budget_share):
    g = loop_graph(v2=True, optimizer=optimizer)
    assert any(op.type == "While" for op in g.get_operations())
    opt = _optimize(g, budget_share)
    _assert_same_training(g, opt, _feeds())
    if budget_share is not None:
        assert opt.report.after.peak_bytes < 0.6 * opt.report.before.peak_bytes


def test_variable_shape_through_a_while_is_known():
    """``zeros(VariableShape(h))`` of a handle ``h`` that a ``While`` carries: the ``While``'s output shapes drop
    the handle's shape, which the variable declares."""
    ir = annotate(loop_graph(v2=True).as_graph_def())
    shape_ops = [n for n in ir.nodes if n.op == "VariableShape"]
    assert shape_ops and all(n.outputs[0].shape == (2,) for n in shape_ops)
    fills = [n for n in ir.nodes if n.op == "Fill" and n.inputs[0].node in {s.name for s in shape_ops}]
    assert fills and all(n.outputs[0].shape == (LOOP_WIDTH, LOOP_WIDTH) for n in fills)


def test_shape_arithmetic_on_a_handle_carried_by_a_while_is_evaluated(monkeypatch):
    """...with numpy: a session per op cost milliseconds each."""
    g = tf.Graph()
    with g.as_default():
        v = v1.get_variable("v", (64, 8), use_resource=True)
        _, handle = tf.while_loop(lambda i, h: i < 2, lambda i, h: (i + 1, h), [tf.constant(0), v.handle])
        shape = tf.raw_ops.VariableShape(input=handle)
        tf.zeros(tf.concat([shape[:1], [3]], 0), name="z")  # StridedSlice and ConcatV2 of the variable's shape
    imported = tf.Graph()
    with imported.as_default():  # imported, the While's output shapes drop the handle's shape
        tf.graph_util.import_graph_def(g.as_graph_def(), name="")
    assert not imported.get_tensor_by_name("z:0").shape.is_fully_defined()
    monkeypatch.setattr(v1, "Session", None)
    assert annotate(g.as_graph_def()).spec("z:0").shape == (64, 3)


# -- op determinism and assertions ----------------------------------------------------------------------------


@contextlib.contextmanager
def op_determinism() -> Iterator[None]:
    """Op determinism on within the block: the switch is process-wide, and TF has no public one back."""
    was = tf_config.is_op_determinism_enabled()
    tf.config.experimental.enable_op_determinism()
    try:
        yield
    finally:
        if not was:
            tf_config.disable_op_determinism()


def _plan(opt: tfmem.Optimized) -> tuple[object, ...]:
    """What a plan decided: which passes changed the graph, the limit on parallelism, each tensor moved, and
    the peaks before and after."""
    passes = tuple((r.name, r.changed, r.details.get("k")) for r in opt.report.passes)
    moves = tuple(sorted((str(d["kind"]), str(d["tensor"]), int(d["bytes"]))
                         for r in opt.report.passes for d in r.details.get("decisions", ())))
    return passes, moves, opt.report.before.peak_bytes, opt.report.after.peak_bytes


def test_mlp_under_op_determinism_has_known_shapes_and_plans_as_without():
    with op_determinism():
        built = examples.mlp()
        # the loss is a gather and a dense softmax, whose gradient's shapes come from shape arithmetic
        assert any("GatherV2_grad/strided_slice" in op.name for op in built.graph.get_operations())
        ir = annotate(built.graph.as_graph_def())
        assert all(s.known for n in ir.nodes for s in n.outputs)
        opt = _optimize(built.graph, None, built.fetches)
        _assert_same_training(built.graph, opt, built.feeds, built.fetches)
    assert not tf_config.is_op_determinism_enabled()
    plain = examples.mlp()
    without = _optimize(plain.graph, None, plain.fetches)
    assert _plan(opt)[:2] == _plan(without)[:2]
    assert abs(opt.report.after.peak_bytes - without.report.after.peak_bytes) < 64 * 1024  # a few small tensors


def test_mlp_under_op_determinism_meets_a_budget_as_without():
    """Determinism builds another loss subgraph, so a plan may move other tensors; both fit and train the same."""
    for determinism in (False, True):
        with op_determinism() if determinism else contextlib.nullcontext():
            built = examples.mlp(batch=512, dims=(512, 1024, 1024, 1024, 10))
            opt = _optimize(built.graph, 0.8, built.fetches)
            assert opt.report.after.peak_bytes < 0.8 * opt.report.before.peak_bytes
            _assert_same_training(built.graph, opt, built.feeds, built.fetches)


def _asserted_mlp(assertion: bool) -> tf.Graph:
    """Dense layers over ``x`` of unknown shape (fed with ``feed_shapes``), optionally after an assertion on it."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, None, name="x")
        if assertion:
            with tf.control_dependencies([tf.debugging.assert_less_equal(x, 100.0, name="xbound")]):
                x = tf.identity(x)
        h = tf.reshape(x, (BATCH, WIDTH))
        for i in range(LAYERS):
            w = v1.get_variable(f"dense{i}/w", (WIDTH, WIDTH), initializer=v1.glorot_uniform_initializer(seed=i))
            h = tf.nn.relu(tf.matmul(h, w))
        loss = tf.reduce_mean(tf.square(h), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g


@pytest.mark.parametrize("budget_share", [None, 0.6])
def test_assertions_are_planned_as_without(budget_share):
    shapes = {"x:0": (BATCH, WIDTH)}
    without = _optimize(_asserted_mlp(False), budget_share, feed_shapes=shapes)
    g = _asserted_mlp(True)
    ir = annotate(g.as_graph_def(), shapes)
    assert ir.spec("xbound/All:0").shape == () and ir.spec("xbound/range:0").shape == (2,)
    opt = _optimize(g, budget_share, feed_shapes=shapes)
    _assert_same_training(g, opt, _feeds())
    assert _plan(opt)[:2] == _plan(without)[:2]
    assert abs(opt.report.after.peak_bytes - without.report.after.peak_bytes) < 2**20


def test_tf1_cond_branches_never_hold_back_ops_that_always_run():
    """A TF1 ``cond`` (``Switch``/``Merge``, as under ``disable_v2_behavior``) kills the ops of its untaken branch,
    and any op with a control input from one: a barrier after such an op stopped every update of the step."""
    g = tf.Graph()
    with g.as_default():
        v1.disable_control_flow_v2()
        try:
            h = v1.placeholder(tf.float32, (BATCH, WIDTH), name="x")
            for i in range(LAYERS):
                w = v1.get_variable(f"dense{i}/w", (WIDTH, WIDTH), initializer=v1.glorot_uniform_initializer(seed=i))
                if i in (2, 5):
                    other = v1.get_variable(f"dense{i}/other", (WIDTH, WIDTH),
                                            initializer=v1.glorot_uniform_initializer(seed=10 + i))
                    h = tf.cond(tf.reduce_sum(h) > -1e30, lambda h=h, w=w: tf.nn.relu(tf.matmul(h, w)),
                                lambda h=h, other=other: tf.tanh(tf.matmul(h, other)))
                else:
                    h = tf.nn.relu(tf.matmul(h, w))
            loss = tf.reduce_mean(tf.square(h), name="loss")
            v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        finally:
            v1.enable_control_flow_v2()
    dead = maybe_dead(GraphIR.from_graph_def(g.as_graph_def()))
    assert "cond/MatMul_1" in dead and "loss" not in dead and "train" not in dead
    opt = _optimize(g, None)
    assert next(r for r in opt.report.passes if r.name == "limit_parallelism").changed
    steps = train_steps(opt.graph, FETCHES, _feeds(), opt.config)
    assert len(set(np.asarray(steps).tolist())) == 3   # the variables were updated
    _assert_same_training(g, opt, _feeds())


def _host_branch_cond() -> tf.Graph:
    """A TF1 cond whose true branch is a host op reading a 1 MiB device tensor through the cond's ``Switch:1``,
    then a device op on the cond's result that a second host op reads, and an op held back by a ``Switch``."""
    g = tf.Graph()
    with g.as_default():
        v1.disable_control_flow_v2()
        try:
            p = v1.placeholder(tf.bool, (), name="p")
            x = v1.placeholder(tf.float32, (512, 512), name="x")
            h = tf.matmul(x, x, name="h")

            def on_host() -> tf.Tensor:
                with tf.device(HOST):
                    return tf.multiply(h, 2.0, name="host_mul")

            out = tf.cond(p, on_host, lambda: h * 3.0, name="c")
            big = tf.matmul(out, x, name="big")
            with tf.device(HOST):
                tf.multiply(big, 0.5, name="host_big")
            with tf.control_dependencies([g.get_operation_by_name("c/host_mul/Switch")]):
                tf.identity(x, name="after_switch")   # a control edge from a Switch is as alive as the Switch
        finally:
            v1.enable_control_flow_v2()
    return g


def test_switch_outputs_get_no_fence_or_receipt_that_would_stop_the_step():
    """One output of every ``Switch`` is dead each step, though the ``Switch`` is not: a fence or a host receipt
    reading ``c/host_mul/Switch:1`` was dead when ``p`` was false, and so was the op it held back."""
    g = _host_branch_cond()
    ir = annotate(placed(g), {})
    switch = TensorRef("c/host_mul/Switch", 1)
    dead = maybe_dead(ir)
    assert may_be_dead(ir, switch) and "c/host_mul/Switch" not in dead and "c/host_mul" in dead
    assert not may_be_dead(ir, TensorRef("c/Merge", 0)) and "after_switch" not in dead
    fetches = ("big:0", "host_big:0", "after_switch:0")
    ctx = PassContext(fetches, device=DEVICE, host=HOST, inter_op_threads=THREADS, grappler=False)
    fenced = FenceTransfers().run(ir, ctx)
    assert all(d["tensor"] != str(switch) for d in fenced.report.details.get("fenced", []))
    timeline = StepTimeline.build(ir, fetches, ctx.simulate(ir), ())
    group = PersistentGroup((), ("c/host_mul", "host_big"), 0, (), False)   # the host ops, as placement makes them
    chained = chain_to_host(ir, [group], timeline, HOST, in_flight=1)
    assert [n.name for n in chained.nodes if n.attr_bool(TO_HOST_TAG)] == ["big/tfmem_to_host_0"]
    feeds = {"x:0": np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)}
    for p in (False, True):
        want = session_run(placed(g), list(fetches), {**feeds, "p:0": p}, init=False)
        for rewritten in (fenced.graph, chained):
            assert values_equal(want, session_run(rewritten.to_graph_def(), list(fetches), {**feeds, "p:0": p},
                                                  init=False))


def test_whole_frame_preds_grow_with_the_graph_and_frame_analyses_are_kept_per_graph():
    """A loop of 60 variables reads 60 tensors from outside: each of its 61 ``Enter`` ops once got all 61
    reads as predecessors. One entry per frame waits for them now, and the order they imply is the same."""
    g = tf.Graph()
    with g.as_default():
        v1.disable_control_flow_v2()
        try:
            xs = [v1.placeholder(tf.float32, (4,), name=f"x{i}") for i in range(60)]
            outs = v1.while_loop(lambda i, *a: i < 3, lambda i, *a: (i + 1, *(t * 2.0 for t in a)),
                                 [tf.constant(0), *xs], name="loop")
            tf.add_n(outs[1:], name="y")
        finally:
            v1.enable_control_flow_v2()
    ir = GraphIR.from_graph_def(g.as_graph_def())
    preds = whole_frame_preds(ir)
    assert sum(map(len, preds.values())) <= 2 * sum(len(n.predecessors) for n in ir.nodes)
    dag = nx.DiGraph([(p, n) for n, ps in preds.items() for p in ps])
    assert nx.is_directed_acyclic_graph(dag)
    members = [n for n, r in find_regions(ir).items() if r == "loop/while_context"]
    assert all({x.op.name for x in xs} <= nx.ancestors(dag, m) for m in members if ir[m].op == "Enter")
    assert set(members) <= nx.ancestors(dag, "y")
    assert whole_frame_preds(ir) is preds and topological_order(ir) is topological_order(ir)


def test_a_cycle_outside_loops_is_refused_not_dropped():
    spec = (TensorSpec("float32", (), 4),)
    ir = GraphIR((OpNode("a", "Identity", (TensorRef("b"),), outputs=spec),
                  OpNode("b", "Identity", (TensorRef("a"),), outputs=spec),
                  OpNode("c", "Identity", (TensorRef("b"),), outputs=spec)))
    with pytest.raises(MalformedGraphError, match="cycle"):
        topological_order(ir)
    with pytest.raises(MalformedGraphError, match="cycle"):   # its units were left out of the order
        _ = ExecutionGraph.build(ir, ["c:0"]).topological_units


def test_a_barrier_waits_for_the_live_ops_before_a_cond_branch_it_may_not_wait_for():
    """A partition that ends inside a TF1 cond's branches: its last ops may be dead, so the barrier after it
    waits for their nearest predecessors that always run (the cond's ``Switch`` ops) rather than for nothing."""
    g = tf.Graph()
    with g.as_default():
        v1.disable_control_flow_v2()
        try:
            p = v1.placeholder(tf.bool, (), name="p")
            a = tf.nn.relu(v1.placeholder(tf.float32, (64, 64), name="x"), name="a")
            out = tf.cond(p, lambda: a * 2.0, lambda: a * 3.0, name="c")
            tf.identity(out, name="y")
        finally:
            v1.enable_control_flow_v2()
    ir = annotate(g.as_graph_def())
    eg = ExecutionGraph.build(ir, ["y:0"])
    dead = maybe_dead(ir)
    part = [u for u in eg.topological_units if u not in ("c/Merge", "y")]   # up to the branches' last ops
    assert {"c/mul", "c/mul_1"} <= dead
    exits = _exits(eg, part, dead)
    assert {"c/mul/Switch", "c/mul_1/Switch"} <= set(exits) and not set(exits) & dead
