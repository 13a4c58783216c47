"""Benchmark: does the testbed report every ending truthfully and fast, and leave nothing behind?

Each case provokes one ending on purpose and records what the testbed said (ran / oom / timeout / crash), how
long it took to say it, how long the run took to reach it, and what was left afterwards (child processes,
listening ports, work folders; for repeated OOMs also this process's threads and file descriptors and the
worker's memory). Cases:

- ``op-oom``: an op's output over the cap; ``feed-oom``: a fed tensor over the cap; ``constants-oom``: an MLP of
  ``--layers`` 1024x1024 layers initialised from ``tf.constant`` (an 84 MB GraphDef at 20 layers) capped at 0.6x
  its roomy peak; ``while-oom``: a ``tf.while_loop`` RNN's training step capped at half its roomy peak;
- ``hang``: a dequeue from an empty queue, with a 5 s phase limit: a timeout; ``crash``: the worker killed
  mid-step; ``two-testbeds``: two testbeds running at once;
- ``repeated-oom``: ``--repeats`` OOMs in a row on one testbed (30 s phase limit), then one run that fits, and
  the threads a phase limit later;
- ``ctrl-c``: a user process looping over runs, SIGINTed ``--interrupts`` times (one process each) while
  ``--burners`` busy loops keep the cores loaded: how long it takes to exit, and what it leaves;
- ``zoo`` (``--zoo``, needs ``tf_keras`` and ``tf_slim``): Keras ResNet-50 (14k ops) capped at 0.7x, 0.5x and
  0.35x of its roomy peak, and TF-Slim Inception v3 at 0.7x, both as the zoos build them (fused batch norm).

    python -m experiments.reliability            # every case but the zoo
    python -m experiments.reliability --zoo      # and Keras ResNet-50
    python -m experiments.reliability --tiny     # a smoke run: fewer repeats and interrupts
    python -m experiments.reliability --tiny --cases op-oom,hang
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from experiments._common import load_average, provenance, write
from tfmem.errors import TestbedCrashError, TestbedTimeoutError
from tfmem.testbed import Testbed
from tfmem.testbed.proc import listening_ports, process_gone
from tfmem.testbed.runner import WORKDIR_PREFIX

MiB = 2**20
REPO = Path(__file__).resolve().parents[1]
ROOMY = 4096 * MiB


def _graph(body: Callable[[], object]) -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        body()
    return g


def _attempt(tb: Testbed, graph: tf.Graph, fetches: list[str], feeds: dict[str, Any] | None = None,
             steps: int = 1) -> dict[str, Any]:
    """One run: its ending, the seconds to report it, and the seconds the run took to reach it."""
    started = time.monotonic()
    try:
        r = tb.run(graph, fetches, feeds, steps=steps)
        ending, reached, error, run_s = r.ending, r.reached_s, r.error, r.elapsed_s
    except TestbedTimeoutError as e:
        ending, reached, error, run_s = "timeout", None, str(e).splitlines()[0], None
    except TestbedCrashError as e:
        ending, reached, error, run_s = "crash", None, str(e).splitlines()[0], None
    return {"ending": ending, "report_s": round(time.monotonic() - started, 3),
            "run_s": None if run_s is None else round(run_s, 3),
            "reached_s": None if reached is None else round(reached, 3), "error": (error or "")[:300]}


def _children() -> list[int]:
    """This process's children (testbed servers), ``ps`` itself and the CPU burners aside."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(os.getpid())], capture_output=True, text=True)
    rows = [line.split(None, 1) for line in out.stdout.strip().splitlines()]
    return [int(pid) for pid, args in rows if "server.py" in args]


def _thread_names() -> Counter[str]:
    names: Counter[str] = Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            names[Path(f"/proc/self/task/{tid}/comm").read_text().strip()] += 1
        except OSError:
            continue
    return names


def _workdirs(pid: int) -> list[str]:
    return sorted(str(p) for p in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}{pid}-*"))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@contextmanager
