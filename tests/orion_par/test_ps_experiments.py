"""The parameter-server experiments run end to end at --tiny size and write their json and markdown."""

from __future__ import annotations

import json

from experiments import managed_comm, orion_vs_dataparallel, ssp_vs_bsp


def test_ssp_vs_bsp_tiny(tmp_path):
    assert ssp_vs_bsp.main(["--tiny", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "ssp_vs_bsp.json").read_text())
    assert set(res["results"]) == {"mf/fixed", "mf/transient", "mf, one pass per clock/fixed",
                                   "mf, one pass per clock/transient", "lda/fixed", "lda/transient",
                                   "mf, limited link/fixed"}
    for case in res["results"].values():
        assert set(case["table"]) == {"s=0", "s=1", "s=2", "s=4", "ASP"}
        assert case["table"]["s=0"]["time_to_target_s"] is not None  # BSP defines the target, so reaches it
        assert case["meets_bar"] == all((case["table"][s]["speedup_vs_bsp"] or 0) >= 1.3 for s in ("s=1", "s=2", "s=4"))
    # the limited link's budget comes from the bytes a worker sends per clock, so its link use is the chosen one
    assert abs(res["results"]["mf, limited link/fixed"]["link_use"] - ssp_vs_bsp.LINK_USE) < 1e-9
    assert res["results"]["mf/fixed"]["link_mbps"] == ssp_vs_bsp.MF_TINY["link_mbps"]
    mf = res["results"]["mf/fixed"]["curves"]["s=0"]["loss"]
    assert mf[-1] < mf[0]
    md = (tmp_path / "ssp_vs_bsp.md").read_text()
    assert md.startswith("# ssp_vs_bsp") and "* mf, limited link/fixed: " in md  # the verdict line of every case


def test_managed_comm_tiny(tmp_path):
    assert managed_comm.main(["--tiny", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "managed_comm.json").read_text())
    assert set(res["results"]) == {"lda", "mf"}
    for case in res["results"].values():
        table = case["table"]
        assert set(table) == {"plain SSP", "plain SSP, sync send", "managed: magnitude", "managed: absolute",
                              "managed: consumption", "managed: random", "managed: magnitude, score only",
                              "managed: push only", "plain SSP, unlimited link"}
        assert table["plain SSP"]["early_share"] == 0 and table["managed: magnitude"]["early_share"] > 0
        assert table["managed: push only"]["early_share"] == 0  # the references send nothing early
        assert table["plain SSP, unlimited link"]["early_share"] == 0
        assert sum(table["managed: magnitude"]["early_mb_by_table"].values()) > 0
        assert 0 < case["link_use"]
        # the same updates leave every setting; early sending can only add bytes (rows sent again)
        assert all(row["bytes_sent"] >= table["plain SSP"]["bytes_sent"] for row in table.values())


def test_orion_vs_dataparallel_tiny(tmp_path):
    assert orion_vs_dataparallel.main(["--tiny", "--out", str(tmp_path), "--workers", "2", "3"]) == 0
    res = json.loads((tmp_path / "orion_vs_dataparallel.json").read_text())
    (run,) = res["runs"].values()
    assert set(run["by_workers"]) == {"2", "3"}
    assert all(len(band) == 1 for band in run["serial_other_orders"].values())
    for case in run["by_workers"].values():
        assert set(case["table"]) == {"serial", "orion_par 2D", "orion_par 2D, fixed rotation", "data-parallel s=0",
                                      "data-parallel s=2"}
        orion = case["curves"]["orion_par 2D"]["loss"]
        assert orion[-1] < orion[0]
        # orion_par's run is the serial loop over its schedule's block order, random strata or fixed rotation
        assert case["orion_vs_serial_on_its_order"] < 1e-9
        assert case["rotation_vs_serial_on_its_order"] < 1e-9
        assert orion != case["curves"]["orion_par 2D, fixed rotation"]["loss"]  # the two orders differ
        assert all(len(band) == 1 for band in case["orion_block_order_other_orders"].values())
        assert all(len(band) == 1 for band in case["orion_other_stratum_seeds"].values())
        # the targets are the serial run's RMSE after N epochs, so serial reaches target N at epoch N
        serial = case["table"]["serial"]
        assert serial["epochs_to_target"] == {n: float(n) for n in run["targets"]}
        assert serial["interpolated_epochs"] == {n: float(n) for n in run["targets"]}
    assert "3 workers: epochs to target" in (tmp_path / "orion_vs_dataparallel.md").read_text()
