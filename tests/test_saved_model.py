"""``tfmem optimize SAVED_MODEL_DIR --function NAME``: a SavedModel's training step planned by the CLI trains on
the loaded variables exactly as the original (issue "TensorFlow 2", item 6)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf

from tfmem import cli
from tfmem.saved_model import optimize_saved_model

ROOT = Path(__file__).resolve().parents[1]
BUDGET = "42MiB"   # the step's simulated peak is about 48 MiB (tests/saved_model_cases.py: 8 layers of 256, batch 4096)
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}


def _python(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def _case(*argv: str) -> dict:
    done = _python("-m", "tests.saved_model_cases", *argv)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("saved") / "trainer"
    _case("build", str(path))
    return path


@pytest.fixture(scope="module")
def planned(saved: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("planned") / "trainer"
    done = _python("-m", "tfmem", "optimize", str(saved), "--function", "train_step", "--budget", BUDGET,
                   "--logical-cpus", "2", "--device", "/CPU:0", "--host", "/CPU:1", "-o", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == ""
    return out, done.stdout


def _peaks(stdout: str) -> tuple[str, str]:
    row = re.search(r"^\| device peak \| ([\d.]+ \w+) \| ([\d.]+ \w+) \| simulator \|$", stdout, re.M)
    assert row, stdout
    return row.group(1), row.group(2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_cli_writes_a_saved_model_whose_step_is_planned_below_its_peak(planned: tuple[Path, str]) -> None:
    out, stdout = planned
    assert stdout.startswith(f"wrote {out} (a SavedModel whose train_step runs the plan")
    assert "train_step(x: float32[4096, 128], y: int32[4096]):" in stdout
    assert "### tfmem report (device budget: 42.00 MiB)" in stdout
    before, after = (_to_bytes(p) for p in _peaks(stdout))
    assert after <= 42 * 2**20 < before
    assert (out / "saved_model.pb").is_file() and (out / "variables").is_dir()


def _to_bytes(text: str) -> float:
    from tfmem.units import parse_bytes

    return parse_bytes(text.replace(" ", ""), what="a report figure")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_planned_saved_model_trains_bit_identically_on_the_loaded_variables(
        saved: Path, planned: tuple[Path, str]) -> None:
    out, stdout = planned
    r = _case("train", str(saved), str(out), "3")
    assert r["same_losses"] and r["same_state"] and r["state_changed"]   # 3 steps: losses, weights, Adam's slots
    assert r["variables"] > 20
    # the loaded step is the plan, not the original: its graph has the plan's ops and simulates to its peak
    assert r["planned_tfmem_ops"] > 0 and r["source_tfmem_ops"] == 0
    assert r["planned_peak"] <= 42 * 2**20 < r["source_peak"]
    assert r["planned_signatures"] == r["source_signatures"] == ["serving_default"]   # the others are kept


# -- bad input: one line, exit 2 -------------------------------------------------------------------------------

def _run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(code: int, err: str, *fragments: str) -> str:
    lines = err.strip().splitlines()
    assert code == cli.EXIT_BAD_INPUT and len(lines) == 1 and lines[0].startswith("tfmem: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


BAD = {
    "missing directory": (["{tmp}/nope", "--function", "train_step"], ["'{tmp}/nope'", "does not exist"]),
    "not a SavedModel": (["{tmp}", "--function", "train_step"], ["is not a SavedModel directory",
                                                                  "tf.saved_model.save"]),
    "no --function": (["{saved}"], ["is a SavedModel", "--function NAME", "train_step", "serving_default"]),
    "no such function": (["{saved}", "--function", "nope"], ["no function 'nope'", "predict, train_step",
                                                             "serving_default (signature)"]),
    "unknown batch": (["{saved}", "--function", "predict"], ["unknown shape", "(x: float32[None, 128])",
                                                             "input_signature"]),
    "never traced": (["{saved}", "--function", "untraced"], ["without a concrete function", "input_signature"]),
    "XLA": (["{saved}", "--function", "xla_step"], ["jit_compile=False"]),
    "output not empty": (["{saved}", "--function", "train_step", "-o", "{saved}"], ["exists and is not an empty",
                                                                                     "choose another -o"]),
    "missing host": (["{saved}", "--function", "train_step", "--host", "/CPU:1"], ["--host='/CPU:1'",
                                                                                   "--logical-cpus 2"]),
    "fetch": (["{saved}", "--function", "train_step", "--fetch", "loss:0"], ["--fetch does not apply"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_and_exit_2(case: str, saved: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    argv, fragments = BAD[case]
    paths = {"saved": str(saved), "tmp": str(tmp_path)}
    argv = [a.format(**paths) for a in argv]
    if "-o" not in argv:
        argv += ["-o", str(tmp_path / "out")]
    code, out, err = _run(capsys, "optimize", *argv, "--budget", "1GiB")
    _one_error_line(code, err, *(f.format(**paths) for f in fragments))
    assert out == "" and not (tmp_path / "out").exists()


def test_logical_cpus_is_for_saved_models(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tfmem.examples import mlp

    tf.io.write_graph(mlp(batch=4, dims=(8, 4)).graph, str(tmp_path), "g.pb", as_text=False)
    code, _, err = _run(capsys, "optimize", tmp_path / "g.pb", "-o", tmp_path / "o.pb", "--logical-cpus", "2")
    _one_error_line(code, err, "--logical-cpus applies to a SavedModel")


def _tiny(path: Path, batch: int | None) -> None:
    module = tf.Module()
    module.w = tf.Variable(tf.ones((64, 64)))

    @tf.function(input_signature=[tf.TensorSpec((batch, 64), tf.float32)])
    def step(x: tf.Tensor) -> dict[str, tf.Tensor]:
        module.w.assign_sub(0.001 * tf.matmul(x, tf.nn.relu(tf.matmul(x, module.w)), transpose_a=True))
        return {"total": tf.reduce_sum(module.w)}

    module.step = step
    tf.saved_model.save(module, str(path), signatures={"train": step})


def test_the_fix_for_an_unknown_batch_works_for_an_attribute_and_a_signature(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Saved with the batch size given, as the error says, the function plans; a signature does too, and the
    source's other attributes and signatures are saved with it."""
    _tiny(tmp_path / "any_batch", None)
    code, _, err = _run(capsys, "optimize", tmp_path / "any_batch", "--function", "step", "--budget", "1GiB",
                        "-o", tmp_path / "out")
    _one_error_line(code, err, "unknown shape", "input_signature")
    _tiny(tmp_path / "fixed", 32)
    x = tf.ones((32, 64)) / 64
    source = tf.saved_model.load(str(tmp_path / "fixed"))   # kept: a function does not keep its variables alive
    expected = source.step(x)["total"].numpy()
    code, out, err = _run(capsys, "optimize", tmp_path / "fixed", "--function", "step", "--budget", "1GiB",
                          "-o", tmp_path / "attribute")
    assert code == 0 and "step(x: float32[32, 64]):" in out, err
    result = optimize_saved_model(tmp_path / "fixed", "train", tmp_path / "signature", budget="1GiB")
    assert result.signatures == ("(x: float32[32, 64])",) and len(result.reports) == 1
    for name in ("attribute", "signature"):
        loaded = tf.saved_model.load(str(tmp_path / name))
        assert loaded.step(x)["total"].numpy() == expected
        assert loaded.signatures["train"](x=x)["total"].numpy() < expected   # the same variable, updated again
