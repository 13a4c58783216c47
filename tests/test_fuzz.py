"""Fuzzing the command line and ``tfmem.optimize``: whatever the input, a ``TfmemError`` (exit 2, one line) or success.

Issue 38, "one error family". Hypothesis runs derandomized, so the examples are the same on every run; each test
draws a few hundred (the whole file takes well under a minute on two cores). ``tfmem run`` stays out: it starts
processes. Beside the fuzzing, ``*_succeed`` tests draw only valid values and require success, so that refusing
everything would not pass.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tensorflow as tf
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tensorflow.core.framework import graph_pb2

import tfmem
from passes import PASSES
from tfmem import cli

SETTINGS = {"derandomize": True, "deadline": None, "database": None,
            "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]}
FEED = "x:0=4,16"


def _tiny() -> tf.Graph:
    """x (?, 16) -> MatMul with a variable (16, 8) -> Relu -> y = sum, and a training step ``train``."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (None, 16), name="x")
        w = tf.Variable(tf.ones((16, 8)), name="w")
        y = tf.reduce_sum(tf.nn.relu(tf.matmul(x, w)), name="y")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(y, name="train")
    return g


TINY = _tiny()
GRAPH_DEF = TINY.as_graph_def()
DATA = GRAPH_DEF.SerializeToString()
NAMES = [n.name for n in GRAPH_DEF.node]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fuzz")
    (d / "tiny.pb").write_bytes(DATA)
    return d


def run_cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    code = cli.main(argv)
    _, err = capsys.readouterr()
    assert code in (cli.EXIT_OK, cli.EXIT_BAD_INPUT), (argv, code, err)
    assert "Traceback" not in err and "internal error" not in err, (argv, err)
    if code == cli.EXIT_BAD_INPUT:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tfmem: error: "), (argv, err)
    return code, err


# -- graphs: random bytes, truncated and mutated GraphDefs --------------------------------------------------------

def _edit(kind: str, node: int, value: int) -> Callable[[graph_pb2.GraphDef], None]:
    """One structural edit of a GraphDef that still decodes: ops, attrs, inputs, names, devices, shapes."""
    def apply(gd: graph_pb2.GraphDef) -> None:
        nd = gd.node[node % len(gd.node)]
        other = NAMES[value % len(NAMES)]
        if kind == "op":
            nd.op = ["NoSuchOp", "Identity", "Const", "Placeholder", "Enter", "Switch", "AddN", ""][value % 8]
        elif kind == "drop attr" and nd.attr:
            del nd.attr[sorted(nd.attr)[value % len(nd.attr)]]
        elif kind == "attr kind" and nd.attr:
            attr = nd.attr[sorted(nd.attr)[value % len(nd.attr)]]
            [lambda: setattr(attr, "s", b"junk"), lambda: setattr(attr, "i", -5), lambda: setattr(attr, "type", 9999),
             lambda: setattr(attr, "b", True), lambda: attr.shape.dim.add(size=-7)][value % 5]()
        elif kind == "input":
            nd.input.append([other, f"{other}:7", "^" + other, "ghost", nd.name, "x:-1", ""][value % 7])
        elif kind == "rewire" and nd.input:
            nd.input[value % len(nd.input)] = other
        elif kind == "clear inputs":
            del nd.input[:]
        elif kind == "name":
            nd.name = ["", other, "a b", "x:0", "renamed"][value % 5]
        elif kind == "device":
            nd.device = ["@@", "/GPU:0", "/job:a b", "/CPU:-1", "/job:worker/replica:0/task:0/device:CPU:0"][value % 5]
        elif kind == "remove":
            del gd.node[node % len(gd.node)]
        elif kind == "duplicate":
            gd.node.add().CopyFrom(nd)
        elif kind == "tensor shape" and "value" in nd.attr and nd.attr["value"].HasField("tensor"):
            nd.attr["value"].tensor.tensor_shape.dim.add(size=[3, -1, 2**50][value % 3])
    return apply


EDITS = st.builds(_edit, st.sampled_from(["op", "drop attr", "attr kind", "input", "rewire", "clear inputs", "name",
                                          "device", "remove", "duplicate", "tensor shape"]),
                  st.integers(0, 10_000), st.integers(0, 10_000))


def _edited(edits: list[Callable[[graph_pb2.GraphDef], None]]) -> bytes:
    gd = graph_pb2.GraphDef()
    gd.CopyFrom(GRAPH_DEF)
    for edit in edits:
        edit(gd)
    return gd.SerializeToString()


def _flipped(flips: list[tuple[int, int]]) -> bytes:
    data = bytearray(DATA)
    for at, byte in flips:
        data[at % len(data)] = byte
    return bytes(data)


GRAPH_BYTES = st.one_of(
    st.binary(max_size=300),                                                        # random bytes
    st.integers(0, len(DATA) - 1).map(lambda n: DATA[:n]),                          # truncated
    st.lists(st.tuples(st.integers(0, len(DATA)), st.integers(0, 255)), min_size=1, max_size=6).map(_flipped),
    st.lists(EDITS, min_size=1, max_size=3).map(_edited),                           # decodes, makes no sense
)


