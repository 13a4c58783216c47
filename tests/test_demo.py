"""The demo, in its tiny mode: vanilla runs out of memory on the testbed, the table is printed, the plot written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tfmem import demo


@pytest.mark.testbed
def test_tiny_demo_prints_the_table_and_writes_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--tiny", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("run ") and "peak measured" in line)
    assert all(col in lines[header] for col in ("budget", "peak simulated", "peak Grappler", "step time", "OOM"))
    rows = {line.split("  ")[0]: line for line in lines[header + 3:] if line.strip() and not line.startswith("[")}
    assert rows["vanilla"].rstrip().endswith("yes")                # out of memory under the budget, for real
    assert rows["vanilla, large budget"].rstrip().endswith("no")
    if "optimized" in rows:                                        # the memory passes met the budget
        assert rows["optimized"].rstrip().endswith("no")
        assert "np.array_equal): yes" in out
    else:                                                          # they did not: the demo says why
        assert "tfmem.optimize could not meet the budget" in out and "lower bound" in out
        assert "$ tfmem analyze" in out
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "report.md").read_text().startswith("### tfmem report")
