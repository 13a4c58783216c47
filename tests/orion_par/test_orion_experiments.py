"""The experiments run end to end at --tiny size and write their json, markdown and plot."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments import lda_convergence, mf_convergence, mf_scaling


def test_mf_convergence_tiny(tmp_path):
    assert mf_convergence.main(["--tiny", "--no-ray", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "mf_convergence.json").read_text())
    assert {"serial", "orion_par 1w", "orion_par 2w", "surprise SVD"} <= set(res["curves"])
    serial = res["curves"]["serial"]["rmse"]
    assert serial[-1] < serial[0]
    assert res["checks"]["orion_par_1w_bitwise_equals_serial"] is True
    assert res["curves"]["orion_par 1w"]["rmse"] == serial
    study = res["shuffle_study"][0]
    assert len(study["rmse_serial"]) == len(study["rmse_orion_par_2w"]) == 2  # two orders, both methods
    assert len(study["rmse_serial_other_orders"]) == 2  # the serial-vs-serial yardstick: two other orders
    # DSGD's visit order run by the serial loop is what 2 workers compute, bitwise.
    assert study["orion_par_2w_equals_serial_loop_in_its_visit_order"] == [True, True]
    gap = np.abs(np.array(study["mean_rmse_orion_par_2w"]) - study["mean_rmse_serial"])[1:] / study["mean_rmse_serial"][1:]
    assert np.allclose(gap, study["gap_of_means_per_epoch"])
    assert res["checks"]["rmse_within_1pct[lr=0.03]"] == (max(gap) <= 0.01)
    assert res["command"].startswith("python -m experiments.mf_convergence")
    assert (tmp_path / "mf_convergence.md").read_text().startswith("# mf_convergence")
    assert (tmp_path / "mf_convergence.png").stat().st_size > 0


def test_mf_throughput_only_tiny(tmp_path):
    assert mf_convergence.main(["--tiny", "--throughput-only", "--repeats", "3", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "mf_throughput.json").read_text())
    assert len(res["throughput"]["orion_par_2w"]["times_s"]) == 3 and len(res["throughput"]["loadavg_1min"]) == 4
    assert (tmp_path / "mf_throughput.md").read_text().startswith("# mf_throughput")


def test_mf_scaling_tiny(tmp_path):
    assert mf_scaling.main(["--tiny", "--workers", "1,2,3", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "mf_scaling.json").read_text())
    assert [r["workers"] for r in res["rows"]] == [1, 2, 3]
    assert all(len(r["times_s"]) == 2 and r["ratings_per_s"] > 0 for r in res["rows"])
    assert res["rows"][0]["speedup_median"] == 1.0
    assert (tmp_path / "mf_scaling.md").read_text().startswith("# mf_scaling")


def test_mf_scaling_default_workers_and_bad_input(capsys):
    assert mf_scaling.default_workers(16) == [1, 2, 4, 8, 16]
    assert mf_scaling.default_workers(6) == [1, 2, 4, 6]
    for bad in (["--workers", "two"], ["--workers", "0,2"]):
        try:
            mf_scaling.main(["--tiny", *bad])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"{bad} was accepted")
    assert "--workers takes" in capsys.readouterr().err


def test_lda_convergence_tiny(tmp_path):
    assert lda_convergence.main(["--tiny", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "lda_convergence.json").read_text())
    assert {"serial", "orion_par 1w", "orion_par 2w", "tomotopy"} <= set(res["curves"])
    assert all(len(chains) == 2 for chains in res["curves"].values())  # two chains per method
    ll = res["curves"]["orion_par 2w"][0]["ll"]
    assert ll[-1] > ll[0]
    assert res["checks"]["orion_par_1w_equals_serial_same_seeds[3 sweeps]"] is True
    s = res["summary"]
    gap = abs(s["orion_par 2w"]["mean"] - s["serial"]["mean"]) / abs(s["serial"]["mean"])
    assert res["checks"]["final_ll_gap_of_means_vs_serial[orion_par 2w]"] == gap
    assert "final_ll_within_1pct" in res["checks"] and "within_2x_of_tomotopy" in res["checks"]
    assert (tmp_path / "lda_convergence.png").stat().st_size > 0


def test_lda_throughput_only_tiny(tmp_path):
    assert lda_convergence.main(["--tiny", "--throughput-only", "--repeats", "2", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "lda_throughput.json").read_text())
    t = res["throughput"][0]
    assert len(t["orion_par_2w"]["times_s"]) == 2 and len(t["loadavg_1min"]) == 3
    assert "within_2x_of_tomotopy" in res["checks"]


@pytest.mark.slow
def test_elastic_tiny(tmp_path):
    from experiments import elastic

    assert elastic.main(["--tiny", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "elastic.json").read_text())
    assert len(res["parts"]) == 2  # orion_par and the parameter server
    for part in res["parts"].values():
        assert set(part["fixed"]) == {"1", "2"}
        assert part["autoscaler"]["events"], "the autoscaler never resized"
        replay = part["restart_replay"]
        assert replay["same_allocations"] and replay["bitwise_equal_to_elastic"]
        assert all(e["idle_s"] > 0 for e in replay["events"])
        assert "idle_ratio" in part["verdicts"]
    assert (tmp_path / "elastic.md").read_text().startswith("# Elastic workers")