def leftovers(row: dict[str, Any], ports_of: Callable[[], set[int]]) -> Iterator[None]:
    """Record, after the block, the child processes, listening testbed ports and work folders still there."""
    ports: set[int] = set()
    try:
        yield
    finally:
        ports = ports_of()
        time.sleep(1.0)   # a killed server's sockets close as its last thread ends
        row["leftover_processes"] = len(_children())
        row["leftover_ports"] = len(ports & listening_ports())
        row["leftover_folders"] = len(_workdirs(os.getpid()))


def testbed_ports(tb: Testbed) -> set[int]:
    return {int(a.rsplit(":", 1)[1]) for addrs in tb.cluster.values() for a in addrs}


def _chain(nbytes: int) -> tf.Graph:
    def body() -> None:
        x = tf.random.uniform([nbytes // 4], seed=1, name="x")
        tf.reduce_sum(tf.add(tf.multiply(x, 2.0), x), name="s")
    return _graph(body)


def case_op_oom() -> dict[str, Any]:
    row: dict[str, Any] = {"case": "op-oom", "expected": "oom"}
    tb = Testbed(64 * MiB)
    with leftovers(row, lambda: testbed_ports(tb)), tb:
        row.update(_attempt(tb, _chain(64 * MiB), ["s:0"]))
    return row


def case_feed_oom() -> dict[str, Any]:
    row: dict[str, Any] = {"case": "feed-oom", "expected": "oom"}

    def body() -> None:
        x = tf.compat.v1.placeholder(tf.float32, [16 * MiB], name="x")
        tf.reduce_sum(x, name="s")
    tb = Testbed(32 * MiB)
    with leftovers(row, lambda: testbed_ports(tb)), tb:
        row.update(_attempt(tb, _graph(body), ["s:0"], {"x:0": np.ones(16 * MiB, np.float32)}))
    return row


def constants_mlp(layers: int) -> tf.Graph:
    """An MLP whose 1024x1024 weights are variables initialised from ``tf.constant`` (the GraphDef holds them)."""
    rng = np.random.default_rng(0)

    def body() -> None:
        h = tf.constant(rng.standard_normal((64, 1024)).astype(np.float32), name="x")
        for i in range(layers):
            w = tf.Variable(tf.constant(rng.standard_normal((1024, 1024)).astype(np.float32) / 32), name=f"w{i}")
            h = tf.nn.relu(tf.matmul(h, w))
        tf.reduce_sum(h, name="out")
    return _graph(body)


def case_constants_oom(layers: int) -> dict[str, Any]:
    row: dict[str, Any] = {"case": "constants-oom", "expected": "oom", "layers": layers}
    g = constants_mlp(layers)
    row["graphdef_mb"] = round(g.as_graph_def().ByteSize() / 1e6, 1)
    with Testbed(ROOMY) as roomy:
        peak = roomy.run(g, ["out:0"], steps=1).device_peak_bytes or 0
    cap = max(int(peak * 0.6) // MiB, 1) * MiB
    row["roomy_peak_mib"], row["cap_mib"] = round(peak / MiB, 1), cap // MiB
    tb = Testbed(cap)
    with leftovers(row, lambda: testbed_ports(tb)), tb:
        row.update(_attempt(tb, g, ["out:0"]))
    return row


def case_while_oom() -> dict[str, Any]:
    row: dict[str, Any] = {"case": "while-oom", "expected": "oom"}

    def body() -> None:
        steps, batch, hidden = 200, 64, 512
        xs = tf.random.uniform([steps, batch, hidden], seed=1)
        w = tf.Variable(tf.random.normal([hidden, hidden], seed=2) / 32, name="w")
        u = tf.Variable(tf.random.normal([hidden, hidden], seed=3) / 32, name="u")

        def step(t: tf.Tensor, h: tf.Tensor, total: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
            h = tf.tanh(tf.matmul(xs[t], w) + tf.matmul(h, u))
            return t + 1, h, total + tf.reduce_sum(h)

        _, _, total = tf.while_loop(lambda t, h, total: t < steps, step,
                                    (tf.constant(0), tf.zeros([batch, hidden]), tf.constant(0.0)))
        loss = tf.identity(total, name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    g = _graph(body)
    with Testbed(ROOMY) as roomy:
        peak = roomy.run(g, ["loss:0", "train"], steps=1).device_peak_bytes or 0
    cap = max(int(peak * 0.5) // MiB, 1) * MiB
    row["roomy_peak_mib"], row["cap_mib"] = round(peak / MiB, 1), cap // MiB
    tb = Testbed(cap)
    with leftovers(row, lambda: testbed_ports(tb)), tb:
        row.update(_attempt(tb, g, ["loss:0", "train"]))
    return row


def case_hang() -> dict[str, Any]:
    row: dict[str, Any] = {"case": "hang", "expected": "timeout", "phase_limit_s": 5.0}

    def body() -> None:
        q = tf.queue.FIFOQueue(1, tf.float32, shapes=[()])
        tf.identity(q.dequeue(), name="y")   # nothing is ever enqueued
    tb = Testbed(64 * MiB, step_timeout_s=5.0)
    with leftovers(row, lambda: testbed_ports(tb)), tb:
        row.update(_attempt(tb, _graph(body), ["y:0"]))
        row["usable_after"] = _attempt(tb, _chain(MiB), ["s:0"])["ending"] == "ran"
    return row


def case_crash() -> dict[str, Any]:
    row: dict[str, Any] = {"case": "crash", "expected": "crash"}

    def body() -> None:
        x = tf.random.uniform((512, 512), seed=1)
        y = x
        for _ in range(400):
            y = tf.matmul(y, x) / 512.0
        tf.reduce_sum(y, name="y")
    tb = Testbed(256 * MiB)
    with leftovers(row, lambda: testbed_ports(tb)), tb:
        worker = tb.pids["worker:0"]
        killer = threading.Timer(1.0, os.kill, (worker, signal.SIGKILL))
        killer.start()
        row.update(_attempt(tb, _graph(body), ["y:0"], steps=20))
        killer.join()
        row["usable_after"] = _attempt(tb, _chain(MiB), ["s:0"])["ending"] == "ran"
    return row


def case_two_testbeds() -> dict[str, Any]:
    row: dict[str, Any] = {"case": "two-testbeds", "expected": "ran"}
    a, b = Testbed(64 * MiB), Testbed(64 * MiB)
    with leftovers(row, lambda: testbed_ports(a) | testbed_ports(b)), a, b:
        first, second = _attempt(a, _chain(16 * MiB), ["s:0"]), _attempt(b, _chain(8 * MiB), ["s:0"])
        row.update(first)
        row["ending"] = first["ending"] if first["ending"] == second["ending"] else f"{first['ending']}/{second['ending']}"
        row["separate"] = a.pids != b.pids and testbed_ports(a).isdisjoint(testbed_ports(b))
    return row


def case_repeated_oom(repeats: int) -> dict[str, Any]:
    row: dict[str, Any] = {"case": "repeated-oom", "expected": "oom", "repeats": repeats}
    too_big = _chain(64 * MiB)
    tb = Testbed(64 * MiB, step_timeout_s=REPEATED_PHASE_LIMIT_S)
    with leftovers(row, lambda: testbed_ports(tb)), tb:
        tb.run(_chain(MiB), ["s:0"])
        worker_rss_start = rss_bytes(tb.pids["worker:0"])
        threads_start, fds_start = _thread_names(), len(os.listdir("/proc/self/fd"))
        runs = [_attempt(tb, too_big, ["s:0"]) for _ in range(repeats)]
        after = _attempt(tb, _chain(MiB), ["s:0"])
        threads_after_runs = sum(_thread_names().values())
        # a cut-short run's helper thread waits on its lost master until TF's deadline (the phase limit + 5 s)
        time.sleep(REPEATED_PHASE_LIMIT_S + 15.0)
        row.update({
            "ending": "oom" if all(r["ending"] == "oom" for r in runs) else "mixed",
            "oom_runs": sum(r["ending"] == "oom" for r in runs),
            "report_s": round(max(r["report_s"] for r in runs), 3),
            "report_s_median": round(float(np.median([r["report_s"] for r in runs])), 3),
            "run_s": round(max(r["run_s"] or 0 for r in runs), 3),
            "run_over_reached_max": round(max((r["run_s"] or 0) / (r["reached_s"] or 1) for r in runs), 2),
            "reached_s": round(max(r["reached_s"] or 0 for r in runs), 3),
            "ran_after": after["ending"] == "ran",
            "worker_rss_start_mb": round(worker_rss_start / 1e6, 1),
            "worker_rss_end_mb": round(rss_bytes(tb.pids["worker:0"]) / 1e6, 1),
            "phase_limit_s": REPEATED_PHASE_LIMIT_S, "threads_start": sum(threads_start.values()),
            "threads_after_runs": threads_after_runs, "threads_end": sum(_thread_names().values()),
            "threads_added": dict(_thread_names() - threads_start),
            "fds_start": fds_start, "fds_end": len(os.listdir("/proc/self/fd")),
            "error": runs[-1]["error"],
        })
    return row


REPEATED_PHASE_LIMIT_S = 30.0


_USER = r"""
import json, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)   # as in a terminal, even if started in the background
import tensorflow as tf
from tfmem.testbed import Testbed
g = tf.Graph()
with g.as_default():
    tf.reduce_sum(tf.random.uniform([1 << 20], seed=1) * 2.0, name="s")
tb = Testbed("64MiB")
ports = [int(a.rsplit(":", 1)[1]) for addrs in tb.cluster.values() for a in addrs]
print(json.dumps({"pids": list(tb.pids.values()), "ports": ports, "workdir": str(tb._workdir)}), flush=True)
with tb:
    while True:
        tb.run(g, ["s:0"], steps=20)
"""


def _burn() -> None:
    while True:
        pass


def case_ctrl_c(interrupts: int, burners: int) -> dict[str, Any]:
    row: dict[str, Any] = {"case": "ctrl-c", "expected": "exit", "interrupts": interrupts, "burners": burners}
    procs = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(burners)]
    for p in procs:
        p.start()
    exits, left = [], {"processes": 0, "ports": 0, "folders": 0}
    try:
        for _ in range(interrupts):
            user = subprocess.Popen([sys.executable, "-c", _USER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    text=True, cwd=REPO, start_new_session=True)
            info = json.loads(user.stdout.readline())  # type: ignore[union-attr]
            time.sleep(2.0)   # mid-loop
            os.killpg(user.pid, signal.SIGINT)
            started = time.monotonic()
            try:
                user.wait(timeout=120)
                exits.append(time.monotonic() - started)
            except subprocess.TimeoutExpired:
                user.kill()
                user.wait()
                exits.append(float("inf"))
            time.sleep(1.0)
            left["processes"] += sum(not process_gone(pid) for pid in info["pids"])
            left["ports"] += len(set(info["ports"]) & listening_ports())
            left["folders"] += Path(info["workdir"]).exists()
    finally:
        for p in procs:
            p.kill()
    row.update({"ending": "exit" if all(e != float("inf") for e in exits) else "hang",
                "report_s": round(max(exits), 3), "report_s_median": round(float(np.median(exits)), 3),
                "leftover_processes": left["processes"], "leftover_ports": left["ports"],
                "leftover_folders": left["folders"]})
    return row


def case_zoo() -> list[dict[str, Any]]:
    from models import zoo

    if not zoo.available():
        return [{"case": "zoo", "expected": "-", "ending": "skipped: tf_keras or tf_slim not installed"}]
    rows = []
    for name, build, fractions in (("keras-resnet50", zoo.keras_resnet50, (0.7, 0.5, 0.35)),
                                   ("slim-inception-v3", zoo.slim_inception_v3, (0.7,))):
        built = build()
        with Testbed(ROOMY) as roomy:
            peak = roomy.run(built.graph, built.fetches, built.feeds, steps=1).device_peak_bytes or 0
        for fraction in fractions:
            row: dict[str, Any] = {"case": f"zoo {name} {fraction}x", "expected": "oom",
                                   "roomy_peak_mib": round(peak / MiB, 1)}
            tb = Testbed(max(int(peak * fraction) // MiB, 1) * MiB)
            with leftovers(row, lambda tb=tb: testbed_ports(tb)), tb:  # type: ignore[misc]
                row.update(_attempt(tb, built.graph, built.fetches, built.feeds))
            rows.append(row)
    return rows


def markdown(result: dict[str, Any]) -> str:
    load = result["load_average"]
    lines = [
        "# The testbed's endings: truthful, fast, nothing left behind",
        "",
        f"Command: `{result['command']}` ({result['date']}; {result['machine']['cpus']} CPUs, load average "
        f"{load['1m']} at the end). Each case provokes one ending; *said* is what the testbed reported, *report* "
        "the seconds `Testbed.run` took to say it (with waiting for servers started after the last run was cut "
        "short), *run* the same without that wait, *reached* the seconds the run took to reach the failed request. "
        "Leftovers are counted one second after the testbed closed.",
        "",
        "| case | expected | said | report (s) | run (s) | reached (s) | leftover processes / ports / folders | notes |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    for r in result["rows"]:
        notes = {k: v for k, v in r.items() if k not in {"case", "expected", "ending", "report_s", "reached_s", "run_s",
                                                        "leftover_processes", "leftover_ports", "leftover_folders",
                                                        "error"}}
        left = "/".join(str(r.get(k, "-")) for k in ("leftover_processes", "leftover_ports", "leftover_folders"))
        lines.append(f"| {r['case']} | {r['expected']} | {r.get('ending')} | {r.get('report_s', '-')} | "
                     f"{r.get('run_s') if r.get('run_s') is not None else '-'} | "
                     f"{r.get('reached_s') if r.get('reached_s') is not None else '-'} | {left} | "
                     f"{', '.join(f'{k}={v}' for k, v in notes.items())} |")
    wrong = [r["case"] for r in result["rows"] if r.get("expected") not in ("-", r.get("ending"))]
    broke = [r["case"] for r in result["rows"] if str(r.get("ending")).startswith("broke")]
    lines += ["", f"Cases whose ending was not the expected one: {', '.join(wrong) or 'none'}.",
              f"Cases that broke before reaching an ending: {', '.join(broke) or 'none'}."]
    return "\n".join(lines) + "\n"


CASES = ("op-oom", "feed-oom", "constants-oom", "while-oom", "hang", "crash", "two-testbeds", "repeated-oom", "ctrl-c")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="5 repeated OOMs, 2 interrupts, 4 layers")
    parser.add_argument("--repeats", type=int, default=100, help="OOMs in a row (repeated-oom)")
    parser.add_argument("--interrupts", type=int, default=20, help="Ctrl-C'd user processes (ctrl-c)")
    parser.add_argument("--burners", type=int, default=2, help="busy loops during ctrl-c")
    parser.add_argument("--layers", type=int, default=20, help="layers of the constants MLP")
    parser.add_argument("--zoo", action="store_true", help="also Keras ResNet-50 and TF-Slim Inception v3")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default experiments/results)")
    args = parser.parse_args(argv)
    if min(args.repeats, args.interrupts, args.layers) < 1 or args.burners < 0:
        parser.error("--repeats, --interrupts and --layers must be at least 1, --burners at least 0")
    cases = [c for c in args.cases.split(",") if c]
    if not cases or set(cases) - set(CASES):
        parser.error(f"--cases takes a comma-separated subset of {', '.join(CASES)}; got {args.cases!r}")
    if args.tiny:
        args.repeats, args.interrupts, args.layers = 5, 2, 4
    run: dict[str, Callable[[], dict[str, Any]]] = {
        "op-oom": case_op_oom, "feed-oom": case_feed_oom, "constants-oom": lambda: case_constants_oom(args.layers),
        "while-oom": case_while_oom, "hang": case_hang, "crash": case_crash, "two-testbeds": case_two_testbeds,
        "repeated-oom": lambda: case_repeated_oom(args.repeats),
        "ctrl-c": lambda: case_ctrl_c(args.interrupts, args.burners)}
    rows = []
    for case in [*cases, *(["zoo"] if args.zoo else [])]:
        try:
            made = case_zoo() if case == "zoo" else [run[case]()]
        except Exception as e:   # a case that breaks is a row that says so; the others still run
            made = [{"case": case, "expected": "-", "ending": f"broke: {type(e).__name__}: {str(e)[:200]}"}]
        for row in made:
            print(json.dumps(row), flush=True)
        rows += made
    result = {**provenance(argv), "load_average": load_average(), "rows": rows}
    name = "reliability_tiny" if args.tiny else "reliability"
    write(name, result, markdown(result), *([args.out] if args.out else []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
