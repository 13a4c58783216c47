"""Smoke runs (--tiny) of the per-model tables of issue 6: peak_memory and baselines.

Each writes both results files with provenance; every row that ran under the budget fetched vanilla's values.
"""

from __future__ import annotations

import json

import pytest

from experiments import baselines, peak_memory, run_all

PROVENANCE = {"command", "date", "versions", "machine", "load_before", "load_after"}


def _check_run(row: dict) -> None:
    """A row that ran within its budget: a measured peak under the budget, a step time, vanilla's outputs."""
    assert row["peak_bytes"] > 0 and row["step_s"] > 0
    assert row["outputs_equal_vanilla"] is True and row["max_relative_difference"] == 0.0


@pytest.mark.slow
@pytest.mark.testbed
def test_peak_memory_tiny(tmp_path):
    assert peak_memory.main(["--tiny", "--steps", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "peak_memory_tiny.json").read_text())
    assert PROVENANCE <= set(data["provenance"]) and "testbed_budget" in data
    (model,) = data["models"].values()
    assert model["fraction"] == 0.8
    budget = model["budget_bytes"]
    assert list(model["rows"]) == ["vanilla", "+partition", "+placement", "+swap", "auto"]
    assert model["vanilla_roomy"]["gpu_estimate"]["gpu"].startswith("V100")
    assert model["rows"]["vanilla"]["oom"]  # the budget is below vanilla's peak
    for label in ("+partition", "+placement", "+swap", "auto"):
        row = model["rows"][label]
        if "refused" in row:
            assert row["lower_bound_bytes"] > 0 and "unreachable" in row["refused"]
            continue
        assert not row["oom"], row["error"]
        _check_run(row)
        assert row["peak_bytes"] <= budget and row["gpu_estimate"]["low_s"] <= row["gpu_estimate"]["high_s"]
    assert "refused" not in model["rows"]["auto"]  # the planner fits the MLP at 0.8x
    assert "| mlp-small (" in (tmp_path / "peak_memory_tiny.md").read_text()


@pytest.mark.slow
@pytest.mark.testbed
def test_baselines_tiny(tmp_path):
    assert baselines.main(["--tiny", "--steps", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "baselines_tiny.json").read_text())
    assert PROVENANCE <= set(data["provenance"]) and data["budgets_from"] is None
    (model,) = data["models"].values()
    rows = model["rows"]
    assert list(rows) == [*baselines.TF_SETTINGS, baselines.TFMEM]
    assert rows["TF default (= vanilla)"]["oom"]  # the budget is below vanilla's peak
    _check_run(rows["TF default (= vanilla)"]["roomy"])  # --tiny runs only vanilla roomy
    for label in baselines.TF_SETTINGS:  # a setting either ran out of memory or fetched vanilla's values
        assert rows[label]["oom"] or rows[label]["outputs_equal_vanilla"]
    tfmem_row = rows[baselines.TFMEM]
    assert tfmem_row["passes"] == "auto" and not tfmem_row["oom"]  # the planner fits the MLP at 0.8x
    _check_run(tfmem_row)
    assert tfmem_row["peak_bytes"] <= model["budget_bytes"]
    assert "| mlp-small (" in (tmp_path / "baselines_tiny.md").read_text()


def test_budgets_from_reads_peak_memory_results(tmp_path):
    path = tmp_path / "peak_memory.json"
    models = {"resnet": {"fraction": 0.7, "budget_bytes": 80 << 20}, "deepspeech": {"fraction": 0.7, "budget_bytes": 1},
              "failed": {"fraction": 0.7}}
    path.write_text(json.dumps({"models": models}))
    assert baselines.budgets_from(path, None) == {"resnet": 80 << 20}  # deepspeech's default fraction is lower
    assert baselines.budgets_from(path, 0.7) == {"resnet": 80 << 20, "deepspeech": 1}
    assert baselines.budgets_from(path, 0.5) == {} and baselines.budgets_from(tmp_path / "none.json", None) == {}


def test_run_all_finds_the_tables():
    assert {"peak_memory", "baselines"} <= set(run_all.experiment_names())
