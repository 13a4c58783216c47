"""Graph IR: loading every source kind, exact round trip, specs, feed shapes, control-flow regions, errors."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tfmem import examples
from tfmem.errors import BadInputError, MalformedGraphError, UnknownShapeError
from tfmem.ir import shape_arithmetic, static_values
from tfmem.ir.frames import find_regions
from tfmem.ir.graph import GraphIR, TensorRef
from tfmem.ir.loading import load, to_graph_def
from tfmem.ir.ops import SHAPE_ARITHMETIC_OPS
from tfmem.ir.shapes import annotate, parse_feed_shapes, require_known

v1 = tf.compat.v1


def _v1_while_graph() -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        v1.disable_control_flow_v2()
        try:
            x = v1.placeholder(tf.float32, (8,), name="x")
            out = v1.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a * 2.0), [tf.constant(0), x], name="loop")
            tf.identity(out[1], name="y")
        finally:
            v1.enable_control_flow_v2()
    return g


def _function_graph() -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        @tf.function
        def f(a: tf.Tensor) -> tf.Tensor:
            return tf.math.sin(a) * 2.0

        x = v1.placeholder(tf.float32, (16,), name="x")
        tf.identity(f(x), name="y")
    return g


@pytest.mark.parametrize("build", [lambda: examples.mlp(batch=4, dims=(8, 16, 4)).graph, _v1_while_graph,
                                   _function_graph])
def test_round_trip_is_exact(build):
    gd = build().as_graph_def()
    assert GraphIR.from_graph_def(gd).to_graph_def() == gd
    assert annotate(gd).to_graph_def() == gd


def test_function_library_survives_and_call_is_opaque():
    ir = load(_function_graph())
    calls = [n for n in ir.nodes if n.op in ("PartitionedCall", "StatefulPartitionedCall")]
    assert calls and len(ir.library.function) >= 1
    assert ir.spec("y:0").nbytes == 16 * 4


def test_every_tensor_gets_dtype_shape_bytes():
    built = examples.mlp(batch=4, dims=(8, 16, 4))
    ir = load(built.graph)
    spec = ir.spec("x:0")
    assert (spec.dtype, spec.shape, spec.nbytes) == ("float32", (4, 8), 4 * 8 * 4)
    assert ir.spec("labels:0").dtype == "int32"
    assert all(s.dtype for n in ir.nodes for s in n.outputs)


def test_feed_shapes_fill_unknown_dims_and_unknowns_are_listed_together():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, (None, 10), name="x")
        z = v1.placeholder(tf.float32, (None,), name="z")
        tf.identity(tf.nn.relu(x), name="y")
        tf.identity(z * 2.0, name="w")
    ir = load(g)
    with pytest.raises(UnknownShapeError) as err:
        require_known(ir, [TensorRef("x"), TensorRef("y"), TensorRef("z")])
    assert set(err.value.tensors) == {"x:0", "y:0", "z:0"}
    assert "feed_shapes" in str(err.value) and "x:0" in str(err.value)
    filled = load(g, {"x:0": (32, 10)})
    assert filled.spec("y:0").nbytes == 32 * 10 * 4


def test_shapes_that_depend_on_a_fed_value_stay_unknown():
    """Shape arithmetic on an int placeholder's value: Grappler once read the placeholder as a constant of zeros
    and sized ``zeros(stack([n, 4]))`` at 0 bytes. Fed or not, with other unknowns (``unique``) or none."""
    for unique in (False, True):
        g = tf.Graph()
        with g.as_default():
            n = v1.placeholder(tf.int32, (), name="n")
            x = v1.placeholder(tf.float32, (3, 5), name="x")
            z = tf.zeros(tf.stack([n, 4]), name="z")
            r = tf.reshape(x, tf.stack([n, -1]), name="r")
            total = tf.reduce_sum(z) + tf.reduce_sum(r) + tf.reduce_sum(tf.zeros(tf.shape(x), name="s"))
            if unique:
                total += tf.reduce_sum(tf.unique(tf.reshape(z, [-1])).y)
            tf.identity(total, name="y")
        for feeds in (None, {"n:0": (), "x:0": (3, 5)}):
            ir = annotate(g.as_graph_def(), feeds)
            assert (ir.spec("z:0").shape, ir.spec("z:0").nbytes) == ((None, 4), None)
            assert ir.spec("r:0").shape == (None, None)
            assert ir.spec("s:0").nbytes == 3 * 5 * 4   # the shape of a fed tensor is known, and so is its Shape


def test_feed_shape_errors_are_clear():
    g = tf.Graph()
    with g.as_default():
        v1.placeholder(tf.float32, (None, 10), name="x")
    with pytest.raises(BadInputError, match="no node 'nope'"):
        load(g, {"nope:0": (1, 10)})
    with pytest.raises(BadInputError, match="does not fit"):
        load(g, {"x:0": (4, 11)})
    with pytest.raises(BadInputError, match="malformed"):
        parse_feed_shapes(["x:0"])
    assert parse_feed_shapes(["x:0=32,784"]) == {"x:0": (32, 784)}


def test_files_binary_text_and_metagraph(tmp_path):
    g = examples.mlp(batch=2, dims=(4, 4, 2)).graph
    gd = g.as_graph_def()
    tf.io.write_graph(gd, str(tmp_path), "g.pb", as_text=False)
    tf.io.write_graph(gd, str(tmp_path), "g.pbtxt", as_text=True)
    with g.as_default():
        meta = v1.train.export_meta_graph()
    (tmp_path / "m.pb").write_bytes(meta.SerializeToString())
    for name in ("g.pb", "g.pbtxt"):
        assert to_graph_def(tmp_path / name).node == gd.node
    assert [n.name for n in to_graph_def(tmp_path / "m.pb").node] == [n.name for n in gd.node]


def test_bad_files_get_clear_errors(tmp_path):
    with pytest.raises(BadInputError, match="does not exist"):
        load(tmp_path / "missing.pb")
    (tmp_path / "junk.pb").write_bytes(np.random.default_rng(0).bytes(300))
    with pytest.raises(MalformedGraphError, match="not a TensorFlow graph"):
        load(tmp_path / "junk.pb")
    with pytest.raises(BadInputError, match="is not a file"):
        load(tmp_path)
    with pytest.raises(BadInputError):
        load(12345)  # type: ignore[arg-type]


def test_dangling_input_and_duplicate_names_are_refused():
    gd = tf.compat.v1.GraphDef()
    gd.node.add(name="a", op="Identity", input=["ghost"])
    with pytest.raises(MalformedGraphError, match="ghost"):
        GraphIR.from_graph_def(gd)
    gd2 = tf.compat.v1.GraphDef()
    gd2.node.add(name="a", op="NoOp")
    gd2.node.add(name="a", op="NoOp")
    with pytest.raises(MalformedGraphError, match="duplicate"):
        GraphIR.from_graph_def(gd2)


def test_v1_loop_frame_is_one_region():
    ir = load(_v1_while_graph())
    regions = find_regions(ir)
    assert set(regions.values()) == {"loop/while_context"}
    members = {n for n, r in regions.items()}
    assert any(ir[n].op == "NextIteration" for n in members)
    assert "y" not in regions and "x" not in regions


def _arithmetic_cases() -> tf.Graph:
    """One op of each ``SHAPE_ARITHMETIC_OPS`` type on constants, in the forms shape code uses and the corners
    where numpy and TensorFlow part (negative strides and indices, floor division of negatives, clamped ends)."""
    g = tf.Graph()
    with g.as_default():
        s = tf.constant([8, 5, 3, 2], name="s")
        m = tf.constant([[1, 2, 3], [4, 5, 6]], tf.int64, name="m")
        n = tf.constant([7, -7, 6], name="n")
        tf.stack([s[0], 4, s[-1]], name="pack")
        tf.unstack(m, axis=1, name="unpack")
        tf.concat([s[:2], [3], s[2:]], 0, name="concat")
        tf.raw_ops.Concat(concat_dim=1, values=[m, m], name="concat_v1")
        for i, key in enumerate([np.s_[1:], np.s_[::-1], np.s_[-2], np.s_[5:-9:-2], np.s_[:100], np.s_[-100:2]]):
            tf.identity(s[key], name=f"strided_{i}")
        tf.identity(m[1, ::-1], name="strided_2d")
        tf.slice(m, [0, 1], [-1, 2], name="slice")
        tf.gather(s, [3, 3, 0], name="gather")
        tf.gather(m, [2, 0], axis=1, name="gather_axis")
        tf.raw_ops.Gather(params=s, indices=[1, 1], name="gather_v1")
        tf.cast(m, tf.int32, name="cast")
        tf.reshape(m, [-1], name="reshape")
        tf.squeeze(tf.reshape(s, [1, 4, 1]), axis=[0], name="squeeze")
        tf.expand_dims(s, -1, name="expand")
        tf.raw_ops.Add(x=s, y=1, name="add")
        tf.raw_ops.AddV2(x=n, y=n, name="addv2")
        tf.subtract(s, [1], name="sub")
        tf.multiply(m, [[2], [3]], name="mul")
        tf.math.floordiv(n, 4, name="floordiv")
        tf.math.floormod(n, -4, name="floormod")
        tf.maximum(n, 0, name="max2")
        tf.minimum(n, 0, name="min2")
        tf.negative(n, name="neg")
        tf.reduce_prod(s, name="prod")
        tf.reduce_sum(m, axis=0, keepdims=True, name="sum")
        tf.reduce_max(m, axis=-1, name="max")
        tf.reduce_min(m, axis=[0, 1], name="min")
        tf.raw_ops.BroadcastArgs(s0=tf.constant([4, 1, 3]), s1=tf.constant([5, 1]), name="bcast")
        tf.raw_ops.BroadcastGradientArgs(s0=tf.constant([1, 1, 3]), s1=tf.constant([2, 1, 3]), name="bcast_grad")
        tf.raw_ops.BroadcastGradientArgs(s0=s, s1=s, name="bcast_grad_same")
        tf.transpose(m, [1, 0], name="transpose")
        tf.reverse(s, [0], name="reverse")
        tf.range(2, 5, name="range")
        tf.range(6, -3, -4, name="range_down")
        tf.math.invert_permutation(tf.constant([2, 0, 3, 1]), name="invert_permutation")
    return g


def test_shape_arithmetic_is_evaluated_as_tensorflow_does():
    g = _arithmetic_cases()
    ops = [op for op in g.get_operations() if op.type in SHAPE_ARITHMETIC_OPS]
    assert {op.type for op in ops} == SHAPE_ARITHMETIC_OPS == set(shape_arithmetic.RULES)
    with v1.Session(graph=g) as sess:
        want = sess.run([list(op.outputs) for op in ops])
        inputs = sess.run([list(op.inputs) for op in ops])
    for op, outputs, values in zip(ops, want, inputs, strict=True):
        for index, expected in enumerate(outputs):
            got = shape_arithmetic.evaluate(op.type, dict(op.node_def.attr), values, index)
            assert got.dtype == expected.dtype and np.array_equal(got, expected), (op.name, got, expected)
    with pytest.raises(IndexError):   # numpy would wrap the index; TensorFlow refuses it
        shape_arithmetic.evaluate("GatherV2", {}, [np.array([1, 2]), np.array(-1), np.array(0)])
    with pytest.raises(ValueError):   # a range's length is checked before numpy makes it
        shape_arithmetic.evaluate("Range", {}, [np.array(0), np.array(2**40), np.array(1)])
    with pytest.raises(ValueError):   # numpy gives an empty range; TensorFlow refuses it
        shape_arithmetic.evaluate("Range", {}, [np.array(5), np.array(2), np.array(1)])
    with pytest.raises(shape_arithmetic.Unsupported):
        shape_arithmetic.evaluate("Fill", {}, [np.array([2]), np.array(1)])


def test_partial_shapes_that_nothing_can_complete_cost_no_scratch_graph(monkeypatch):
    """A convnet with an unknown batch and no feed_shapes: every activation is partial, and nothing tfmem
    knows beyond the import's shapes can complete one, so no op is inferred again (each once took a scratch
    graph of its own)."""
    built = examples.residual_convnet(blocks=4)
    gd = built.graph.as_graph_def()
    for node in gd.node:
        if node.op == "Placeholder":
            node.attr["shape"].shape.dim[0].size = -1
    scratch: list[str] = []
    real = static_values._scratch_graph
    monkeypatch.setattr(static_values, "_scratch_graph", lambda node, inputs: scratch.append(node.name) or
                        real(node, inputs))
    ir = annotate(gd)
    assert sum(not s.known for n in ir.nodes for s in n.outputs) > 20 and ir.spec("stem/w:0").known
    assert scratch == []


def test_static_values_follow_a_long_chain_without_recursion():
    g = tf.Graph()
    with g.as_default():
        s = tf.constant([64, 3], name="s")
        for i in range(3000):
            s = tf.identity(s, name=f"chain_{i}") if i % 2 else tf.raw_ops.AddV2(x=s, y=[0, 0], name=f"chain_{i}")
    ir = annotate(g.as_graph_def())
    values = static_values._Values(ir, {})
    assert values.value(TensorRef("chain_2999")).tolist() == [64, 3]


def test_a_fed_tensor_has_no_static_value():
    """``n`` is a constant, but fed: ``zeros`` of a shape built from it keeps that dimension unknown, though the
    variable's shape (through ``VariableShape``) fills the other."""
    g = tf.Graph()
    with g.as_default():
        v = v1.get_variable("v", (5, 3), use_resource=True)
        n = tf.constant([3], name="n")
        shape = tf.concat([tf.raw_ops.VariableShape(input=v.handle)[:1], n], 0)
        tf.identity(tf.reduce_sum(tf.zeros(shape, name="z")), name="y")
    assert annotate(g.as_graph_def()).spec("z:0").shape == (5, 3)
    assert annotate(g.as_graph_def(), {"n:0": (1,)}).spec("z:0").shape == (5, None)
