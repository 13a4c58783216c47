"""The max-size harness: its search finds the threshold exactly, and a --tiny run writes what it measured."""

from __future__ import annotations

import json

import pytest

import tfmem
from experiments import max_size, run_all


@pytest.mark.parametrize("start,maximum", [(1, 100), (2, 100), (16, 100), (64, 100), (100, 100)])
def test_search_finds_the_threshold_with_logarithmically_many_probes(start, maximum):
    for threshold in range(0, maximum + 3):
        tried: list[int] = []

        def fits(size: int, tried=tried, threshold=threshold) -> bool:
            tried.append(size)
            return size <= threshold

        lo, hi = max_size.search_largest(fits, start, 1, maximum)
        expected = min(threshold, maximum) if threshold >= 1 else None
        assert lo == expected
        assert hi == (threshold + 1 if threshold < maximum else None)
        assert all(1 <= s <= maximum for s in tried) and len(tried) <= 2 * maximum.bit_length() + 1


def test_search_stops_at_the_resolution():
    lo, hi = max_size.search_largest(lambda s: s <= 50, 8, 2, 1000, resolution=8)
    assert lo <= 50 < hi and hi - lo <= 8


def test_search_rejects_a_bad_range():
    with pytest.raises(tfmem.BadInputError, match="minimum <= start <= maximum"):
        max_size.search_largest(bool, 10, 1, 5)


def test_families_build_at_their_smallest_size():
    for family in max_size.families(tiny=True).values():
        built = family.build(family.minimum)
        assert built.params > 0 and built.feeds


def test_bad_command_lines_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        max_size.main(["nosuchfamily", "--out", str(tmp_path)])
    with pytest.raises(tfmem.BadInputError, match="key=value"):
        max_size.main(["moe", "--tiny", "--set", "width", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())
    (tmp_path / "other.json").write_text('{"rows": []}')
    with pytest.raises(SystemExit):
        max_size.main(["--render", str(tmp_path / "other.json")])
    with pytest.raises(SystemExit):
        max_size.main(["--render", str(tmp_path / "missing.json")])


@pytest.mark.slow
@pytest.mark.testbed
def test_tiny_moe_run_writes_both_sides(tmp_path):
    assert max_size.main(["moe", "--tiny", "--max-size", "4", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "max_size_moe.json").read_text())
    assert data["command"].endswith(f"moe --tiny --max-size 4 --out {tmp_path}")
    assert data["testbed_budget"] == "2MiB" and data["passes"] == "auto"
    vanilla = data["summary"]["vanilla"]
    assert vanilla["largest_experts"] == 4 and vanilla["device_peak_bytes"] <= 2 * 2**20
    assert vanilla["samples_per_s"] > 0
    probes = {(r["mode"], r["size"]): r for r in data["probes"]}
    assert {("vanilla", 2), ("vanilla", 4), ("tfmem", 4)} <= set(probes)   # tfmem may also try smaller sizes
    tuned = probes[("tfmem", 4)]
    assert tuned["status"] in ("ok", "refused")      # refused: no pass found a plan under the budget
    if tuned["status"] == "ok":
        assert data["summary"]["same_loss_at_vanilla_largest"] is True
        assert data["summary"]["ratio"] == 1.0
    assert "| vanilla | 4 |" in (tmp_path / "max_size_moe.md").read_text()
    assert not (tmp_path / "max_size_moe.partial.json").exists()   # the checkpoint goes once the search is done
    assert max_size.main(["--render", str(tmp_path / "max_size_moe.json")]) == 0   # recompute the summary only
    again = json.loads((tmp_path / "max_size_moe.json").read_text())
    assert again["probes"] == data["probes"] and again["command"] == data["command"]
    assert again["summary"]["vanilla"]["largest_experts"] == 4 and again["summary"]["vanilla"]["step_flops"] > 0


def test_run_all_finds_the_max_size_tables():
    assert {"max_experts", "max_resnet_depth", "deepspeech_seq_len", "max_size"} <= set(run_all.experiment_names())
    assert max_size.BENCH is False   # its families run once, through the three tables above


def test_a_table_module_passes_its_families_and_arguments_on(monkeypatch):
    from experiments import max_resnet_depth
    seen = []
    monkeypatch.setattr(max_size, "main", lambda argv, default_families: seen.append((argv, default_families)) or 0)
    assert max_resnet_depth.main(["--tiny"]) == 0
    assert seen == [(["--tiny"], ["resnet16", "resnet32"])]
