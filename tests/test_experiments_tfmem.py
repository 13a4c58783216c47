"""Smoke runs (--tiny) of the tfmem experiments: they run, write both results files, and say what they measured."""

from __future__ import annotations

import json

import pytest

from experiments import optimize_speed, partition_parallelism, run_all


@pytest.mark.testbed
def test_partition_parallelism_tiny(tmp_path, capsys):
    assert partition_parallelism.main(["--tiny", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "partition_parallelism.json").read_text())
    assert data["command"].endswith("--tiny --out " + str(tmp_path)) and data["rows"]
    row = data["rows"][0]
    assert row["outputs_identical"] and row["tfmem_peak_bytes"] <= row["vanilla_peak_bytes"]
    assert "| wide-16 | 8 |" in (tmp_path / "partition_parallelism.md").read_text()


def test_optimize_speed_tiny(tmp_path):
    assert optimize_speed.main(["--tiny", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "optimize_speed.json").read_text())
    assert data["nodes"] > 1000 and data["optimize_s"] > 0


def test_run_all_finds_the_experiments():
    names = run_all.experiment_names()
    assert {"partition_parallelism", "optimize_speed"} <= set(names) and "run_all" not in names
