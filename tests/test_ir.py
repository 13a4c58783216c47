"""Graph IR: loading every source kind, exact round trip, specs, feed shapes, control-flow regions, errors."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tfmem import examples
from tfmem.errors import BadInputError, MalformedGraphError, UnknownShapeError
from tfmem.ir.frames import find_regions
from tfmem.ir.graph import GraphIR, TensorRef
from tfmem.ir.loading import load, to_graph_def
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
