"""Bad arguments to the public functions raise a ``TfmemError`` that says what, where, and a fix that works.

Issue 38, "one error family": each case here once escaped as TensorFlow's or Python's own exception (or hung).
Where a message suggests a fix, a test applies the fix and shows that the call then succeeds.
"""

from __future__ import annotations

import ast
import math
import re

import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

import tfmem
from tfmem.errors import BadInputError, MalformedGraphError, TfmemError
from tfmem.ir.execution import fetch_names
from tfmem.ir.shapes import check_feed_shapes, parse_feed_shapes
from tfmem.sim.bfc import BFCAllocator
from tfmem.units import MAX_BYTES, parse_bytes

FEED = {"x:0": (4, 16)}


@pytest.fixture(scope="module")
def tiny() -> tf.Graph:
    """x (?, 16) -> MatMul with a constant (16, 8) -> Relu -> y = sum; the batch of x is unknown."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (None, 16), name="x")
        w = tf.constant(1.0, shape=(16, 8), name="w")
        tf.reduce_sum(tf.nn.relu(tf.matmul(x, w)), name="y")
    return g


def suggested(message: str, key: str) -> object:
    """The Python literal the message suggests after ``key=`` (e.g. ``feed_shapes={'x:0': (4, 16)}``)."""
    match = re.search(re.escape(key) + r"=(\{[^}]*\}|'[^']*')", message)
    assert match, message
    return ast.literal_eval(match.group(1))


# -- budgets and other sizes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [float("nan"), float("inf"), -float("inf"), -1, 0, 0.5, True, False, 2**63,
                                    MAX_BYTES + 1, "1e400", "1e30", "-1GiB", "0", "lots", [1], {"GiB": 1}])
def test_bad_budget_is_refused_by_name(tiny: tf.Graph, budget: object) -> None:
    with pytest.raises(BadInputError, match="^budget: ") as err:
        tfmem.optimize(tiny, "y:0", budget=budget, feed_shapes=FEED)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)
    fix = re.search(r"(?:such as|like|e\.g\.) '([^']+)'", str(err.value))  # the size the message shows works
    assert fix, str(err.value)
    assert tfmem.optimize(tiny, "y:0", budget=fix.group(1), feed_shapes=FEED).report.budget_bytes == parse_bytes(
        fix.group(1))


def test_fractional_budget_rounds_down(tiny: tf.Graph) -> None:
    assert parse_bytes(1000.9) == 1000 and parse_bytes("0.5KiB") == 512 and parse_bytes(MAX_BYTES) == MAX_BYTES
    opt = tfmem.optimize(tiny, "y:0", budget=64 * 2**20 + 0.75, feed_shapes=FEED)
    assert opt.report.budget_bytes == 64 * 2**20


@pytest.mark.parametrize("value", [float("nan"), math.inf, "1e400", 2**70])
def test_parse_bytes_refuses_non_finite_and_absurd_sizes(value: object) -> None:
    with pytest.raises(BadInputError, match="memory"):
        parse_bytes(value, what="memory")  # type: ignore[arg-type]


def test_simulate_refuses_a_device_without_memory_and_models_a_2mib_one(tiny: tf.Graph) -> None:
    for bad in (0, -5, "1e400", "none"):
        with pytest.raises(BadInputError, match="device_memory"):
            tfmem.simulate(tiny, "y:0", feed_shapes=FEED, device_memory=bad)  # type: ignore[arg-type]
    # A 2 MiB limit left the allocator model a region of 0 bytes that it doubled forever.
    bfc = BFCAllocator(limit_bytes=2 << 20)
    bfc.allocate(3 << 20)
    assert bfc.failures == 1
    assert tfmem.simulate(tiny, "y:0", feed_shapes=FEED, device_memory="2MiB").peak_bytes > 0


# -- feed shapes ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("feed_shapes", "fragment"), [
    ({"x:0": (64, "a")}, "dimension 1 is 'a'"),
    ({"x:0": (64, -3)}, "dimension 1 is -3, which is negative"),
    ({"x:0": (4.5, 16)}, "dimension 0 is 4.5"),
    ({"x:0": (None, 16)}, "dimension 0 is None"),
    ({"x:0": (True, 16)}, "dimension 0 is True"),
    ({"x:0": 4}, "is not a shape"),
    ({"x:0": "4,16"}, "is not a shape"),
    ({"x:0": (2**40, 2**40)}, "2**62 elements"),
    ({"x:0": (1,) * 300}, "at most 254"),
    ({0: (4, 16)}, "key 0 is not a tensor name"),
    ({"": (4, 16)}, "is not a tensor name"),
    ("x:0=64,256", "must be a dict"),
    ([("x:0", (4, 16))], "must be a dict"),
])
def test_malformed_feed_shapes(tiny: tf.Graph, feed_shapes: object, fragment: str) -> None:
    with pytest.raises(BadInputError, match="feed_shapes") as err:
        tfmem.optimize(tiny, "y:0", feed_shapes=feed_shapes)  # type: ignore[arg-type]
    assert fragment in str(err.value) and "feed_shapes={'x:0': (64, 784)}" in str(err.value)
    with pytest.raises(BadInputError, match=re.escape(fragment)):  # simulate and load check the same way
        tfmem.simulate(tiny, "y:0", feed_shapes=feed_shapes)  # type: ignore[arg-type]
    with pytest.raises(BadInputError, match=re.escape(fragment)):
        tfmem.load(tiny, feed_shapes)  # type: ignore[arg-type]


def test_feed_shapes_accept_tensors_numpy_ints_and_lists(tiny: tf.Graph) -> None:
    import numpy as np

    x = tiny.get_tensor_by_name("x:0")
    assert check_feed_shapes({x: [np.int64(4), 16], "y": ()}) == {"x:0": (4, 16), "y:0": ()}


def test_a_feed_shape_that_does_not_fit_suggests_one_that_does(tiny: tf.Graph) -> None:
    with pytest.raises(BadInputError, match="does not fit its declared shape") as err:
        tfmem.optimize(tiny, "y:0", feed_shapes={"x:0": (4, 15)})
    fix = suggested(str(err.value), "feed_shapes")
    assert fix == {"x:0": (4, 16)}
    assert tfmem.optimize(tiny, "y:0", feed_shapes=fix, passes=[]).report.before.peak_bytes > 0  # type: ignore[arg-type]


def test_unknown_sizes_suggest_feed_shapes_that_work(tiny: tf.Graph) -> None:
    with pytest.raises(tfmem.UnknownShapeError) as err:
        tfmem.optimize(tiny, "y:0")
    assert "feed_shapes={'x:0': (...)}" in str(err.value)  # the declared shape fills the dots:
    with pytest.raises(BadInputError) as misfit:
        tfmem.optimize(tiny, "y:0", feed_shapes={"x:0": ()})
    assert tfmem.optimize(tiny, "y:0", feed_shapes=suggested(str(misfit.value), "feed_shapes"),  # type: ignore[arg-type]
                          passes=[]).report.before.peak_bytes > 0


@pytest.mark.parametrize(("item", "fragment"), [
    ("x:0", "no '='"), ("=3", "no tensor name"), ("x:0=a,b", "dimension 0 is 'a'"), ("x:0=-1", "negative"),
    ("x:0=1,,2", "dimension 1 is ''"), ("x:0=99999999999999999999,1", "2**62 elements"), (":=4", "no tensor name"),
])
def test_malformed_cli_feed_shapes(item: str, fragment: str) -> None:
    with pytest.raises(BadInputError, match=re.escape(fragment)):
        parse_feed_shapes([item])


# -- devices ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"device": "not a device"}, "device 'not a device' is not a device string"),
    ({"device": "/GPU:0", "host": "@@"}, "host '@@' is not a device string"),
    ({"device": "/job:a b"}, "job 'a b'"),
    ({"device": "/CPU:-1"}, "device index must not be negative"),
    ({"device": "/device:GPU:x"}, "is not a device string"),
    ({"device": 3}, "device must be a device string"),
    ({"device": "/GPU:0", "host": b"/CPU:0"}, "host must be a device string"),
    ({"device": "/GPU:0", "host": "/GPU:0"}, "can name the same device"),
    ({"host": "/CPU:0"}, "could also name the device that unplaced ops run on"),
])
def test_bad_devices(tiny: tf.Graph, kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(BadInputError, match=re.escape(fragment)) as err:
        tfmem.optimize(tiny, "y:0", feed_shapes=FEED, **kwargs)  # type: ignore[arg-type]
    assert "'/GPU:0'" in str(err.value)  # every message shows a device string that works:


def test_the_device_strings_the_messages_suggest_work(tiny: tf.Graph) -> None:
    opt = tfmem.optimize(tiny, "y:0", feed_shapes=FEED, device="/GPU:0", host="/CPU:0", budget="64MiB")
    assert opt.report.after.peak_bytes > 0
    for device in ("/device:CPU:0", "/job:worker/replica:0/task:0/device:CPU:0"):
        assert tfmem.simulate(tiny, "y:0", feed_shapes=FEED, device=device).peak_bytes > 0


# -- fetches, passes, threads -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("fetches", "fragment"), [
    (None, "fetches must be a name or a list of names"), (3, "fetches must be a name"), ([3], "fetch 3 (int)"),
    ([""], "fetch '' is not a tensor or op name"), ([], "no fetches given"), ({"y:0": 1}, "fetches must be"),
    (["y:-1"], "write NODE:INDEX"), (["nope:0"], "it has no op 'nope'"), (["Y"], "is not an op of the graph"),
    (["y:5"], "y (Sum) has 1 output(s); fetch y:0"), (["y:0", None], "fetch None (NoneType)"),
])
def test_bad_fetches(tiny: tf.Graph, fetches: object, fragment: str) -> None:
    with pytest.raises(BadInputError, match=re.escape(fragment)):
        tfmem.optimize(tiny, fetches, feed_shapes=FEED)  # type: ignore[arg-type]
    with pytest.raises(BadInputError, match=re.escape(fragment)):
        tfmem.simulate(tiny, fetches, feed_shapes=FEED)  # type: ignore[arg-type]


def test_fetch_typos_name_the_closest_op(tiny: tf.Graph) -> None:
    with pytest.raises(BadInputError, match=re.escape("(did you mean 'Relu'?)")):
        tfmem.optimize(tiny, "Relus:0", feed_shapes=FEED)
    assert fetch_names(tiny.get_tensor_by_name("y:0")) == ["y:0"]
    assert tfmem.optimize(tiny, "Relu:0", feed_shapes=FEED, passes=[]).report.before.peak_bytes > 0


@pytest.mark.parametrize(("passes", "fragment"), [
    ([1], "passes[0] is 1 (int), neither a pass name nor a pass"), (5, "passes must be 'auto', None or a list"),
    (",,,", "unknown pass ',,,'"), ("", "unknown pass ''"), (["partition", None], "passes[1] is None"),
    (["nope"], "unknown pass 'nope'"),
])
def test_bad_passes_list_the_known_ones(tiny: tf.Graph, passes: object, fragment: str) -> None:
    with pytest.raises(BadInputError, match=re.escape(fragment)) as err:
        tfmem.optimize(tiny, "y:0", feed_shapes=FEED, passes=passes)  # type: ignore[arg-type]
    assert "partition" in str(err.value) and "passes=[] for none" in str(err.value)


def test_the_pass_lists_the_messages_suggest_work(tiny: tf.Graph) -> None:
    for passes in ([], None, "auto", ["partition"]):
        assert tfmem.optimize(tiny, "y:0", feed_shapes=FEED, passes=passes).report.after.peak_bytes > 0


@pytest.mark.parametrize("threads", [-1, "2", 2.5, True, [2], 2**60])
def test_bad_inter_op_threads(tiny: tf.Graph, threads: object) -> None:
    with pytest.raises(BadInputError, match="inter_op_threads"):
        tfmem.optimize(tiny, "y:0", feed_shapes=FEED, inter_op_threads=threads)  # type: ignore[arg-type]
    with pytest.raises(BadInputError, match="inter_op_threads must be an int from 1 to 4096"):
        tfmem.simulate(tiny, "y:0", feed_shapes=FEED, inter_op_threads=0 if threads == -1 else threads)  # type: ignore[arg-type]


def test_inter_op_threads_zero_means_tensorflows_default(tiny: tf.Graph) -> None:
    for threads in (0, 2, None):
        assert tfmem.optimize(tiny, "y:0", feed_shapes=FEED, inter_op_threads=threads).report.after.peak_bytes > 0


# -- graphs -----------------------------------------------------------------------------------------------------

def _graph_def(tiny: tf.Graph, edit: str) -> graph_pb2.GraphDef:
    gd = graph_pb2.GraphDef()
    gd.CopyFrom(tiny.as_graph_def())
    nodes = {n.name: n for n in gd.node}
    if edit == "const without value":
        del nodes["w"].attr["value"]
    elif edit == "const of unknown size":  # Grappler's C++ aborted the process on this one
        nodes["w"].attr["value"].tensor.tensor_shape.dim[0].size = -1
    elif edit == "unknown op":
        nodes["Relu"].op = "NoSuchOp"
    elif edit == "no name":
        nodes["Relu"].name = ""
    elif edit == "bad device":
        nodes["Relu"].device = "@@"
    elif edit == "attr of the wrong type":
        nodes["Relu"].attr["T"].s = b"float"
    elif edit == "bad dtype":
        nodes["Relu"].attr["T"].type = 9999
    elif edit == "missing input":
        nodes["Relu"].input[0] = "ghost"
    elif edit == "extra input":
        nodes["Relu"].input.append("x")
    elif edit == "data input after control":
        nodes["Relu"].input[:] = ["^x", "MatMul"]
    elif edit == "shapes that contradict":  # decodes and passes Grappler; TensorFlow's import refuses it
        nodes["MatMul"].input[:] = ["w", "w"]
    elif edit == "feeds that contradict":  # (?, 16) x (?, 16) imports; with x fed as (4, 16) it does not
        nodes["MatMul"].input[1] = "x"
    elif edit == "duplicate name":
        gd.node.add().CopyFrom(nodes["Relu"])
    elif edit == "cycle":
        nodes["MatMul"].input[0] = "y"
    return gd


GRAPH_EDITS = {
    "const without value": "has no attr 'value', which its op requires",
    "const of unknown size": "has a shape with dimension -1",
    "unknown op": "'NoSuchOp', which TensorFlow",
    "no name": "has no name",
    "bad device": "has device '@@', which is not a device string",
    "attr of the wrong type": "attr 'T' holds s, but its op wants a type",
    "bad dtype": "dtype 9999",
    "missing input": "has input 'ghost', which is not a node of the graph",
    "extra input": "has 2 data input(s), but its op takes 1",
    "data input after control": "data inputs come first",
    "shapes that contradict": "TensorFlow cannot import the graph: Dimensions must be equal",
    "feeds that contradict": "feed_shapes (x:0=(4, 16)) do not fit the graph: Dimensions must be equal",
    "duplicate name": "duplicate node name 'Relu'",
    "cycle": "in a cycle",
}


@pytest.mark.parametrize("edit", sorted(GRAPH_EDITS))
def test_malformed_graph_defs_are_refused_on_load(tiny: tf.Graph, edit: str) -> None:
    gd = _graph_def(tiny, edit)
    error = BadInputError if edit == "feeds that contradict" else MalformedGraphError
    with pytest.raises(error, match=re.escape(GRAPH_EDITS[edit])) as err:
        tfmem.optimize(gd, "y:0", feed_shapes=FEED)
    assert "\n" not in str(err.value)
    if edit not in ("shapes that contradict", "feeds that contradict"):  # TensorFlow's import: checked on load
        with pytest.raises(MalformedGraphError, match=re.escape(GRAPH_EDITS[edit])):
            tfmem.simulate(gd, "y:0", feed_shapes=FEED)


def test_an_unedited_graph_def_loads(tiny: tf.Graph) -> None:
    assert tfmem.optimize(_graph_def(tiny, "none"), "y:0", feed_shapes=FEED).report.after.peak_bytes > 0


@pytest.mark.parametrize(("content", "error", "fragment"), [
    (None, BadInputError, "is not a file"),
    (b"", MalformedGraphError, "is not a TensorFlow graph"),
    (bytes(range(256)) * 4, MalformedGraphError, "is not a TensorFlow graph"),
])
def test_graph_files_that_are_not_graphs(tmp_path, content: bytes | None, error: type[TfmemError],
                                         fragment: str) -> None:
    path = tmp_path / "g.pb"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(error, match=fragment):
        tfmem.load(path)


# -- Grappler's estimate ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"device_type": "XPU"}, "device_type must be 'GPU' or 'CPU'"), ({"memory": 0}, "memory: must be positive"),
    ({"memory": "1e400"}, "2**62"), ({"host": "@@"}, "host '@@' is not a device string"),
    ({"fetches": None}, "fetches must be a name"), ({"fetches": ["nope:0"]}, "names no op of the graph"),
])
def test_grappler_peak_refuses_bad_arguments(tiny: tf.Graph, kwargs: dict[str, object], fragment: str) -> None:
    from tfmem.measure import grappler_peak

    fetches = kwargs.pop("fetches", ["y:0"])
    with pytest.raises(BadInputError, match=re.escape(fragment)):
        grappler_peak(tiny, fetches, **kwargs)  # type: ignore[arg-type]
    assert grappler_peak(tiny, ["y:0"], device_type="cpu", memory="1GiB", host="/CPU:1") >= 0
