"""The ``tfmem`` command line: bad input is one ``tfmem: error:`` line and exit 2; the commands work on files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import text_format

import tfmem
from tfmem import cli
from tfmem.examples import mlp, wide_branches

BATCH, DIMS = 16, (32, 64, 10)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small MLP training graph (binary, text, MetaGraphDef), a graph with an unknown batch, and a non-graph."""
    d = tmp_path_factory.mktemp("graphs")
    built = mlp(batch=BATCH, dims=DIMS)
    tf.io.write_graph(built.graph, str(d), "mlp.pb", as_text=False)
    tf.io.write_graph(built.graph, str(d), "mlp.pbtxt", as_text=True)
    with built.graph.as_default():  # export_meta_graph refuses to run eagerly, outside a graph
        tf.compat.v1.train.export_meta_graph(str(d / "meta.pb"), graph=built.graph)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (None, 8), name="x")
        tf.reduce_sum(tf.nn.relu(x), name="y")
    tf.io.write_graph(g, str(d), "unknown.pb", as_text=False)
    (d / "junk.pb").write_bytes(b"this is not a graph\n")
    (d / "empty.pb").write_bytes(b"")
    (d / "random.pb").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    data = (d / "mlp.pb").read_bytes()
    (d / "truncated.pb").write_bytes(data[: len(data) // 2])
    (d / "folder.pb").mkdir()
    return {p.stem if p.suffix == ".pb" else p.name: p for p in d.iterdir()}


def run_cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(code: int, err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert code == cli.EXIT_BAD_INPUT, err
    assert len(lines) == 1, err
    assert lines[0].startswith("tfmem: error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0]


# -- bad input --------------------------------------------------------------------------------------------

BAD_INPUTS = {
    "missing file": (["analyze", "{missing}"], ["does not exist"]),
    "not a graph": (["analyze", "{junk}"], ["is not a TensorFlow graph"]),
    "unknown shapes": (["analyze", "{unknown}"], ["sizes unknown", "x:0", "--feed-shape"]),
    "malformed budget": (["optimize", "{mlp}", "-o", "{tmp}/o.pb", "--budget", "lots"], ["--budget", "lots"]),
    "malformed testbed size": (["run", "{mlp}", "--testbed", "1QiB"], ["--testbed"]),
    "malformed device memory": (["analyze", "{mlp}", "--device-memory", "-3"], ["--device-memory"]),
    "malformed feed shape": (["analyze", "{mlp}", "--feed-shape", "x:0=a,b"], ["x:0=a,b"]),
    "feed shape without '='": (["analyze", "{mlp}", "--feed-shape", "x:0"], ["feed shape"]),
    "unknown fetch tensor": (["analyze", "{mlp}", "--fetch", "nope:0"], ["nope:0"]),
    "unknown fetch op": (["optimize", "{mlp}", "-o", "{tmp}/o.pb", "--fetch", "nope"], ["nope"]),
    "unknown pass": (["optimize", "{mlp}", "-o", "{tmp}/o.pb", "--passes", "no_such_pass"], ["no_such_pass"]),
    "infeasible budget": (["optimize", "{mlp}", "-o", "{tmp}/o.pb", "--budget", "1KiB"], ["unreachable",
                                                                                          "lower bound"]),
    "unwritable output": (["optimize", "{mlp}", "-o", "{tmp}/no/such/dir/o.pb"], ["cannot write"]),
    "steps below 1": (["run", "{mlp}", "--testbed", "64MiB", "--steps", "0"], ["--steps"]),
    "no command": ([], ["required"]),
    "unknown command": (["shrink", "{mlp}"], ["invalid choice"]),
    "missing -o": (["optimize", "{mlp}"], ["-o/--output"]),
    "missing --testbed": (["run", "{mlp}"], ["--testbed"]),
    "non-integer --steps": (["run", "{mlp}", "--testbed", "1GiB", "--steps", "many"], ["--steps"]),
    "unknown option": (["analyze", "{mlp}", "--colour"], ["--colour"]),
    # issue 38: each of these was an internal error (exit 1), or silently did nothing
    "budget beyond any machine": (["optimize", "{mlp}", "-o", "{tmp}/o.pb", "--budget", "1e400"],
                                  ["--budget", "'1e400'", "2**62", "'16GiB'"]),
    "zero budget": (["optimize", "{mlp}", "-o", "{tmp}/o.pb", "--budget", "0"], ["--budget", "positive"]),
    "budget nan": (["optimize", "{mlp}", "-o", "{tmp}/o.pb", "--budget", "nan"], ["--budget", "'nan'"]),
    "device memory beyond any machine": (["analyze", "{mlp}", "--device-memory", "1e30"], ["--device-memory", "2**62"]),
    "zero device memory": (["analyze", "{mlp}", "--device-memory", "0"], ["--device-memory", "positive"]),
    "zero testbed": (["run", "{mlp}", "--testbed", "0"], ["--testbed", "positive"]),
    "testbed under 1 MiB": (["run", "{mlp}", "--testbed", "1KiB"], ["--testbed must be at least 1MiB", "64MiB"]),
    "passes of commas only": (["optimize", "{mlp}", "-o", "{tmp}/o.pb", "--passes", ",,,"],
                              ["--passes ',,,' has an empty pass name", "partition", "'none'"]),
    "empty passes": (["optimize", "{mlp}", "-o", "{tmp}/o.pb", "--passes", ""], ["empty pass name"]),
    "passes with a gap": (["optimize", "{mlp}", "-o", "{tmp}/o.pb", "--passes", "partition,,recompute"],
                          ["empty pass name"]),
    "negative inter-op threads": (["run", "{mlp}", "--testbed", "64MiB", "--inter-op-threads", "-1"],
                                  ["--inter-op-threads", "from 0 to 4096"]),
    "negative steps": (["run", "{mlp}", "--testbed", "64MiB", "--steps", "-3"], ["--steps"]),
    "feed shape of the wrong rank": (["analyze", "{mlp}", "--feed-shape", "x:0="],
                                     ["does not fit its declared shape", "--feed-shape x:0=16,32"]),
    "feed shape without a name": (["analyze", "{mlp}", "--feed-shape", "=3"], ["no tensor name"]),
    "negative feed dimension": (["analyze", "{mlp}", "--feed-shape", "x:0=-1"], ["negative"]),
    "feed shape with a gap": (["analyze", "{mlp}", "--feed-shape", "x:0=16,,32"], ["dimension 1 is ''"]),
    "feed shape beyond any machine": (["analyze", "{mlp}", "--feed-shape", "x:0=99999999999999999999,32"],
                                      ["2**62 elements"]),
    "malformed device": (["analyze", "{mlp}", "--device", "@@"], ["--device '@@' is not a device string",
                                                                  "'/GPU:0'"]),
    "malformed host": (["optimize", "{mlp}", "-o", "{tmp}/o.pb", "--device", "/GPU:0", "--host", "not a device"],
                       ["--host 'not a device'"]),
    "host that is the device": (["optimize", "{mlp}", "-o", "{tmp}/o.pb", "--device", "/GPU:0", "--host", "/GPU:0"],
                                ["can name the same device"]),
    "fetch with a bad index": (["analyze", "{mlp}", "--fetch", "loss:-1"], ["write NODE:INDEX", "'loss:0'"]),
    "fetch index out of range": (["analyze", "{mlp}", "--fetch", "loss:3"], ["has 1 output(s); fetch loss:0"]),
    "graph is a directory": (["analyze", "{folder}"], ["is not a file"]),
    "empty graph file": (["analyze", "{empty}"], ["is not a TensorFlow graph"]),
    "random bytes": (["analyze", "{random}"], ["is not a TensorFlow graph"]),
    "truncated graph": (["optimize", "{truncated}", "-o", "{tmp}/o.pb"], ["is not a TensorFlow graph"]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(case: str, files: dict[str, Path], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    argv, fragments = BAD_INPUTS[case]
    paths = {k: str(v) for k, v in files.items()} | {"missing": str(tmp_path / "missing.pb"), "tmp": str(tmp_path)}
    code, out, err = run_cli(capsys, *(a.format(**paths) for a in argv))
    assert_one_error_line(code, err, *fragments)
    if argv[:1] == ["run"]:
        assert "starting the testbed" not in out   # refused before any work


def test_the_fixes_the_messages_suggest_work(files: dict[str, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "analyze", files["mlp"], "--feed-shape", "x:0=16,31")
    fix = err.split("(CLI: --feed-shape ")[1].split(")")[0]
    assert code == cli.EXIT_BAD_INPUT and fix == "x:0=16,32"
    code, out, err = run_cli(capsys, "analyze", files["mlp"], "--feed-shape", fix)
    assert code == 0 and "device peak" in out, err
    code, out, err = run_cli(capsys, "optimize", files["mlp"], "-o", tmp_path / "o.pb", "--passes", "none")
    assert code == 0 and "wrote" in out, err
    code, _, err = run_cli(capsys, "analyze", files["mlp"], "--fetch", "loss:0", "--device", "/GPU:0",
                           "--host", "/CPU:0")
    assert code == 0, err


def test_unknown_shape_error_lists_every_unknown_tensor(files: dict[str, Path],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "analyze", files["unknown"])
    assert_one_error_line(code, err, "x:0 (?, 8)", "Relu:0 (?, 8)")


def test_internal_errors_say_so_and_exit_1(monkeypatch: pytest.MonkeyPatch, files: dict[str, Path],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(tfmem, "unoptimized_profile", broken)
    code, _, err = run_cli(capsys, "analyze", files["mlp"])
    assert code == cli.EXIT_INTERNAL
    assert err.strip().splitlines() == ["tfmem: error: internal error: RuntimeError: boom (rerun with --traceback "
                                        "and report it)"]


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and "analyze" in out and "optimize" in out and "run" in out


def test_no_traceback_escapes_a_real_process(files: dict[str, Path]) -> None:
    # TensorFlow reads its log settings when first imported, and importing tfmem.cli imports the tfmem package
    # (which imports TensorFlow) before cli.py can set them; so set them here, as a shell user would.
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}
    proc = subprocess.run([sys.executable, "-m", "tfmem.cli", "analyze", str(files["junk"])], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout == ""
    assert_one_error_line(proc.returncode, proc.stderr, "is not a TensorFlow graph")


# -- the commands -----------------------------------------------------------------------------------------


def test_default_fetches_are_the_sinks_that_are_not_bookkeeping() -> None:
    built = mlp(batch=BATCH, dims=DIMS)
    with built.graph.as_default():
        tf.compat.v1.train.Saver()  # adds a save/ scope whose ops are sinks too
        tf.compat.v1.global_variables_initializer()
    assert cli.default_fetches(tfmem.load(built.graph)) == ["loss:0", "train_op"]


def test_a_read_after_an_update_others_run_is_not_a_default_fetch() -> None:
    """tf_keras reads each batch-norm moving average after updating it; the step runs the updates already."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (4,), name="x")
        kept = tf.Variable(tf.zeros(()), name="kept")   # updated by the step, read after: bookkeeping
        alone = tf.Variable(tf.zeros(()), name="alone")  # updated by nothing else: its read is what runs it
        update = kept.assign_sub(tf.reduce_mean(x), read_value=False)
        with tf.control_dependencies([update]):   # as tf_keras builds it: a bare read waiting on the update
            tf.raw_ops.ReadVariableOp(resource=kept.handle, dtype=tf.float32, name="kept_read")
            tf.identity(tf.reduce_sum(x), name="loss")
        with tf.control_dependencies([alone.assign_add(1.0, read_value=False)]):
            tf.raw_ops.ReadVariableOp(resource=alone.handle, dtype=tf.float32, name="alone_read")
    fetches = cli.default_fetches(tfmem.load(g))
    assert "loss:0" in fetches and "alone_read:0" in fetches and "kept_read:0" not in fetches


def test_a_long_list_of_fetches_is_said_briefly(capsys: pytest.CaptureFixture[str]) -> None:
    cli._say_fetches([f"t{i}:0" for i in range(20)], assumed=True)
    line = capsys.readouterr().out
    assert "t7:0" in line and "t8:0" not in line and "and 12 more" in line


@pytest.mark.parametrize("name", ["mlp", "mlp.pbtxt", "meta"])
def test_analyze_prints_both_instruments_and_the_peak(name: str, files: dict[str, Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "analyze", files[name])
    assert code == 0, err
    assert "fetches (assumed: the graph's sinks; choose with --fetch): loss:0, train_op" in out
    for text in ("simulator", "Grappler estimate (virtual GPU, 12.00 GiB)", "persistent", "transient",
                 "largest tensors live there", "dense1/w:0"):
        assert text in out


def test_analyze_json_agrees_with_the_library(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "analyze", files["mlp"], "--fetch", "loss:0", "--device-memory", "16GiB",
                           "--json")
    result = json.loads(out)
    expected = tfmem.unoptimized_profile(str(files["mlp"]), ["loss:0"])
    assert code == 0 and result["fetches"] == ["loss:0"] and not result["fetches_assumed"]
    assert result["simulator"]["peak_bytes"] == expected.peak_bytes
    sim = result["simulator"]
    assert sim["persistent_bytes"] + sim["transient_bytes"] == sim["peak_bytes"]
    assert result["grappler"]["virtual_gpu_memory_bytes"] == 16 * 2**30 and result["grappler"]["peak_bytes"] > 0
    assert result["ops"] > result["ops_per_step"] > 0
    assert result["live_at_peak"][0]["nbytes"] == max(t.nbytes for t in expected.live_at_peak)


def test_analyze_and_optimize_report_one_vanilla_peak(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``analyze`` simulates the graph as ``optimize`` simulates its "before": with the session's threads."""
    built = wide_branches()  # its peak depends on how many ops run side by side
    tf.io.write_graph(built.graph, str(tmp_path), "wide.pb", as_text=False)
    fetches = [a for f in built.fetches for a in ("--fetch", f)]
    peaks = {}
    for threads in (1, 2):
        code, out, _ = run_cli(capsys, "analyze", tmp_path / "wide.pb", "--json", "--inter-op-threads", threads,
                               *fetches)
        before = tfmem.optimize(built.graph, built.fetches, passes=None, inter_op_threads=threads).report.before
        peaks[threads] = json.loads(out)["simulator"]["peak_bytes"]
        assert code == 0 and peaks[threads] == before.peak_bytes
    assert peaks[1] != peaks[2]


def test_feed_shape_fills_an_unknown_batch(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "analyze", files["unknown"], "--feed-shape", "x:0=4,8", "--json")
    assert code == 0 and json.loads(out)["fetches"] == ["y:0"]


@pytest.mark.parametrize(("source", "output"), [("mlp", "opt.pb"), ("mlp.pbtxt", "opt.pbtxt")])
def test_optimize_writes_a_graph_that_loads_back(source: str, output: str, files: dict[str, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / output
    code, stdout, err = run_cli(capsys, "optimize", files[source], "-o", out, "--budget", "1GiB",
                                "--report", tmp_path / "r.md", "--plot", tmp_path / "m.png",
                                "--trace", tmp_path / "t.json")
    assert code == 0, err
    gd = tf.compat.v1.GraphDef()
    if output.endswith(".pbtxt"):
        text_format.Parse(out.read_text(), gd)
    else:
        gd.ParseFromString(out.read_bytes())
    names = {n.name for n in gd.node}
    assert {"loss", "train_op", "x", "labels"} <= names
    assert "### tfmem report (device budget: 1.00 GiB)" in stdout
    assert (tmp_path / "r.md").read_text().startswith("### tfmem report")
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "traceEvents" in json.loads((tmp_path / "t.json").read_text())


def test_random_feeds_are_typed_shaped_and_reproducible(files: dict[str, Path]) -> None:
    ir = tfmem.load(str(files["mlp"]))
    feeds = cli.random_feeds(ir, ["loss:0"])
    assert {k: (v.dtype, v.shape) for k, v in feeds.items()} == {
        "x:0": (np.float32, (BATCH, DIMS[0])), "labels:0": (np.int32, (BATCH,))}
    assert set(np.unique(feeds["labels:0"])) <= {0, 1}
    assert all(np.array_equal(v, cli.random_feeds(ir, ["loss:0"])[k]) for k, v in feeds.items())


@pytest.mark.testbed
def test_run_on_the_testbed(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "run", files["mlp"], "--testbed", "64MiB", "--steps", "2")
    assert code == 0, err
    assert "device peak" in out and "(testbed, measured" in out and "step time" in out
    assert "loss:0 = " in out and "OUT OF MEMORY" not in out


def test_run_reports_out_of_memory_with_exit_3(monkeypatch: pytest.MonkeyPatch, files: dict[str, Path],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import tfmem.testbed

    class OutOfMemory:  # stands in for the servers: what matters here is how the CLI reports an OOM
        def __init__(self, cap: int, **kwargs: object) -> None:
            self.cap = cap

        def __enter__(self) -> OutOfMemory:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def run(self, *args: object, **kwargs: object) -> tfmem.testbed.RunResult:
            return tfmem.testbed.RunResult(True, "ResourceExhaustedError: OOM when allocating", None, None, None)

    monkeypatch.setattr(tfmem.testbed, "Testbed", OutOfMemory)
    code, out, err = run_cli(capsys, "run", files["mlp"], "--testbed", "1MiB")
    assert code == cli.EXIT_OOM and err == ""
    assert "OUT OF MEMORY on the testbed device (cap 1.00 MiB): ResourceExhaustedError" in out


def test_optimize_prints_the_session_config_to_run_with(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A GraphDef cannot carry the thread pool a kept graph needs: the CLI prints the config to run it with."""
    built = wide_branches()
    tf.io.write_graph(built.graph, str(tmp_path), "wide.pb", as_text=False)
    one, two = (tfmem.simulate(built.graph, built.fetches, inter_op_threads=t).peak_bytes for t in (1, 2))
    budget = (one + two) // 2
    code, stdout, err = run_cli(capsys, "optimize", tmp_path / "wide.pb", "-o", tmp_path / "o.pb",
                                "--budget", budget, "--inter-op-threads", 2,
                                *(a for f in built.fetches for a in ("--fetch", f)))
    assert code == 0, err
    assert "run it with this session config (tf.compat.v1.ConfigProto): inter_op_parallelism_threads: 1" in stdout


def _two_machine_file(tmp_path: Path) -> Path:
    g = tf.Graph()
    with g.as_default():
        h = tf.compat.v1.placeholder(tf.float32, (64, 256), name="x")
        for m in range(2):
            with tf.device(f"/job:worker/replica:0/task:{m}/device:CPU:0"):
                w = tf.compat.v1.get_variable(f"w{m}", (256, 256), use_resource=True)
                h = tf.matmul(h, w)
        tf.reduce_sum(h, name="y")
    tf.io.write_graph(g, str(tmp_path), "two.pb", as_text=False)
    return tmp_path / "two.pb"


def test_optimize_plans_each_device_host_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pairs = [f"/job:worker/replica:0/task:{m}/device:CPU:0=/job:host/replica:0/task:{m}/device:CPU:0"
             for m in range(2)]
    code, stdout, err = run_cli(capsys, "optimize", _two_machine_file(tmp_path), "-o", tmp_path / "o.pb",
                                "--fetch", "y:0", "--budget", "64MiB",
                                *(a for p in pairs for a in ("--device-host", p)))
    assert code == 0, err
    assert "**Per device**" in stdout and "| /job:worker/replica:0/task:1/device:CPU:0 |" in stdout


@pytest.mark.parametrize("extra, fragment", [
    (["--device-host", "/job:worker/task:0"], "must be DEVICE=HOST"),
    (["--device-host", "/job:worker/task:0=/job:host/task:0", "--device", "/job:worker/task:0"], "not both"),
    (["--device-host", "/job:worker/task:0=/job:host/task:0", "--device-host",
      "/job:worker/task:0=/job:host/task:1"], "twice"),
])
def test_optimize_rejects_bad_device_hosts(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str],
                                           fragment: str) -> None:
    code, _, err = run_cli(capsys, "optimize", _two_machine_file(tmp_path), "-o", tmp_path / "o.pb",
                           "--fetch", "y:0", "--budget", "64MiB", *extra)
    assert_one_error_line(code, err, fragment)
    assert not (tmp_path / "o.pb").exists()
