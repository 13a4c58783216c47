"""Benchmark: what a multi-machine testbed costs on this machine, and that it keeps its promises.

For M = 1, 2 and 4 machines (``--tiny``: 1 and 2), a ``Testbed`` of ``--cap`` MiB per device with ``machines=M``:

- the seconds until its 2M servers are ready, and each server's resident memory when idle (``VmRSS``; the
  device servers' reservation of their cap is untouched pages, so it is not resident);
- a step that makes ``--tensor`` MiB on each device and keeps it while it makes twice it (peak: twice that per
  device), summed on machine 0: the measured peak of every device, and each server's resident memory afterwards;
- a step over the cap on the last machine only: the ending, the device the out-of-memory names, and the
  seconds it took to say it;
- after ``close``: child processes, listening ports and work folders left.

    python -m experiments.testbed_machines
    python -m experiments.testbed_machines --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


from experiments._common import load_average, provenance, write
from experiments.reliability import leftovers, rss_bytes, testbed_ports
from tfmem.testbed import Testbed
from tfmem.testbed.graph import calibration_graph

MiB = 2**20


def measure(machines: int, cap: int, tensor: int) -> dict[str, Any]:
    row: dict[str, Any] = {"machines": machines}
    tb: Testbed | None = None
    with leftovers(row, lambda: testbed_ports(tb) if tb is not None else set()):
        started = time.monotonic()
        tb = Testbed(cap, machines=machines)
        with tb:
            row["start_s"] = round(time.monotonic() - started, 2)
            row["idle_rss_mib"] = {name: round(rss_bytes(pid) / MiB, 1) for name, pid in sorted(tb.pids.items())}
            r = tb.run(calibration_graph({m: tensor for m in range(machines)}), ["total:0"])
            row["fits"] = {"ending": r.ending, "step_s": r.step_time_s,
                           "device_peaks_mib": {d: round(b / MiB, 3) for d, b in r.device_peaks.items()}}
            row["busy_rss_mib"] = {name: round(rss_bytes(pid) / MiB, 1) for name, pid in sorted(tb.pids.items())}
            over = {m: tensor for m in range(machines)}
            over[machines - 1] = cap
            asked = time.monotonic()
            r = tb.run(calibration_graph(over), ["total:0"])
            row["over"] = {"ending": r.ending, "oom_device": r.oom_device, "expected": tb.devices[-1],
                           "report_s": round(time.monotonic() - asked, 2), "error": (r.error or "")[:200]}
    return row


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# The multi-machine testbed: its cost here, and its promises",
        "",
        f"Command: `{result['command']}` ({result['date']}; {result['machine']['cpus']} CPUs, load average "
        f"{result['load_average']['1m']} at the end). A device is capped at {result['cap_mib']} MiB; the fitting "
        f"step makes {result['tensor_mib']} MiB on each device and twice it beside it (expected peak "
        f"{2 * result['tensor_mib']} MiB per device); the step over the cap does so with {result['cap_mib']} MiB "
        "on the last machine. Resident memory is each server process's VmRSS (MiB); leftovers are counted one "
        "second after close.",
        "",
        "| machines | start (s) | resident idle, device / host servers (MiB, mean) | resident after the step "
        "(MiB, mean) | per-device peaks (MiB) | over the cap: ending, device named (report s) | leftover "
        "processes / ports / folders |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        def mean(rss: dict[str, float], job: str) -> float:
            values = [v for k, v in rss.items() if k.startswith(job)]
            return round(sum(values) / len(values), 1)
        over = row["over"]
        named = "right device" if over["oom_device"] == over["expected"] else f"WRONG: {over['oom_device']}"
        peaks = ", ".join(str(v) for _, v in sorted(row["fits"]["device_peaks_mib"].items()))
        lines.append(
            f"| {row['machines']} | {row['start_s']} | {mean(row['idle_rss_mib'], 'worker')} / "
            f"{mean(row['idle_rss_mib'], 'host')} | {mean(row['busy_rss_mib'], 'worker')} / "
            f"{mean(row['busy_rss_mib'], 'host')} | {peaks} | {over['ending']}, {named} ({over['report_s']}) | "
            f"{row['leftover_processes']} / {row['leftover_ports']} / {row['leftover_folders']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="1 and 2 machines")
    parser.add_argument("--cap", type=int, default=64, help="each device's cap, MiB")
    parser.add_argument("--tensor", type=int, default=8, help="MiB made on each device by the fitting step")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default experiments/results)")
    args = parser.parse_args(argv)
    if not 1 <= 2 * args.tensor < args.cap:
        parser.error("--tensor must be at least 1 and twice it under --cap")
    rows = []
    for machines in (1, 2) if args.tiny else (1, 2, 4):
        rows.append(measure(machines, args.cap * MiB, args.tensor * MiB))
        print(json.dumps(rows[-1]), flush=True)
    result = {**provenance(argv), "load_average": load_average(), "cap_mib": args.cap, "tensor_mib": args.tensor,
              "rows": rows}
    write("testbed_machines_tiny" if args.tiny else "testbed_machines", result, markdown(result),
          *([args.out] if args.out else []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