@settings(max_examples=300, **SETTINGS)
@given(data=GRAPH_BYTES, command=st.sampled_from(["analyze", "optimize"]))
def test_cli_on_broken_graph_files(data: bytes, command: str, folder: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = folder / "broken.pb"
    path.write_bytes(data)
    extra = ["-o", str(folder / "out.pb"), "--budget", "64MiB"] if command == "optimize" else []
    code, _ = run_cli(capsys, [command, str(path), "--feed-shape", FEED, *extra])
    event(f"exit {code}")


@settings(max_examples=150, **SETTINGS)
@given(edits=st.lists(EDITS, min_size=1, max_size=3))
def test_optimize_on_broken_graph_defs(edits: list[Callable[[graph_pb2.GraphDef], None]]) -> None:
    gd = graph_pb2.GraphDef()
    gd.ParseFromString(_edited(edits))
    try:
        tfmem.optimize(gd, ["y:0"], feed_shapes={"x:0": (4, 16)}, budget="64MiB")
        event("optimized")
    except tfmem.TfmemError as e:
        event(type(e).__name__)
        assert "\n" not in str(e).strip()


def test_the_unbroken_graph_file_succeeds(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = folder / "whole.pb"
    path.write_bytes(_flipped([]))  # the generators' starting point works, so their failures are theirs
    assert run_cli(capsys, ["analyze", str(path), "--feed-shape", FEED])[0] == cli.EXIT_OK


# -- command-line values --------------------------------------------------------------------------------------------

NUMBERS = st.one_of(st.integers(-2**70, 2**70).map(str), st.floats(allow_nan=True, allow_infinity=True).map(str),
                    st.floats(min_value=0, max_value=1e12).map(lambda f: f"{f:g}{'KMGT'[int(f) % 4]}iB"))
TEXT = st.text(max_size=16)
SIZES = st.one_of(NUMBERS, TEXT, st.sampled_from(["64MiB", "1GiB", "0", "1e400", "-1GiB", "nan", "inf", "1.5GB"]))
FEED_SHAPES = st.one_of(TEXT, st.builds(lambda n, dims: f"{n}={','.join(dims)}",
                                        st.sampled_from(["x:0", "x", "y:0", "w", "", "x:1", "ghost:0"]),
                                        st.lists(st.one_of(NUMBERS, st.sampled_from(["4", "16", "", "a"])),
                                                 max_size=3)))
PASS_SPECS = st.one_of(TEXT, st.lists(st.sampled_from([*PASSES, "", " ", "auto", "none", "nope"]), max_size=3)
                       .map(",".join))
FETCHES = st.one_of(TEXT, st.sampled_from(["y:0", "y", "train", "y:1", "y:-1", "x:0", "ghost", ":0", "y:0:0"]))
DEVICES = st.one_of(TEXT, st.sampled_from(["/GPU:0", "/CPU:0", "/device:CPU:1", "@@", "/job:a b", "cpu", "",
                                           "/job:worker/replica:0/task:0/device:CPU:0", "/CPU:-1"]))


# Per option: valid values (absent: the default) and anything. Each example gives one or two options anything,
# the others a valid value or none, so that the random values reach the code behind the checks that come first.
OPTIONS: dict[str, tuple[list[str], st.SearchStrategy[str]]] = {
    "--feed-shape": ([FEED, "x=4,16"], FEED_SHAPES),
    "--fetch": (["y:0", "train"], FETCHES),
    "--device": (["/GPU:0", "/job:worker/replica:0/task:0/device:CPU:0"], DEVICES),
    "--host": (["/CPU:0", "/device:CPU:1"], DEVICES),
}
COMMAND_OPTIONS: dict[str, dict[str, tuple[list[str], st.SearchStrategy[str]]]] = {
    "analyze": {**OPTIONS, "--device-memory": (["12GiB", "16GB"], SIZES)},
    "optimize": {**OPTIONS, "--budget": (["64MiB", "1GiB", "67108864.5"], SIZES),
                 "--passes": (["auto", "none", "partition"], PASS_SPECS)},
}


@st.composite
def cli_arguments(draw: st.DrawFn) -> list[str]:
    command = draw(st.sampled_from(sorted(COMMAND_OPTIONS)))
    options = COMMAND_OPTIONS[command]
    fuzzed = draw(st.permutations(sorted(options)))[:draw(st.integers(1, 2))]
    argv = [command]
    for name, (valid, anything) in options.items():
        value = draw(anything if name in fuzzed else st.sampled_from([None, *valid]))
        if name == "--feed-shape" and value is None:
            value = FEED  # without it, sizes are unknown and every command fails alike
        if value is not None:
            argv.append(f"{name}={value}")
    return argv


@settings(max_examples=500, **SETTINGS)
@given(argv=cli_arguments())
def test_cli_on_random_values(argv: list[str], folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [argv[0], str(folder / "tiny.pb"), *argv[1:]]
    if argv[0] == "optimize":
        argv += ["-o", str(folder / "out.pb")]
    code, _ = run_cli(capsys, argv)
    event(f"exit {code}")


@settings(max_examples=12, **SETTINGS)
@given(budget=st.sampled_from([[], ["--budget=64MiB"], ["--budget=1GiB"], ["--budget=67108864.5"]]),
       passes=st.sampled_from([[], ["--passes=auto"], ["--passes=none"], ["--passes=partition,limit_parallelism"]]),
       fetch=st.sampled_from([[], ["--fetch=y:0"], ["--fetch=train", "--fetch=y:0"]]),
       place=st.sampled_from([[], ["--device=/GPU:0", "--host=/CPU:0"], ["--device=/CPU:0"]]))
def test_cli_with_valid_values_succeeds(budget: list[str], passes: list[str], fetch: list[str], place: list[str],
                                        folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["optimize", str(folder / "tiny.pb"), "-o", str(folder / "ok.pb"), f"--feed-shape={FEED}",
            *budget, *passes, *fetch, *place]
    assert run_cli(capsys, argv)[0] == cli.EXIT_OK, argv


# -- tfmem.optimize's arguments -------------------------------------------------------------------------------------

ANYTHING = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), TEXT,
                     st.lists(st.integers(-5, 5), max_size=3), st.binary(max_size=4))
BUDGETS = st.one_of(ANYTHING, st.integers(1, 2**40), st.floats(0, 2**40), SIZES)
SHAPES = st.one_of(ANYTHING, st.lists(st.one_of(st.integers(-3, 64), ANYTHING), max_size=3),
                   st.tuples(st.integers(0, 2**70), st.just(16)), st.just((4, 16)))
KEYS = st.one_of(st.sampled_from(["x:0", "x", "y:0", "x:1", "ghost", ""]), st.none(), st.integers(), TEXT)
FEED_DICTS = st.one_of(ANYTHING, st.dictionaries(KEYS, SHAPES, max_size=2))
PASS_ARGS = st.one_of(ANYTHING, st.sampled_from(["auto", "none", ",,,"]),
                      st.lists(st.one_of(st.sampled_from(sorted(PASSES)), ANYTHING), max_size=3))
FETCH_ARGS = st.one_of(ANYTHING, FETCHES, st.lists(st.one_of(FETCHES, ANYTHING), max_size=2))
DEVICE_ARGS = st.one_of(ANYTHING, DEVICES)


ARGUMENTS: dict[str, tuple[list[Any], st.SearchStrategy[Any]]] = {
    "budget": ([None, "64MiB", 2**30], BUDGETS),
    "feed_shapes": ([{"x:0": (4, 16)}, {"x": [4, 16]}], FEED_DICTS),
    "device": ([None, "/GPU:0", "/device:CPU:0"], DEVICE_ARGS),
    "host": ([None, "/device:CPU:1"], DEVICE_ARGS),
    "passes": (["auto", [], ["partition"]], PASS_ARGS),
    "inter_op_threads": ([None, 0, 2], st.one_of(ANYTHING, st.integers(-2, 4))),
    "fetches": (["y:0", ["train", "y:0"]], FETCH_ARGS),
}


@st.composite
def optimize_arguments(draw: st.DrawFn) -> dict[str, Any]:
    fuzzed = draw(st.permutations(sorted(ARGUMENTS)))[:draw(st.integers(1, 2))]
    return {name: draw(anything if name in fuzzed else st.sampled_from(valid))
            for name, (valid, anything) in ARGUMENTS.items()}


@settings(max_examples=500, **SETTINGS)
@given(kwargs=optimize_arguments())
def test_optimize_on_random_arguments(kwargs: dict[str, Any]) -> None:
    try:
        tfmem.optimize(TINY, **kwargs)
        event("optimized")
    except tfmem.TfmemError as e:
        event(type(e).__name__)
        assert str(e).strip() and "\n" not in str(e).strip()


@settings(max_examples=15, **SETTINGS)
@given(budget=st.sampled_from([None, "64MiB", 2**30, 64 * 2**20 + 0.5, "1.5GB"]),
       shape=st.sampled_from([(4, 16), [1, 16], (0, 16)]),
       place=st.sampled_from([{}, {"device": "/GPU:0", "host": "/CPU:0"}, {"device": "/CPU:0"}]),
       passes=st.sampled_from(["auto", [], None, ["partition"]]), threads=st.sampled_from([None, 0, 1, 4]),
       fetches=st.sampled_from(["y:0", ["train", "y:0"], [TINY.get_tensor_by_name("y:0")]]))
def test_optimize_with_valid_arguments_succeeds(budget: Any, shape: Any, place: dict[str, str], passes: Any,
                                                threads: Any, fetches: Any) -> None:
    opt = tfmem.optimize(TINY, fetches, budget=budget, feed_shapes={"x:0": shape}, passes=passes,
                         inter_op_threads=threads, **place)
    assert opt.report.after.peak_bytes <= (opt.report.budget_bytes or opt.report.before.peak_bytes)
