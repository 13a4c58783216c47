"""Benchmark: the largest model that trains under a fixed testbed budget, vanilla TensorFlow vs tfmem.

For a family (``moe``: experts per MoE layer; ``resnet16``/``resnet32``: ResNet depth at batch 16/32, searched
over blocks per stage, depth = 9n+2; ``deepspeech``: sequence length of the unrolled recurrence) and a testbed
budget, galloping (x2) then bisection finds the largest size that runs one training step without running out
of memory:

* vanilla: the builder's graph, unplaced, so every op runs on the capped device (``tfmem.testbed.DEVICE``);
* tfmem: ``tfmem.optimize(graph, fetches, budget=plan_fraction * budget, device=DEVICE, host=HOST,
  passes=...)``, then ``Testbed.run(opt.graph, ...)``. ``InfeasibleBudgetError`` means "tfmem refuses" and
  counts as not fitting.

Every probe is recorded: status (ok / oom / refused / error), measured device and host peak, median step time
and throughput (samples/s), simulated peaks, and optimize's verdict and time. The summary gives each side's
largest size, the ratio tfmem/vanilla, and each side's throughput at its largest size. At vanilla's largest
size both sides run, and the losses they return are compared (the passes must not change results).
Writes ``experiments/results/max_size_<family>.json`` and ``.md``.

The search assumes that fitting is monotone in the size; each probe builds a fresh graph, and optimize's time
grows with the graph (1-3.5 minutes to plan 48 experts, depending on the machine's load). Each family's default
``maximum`` (64 experts, 24 blocks per stage = ResNet-218, 96 frames = twice vanilla's largest, the factor of
TensorFlowMem's own DeepSpeech table, 400 -> 800) bounds a full run; measured on 2 shared cores: MoE 7 minutes,
ResNet 17 minutes for both batch sizes (probes near tfmem's limit replan up to 7 times before refusing). A search that ends at the maximum without a failure says so ("the search stopped
at its maximum": tfmem's true largest may be larger); raise ``--max-size`` to search further.
After every probe the probes so far are written to ``max_size_<family>.partial.json``, removed when the
search completes. ``--tiny`` runs small models under a small budget, as a smoke test.

The testbed's step times are a CPU's; a GPU's slowdown depends on its link. Every probe that runs also gets the
cost model's step time on a named GPU and link (``NAMED_GPU``, see ``gpu_estimate``), reported beside them.

    python -m experiments.max_size                                # every family, full size
    python -m experiments.max_size moe --budget 64MiB --passes auto
    python -m experiments.max_size resnet16 --set width=16 --max-size 40
    python -m experiments.max_size deepspeech --tiny              # CI smoke run
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tqdm import tqdm

import tfmem
from experiments._common import NAMED_GPU, RESULTS, provenance, write
from experiments._max_size_report import markdown
from models import deepspeech, moe_transformer, resnet
from tfmem.examples import Built
from tfmem.ir.loading import load
from tfmem.sim.costmodel import DEVICES, op_flops
from tfmem.testbed import DEVICE, HOST, Testbed
from tfmem.units import parse_bytes

MODES = ("vanilla", "tfmem")
BENCH = False   # ``make bench`` runs the families through max_experts, max_resnet_depth and deepspeech_seq_len


@dataclass(frozen=True)
class Family:
    """A model family searched over one integer size; ``kwargs`` are the builder's other arguments."""

    name: str
    size_name: str                       # what the searched integer is
    builder: Callable[..., Built]
    size_arg: Callable[[int], dict[str, Any]]   # size -> builder keyword(s)
    label: Callable[[int], int]          # the figure reported for a size (e.g. the ResNet's depth)
    label_name: str
    budget: str
    start: int
    minimum: int
    maximum: int
    resolution: int = 1                  # stop bisecting when the bracket is this narrow
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self, size: int) -> Built:
        return self.builder(**self.kwargs, **self.size_arg(size))

    @property
    def batch(self) -> int:
        return int(self.kwargs["batch"])


def _resnet(name: str, batch: int, tiny: bool) -> Family:
    # Budgets must leave room for the workspace of TF's CPU conv gradients: 15-25 MiB whatever the model.
    kwargs = ({"batch": batch // 4, "image": 16, "width": 8, "classes": 10} if tiny
              else {"batch": batch, "image": 32, "width": 8, "classes": 10})
    return Family(name, "bottleneck blocks per stage", resnet.build, lambda n: {"depth": resnet.depth_of(n)},
                  resnet.depth_of, "depth", "40MiB" if tiny else "96MiB", 1, 1, 8 if tiny else 24, 1, kwargs)


def families(tiny: bool) -> dict[str, Family]:
    """The families, at full size or (``tiny``) small enough for a smoke run.

    Examples
    --------
    >>> sorted(families(tiny=True))
    ['deepspeech', 'moe', 'resnet16', 'resnet32']
    >>> families(tiny=False)["resnet16"].label(6)     # 6 blocks per stage: ResNet-56
    56
    """
    moe_kwargs = ({"layers": 1, "d_model": 32, "d_ff": 256, "heads": 2, "seq": 16, "batch": 4, "vocab": 64}
                  if tiny else
                  {"layers": 2, "d_model": 128, "d_ff": 1024, "heads": 4, "seq": 64, "batch": 8, "vocab": 256})
    ds_kwargs = ({"batch": 8, "freq": 16, "conv_layers": 0, "rnn_layers": 1, "hidden": 64, "cell": "rnn"} if tiny
                 else {"batch": 32, "freq": 32, "rnn_layers": 1, "hidden": 512, "cell": "rnn"})
    return {
        "moe": Family("moe", "experts per MoE layer", moe_transformer.build, lambda e: {"experts": e},
                      lambda e: e, "experts", "2MiB" if tiny else "64MiB", 2, 2, 16 if tiny else 64, 1,
                      {"top_k": 2, **moe_kwargs}),
        "resnet16": _resnet("resnet16", 16, tiny),
        "resnet32": _resnet("resnet32", 32, tiny),
        "deepspeech": Family("deepspeech", "frames (sequence length)", deepspeech.build,
                             lambda t: {"seq_len": t}, lambda t: t, "seq_len", "2MiB" if tiny else "128MiB",
                             16, 2, 64 if tiny else 96, 2 if tiny else 4, ds_kwargs),
    }


def gpu_estimate(graph: Any, fetches: list[str], feed_shapes: Any, gpu: str = NAMED_GPU) -> dict[str, float]:
    """The cost model's step time for ``graph`` on a named GPU and link: compute, link traffic, and bounds.

    ``compute_s`` is the simulated step's estimate on the GPU (ops on the host count too, at GPU speed: a
    slight underestimate); ``link_s`` the time to move every tensor that crosses between the device and the
    host once per step (swaps out, prefetches in, host-resident weights and their gradients). The step takes
    at least ``max(compute_s, link_s)`` (transfers fully overlapped) and at most their sum (none overlapped).

    Examples
    --------
    >>> import tensorflow as tf
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.ones([256, 256], name="x")
    ...     with tf.device(HOST):
    ...         y = tf.identity(x, name="y")     # 256 KiB to the host
    ...     z = tf.matmul(y, y, name="z")        # and back
    >>> est = gpu_estimate(g, ["z:0"], None)
    >>> est["link_bytes"] == 2 * 256 * 256 * 4, est["low_s"] <= est["high_s"]
    (True, True)
    """
    spec = DEVICES[gpu]
    ir = load(graph, feed_shapes)
    profile = tfmem.simulate(ir, fetches, feed_shapes=feed_shapes, device=DEVICE, host=HOST, cost_device=spec,
                             grappler=False, cores=1)
    on_host = {n.name: n.device.startswith("/job:host") for n in ir.nodes}
    crossing = {(t, on_host[n.name]) for n in ir.nodes for t in n.inputs if on_host.get(t.node) != on_host[n.name]}
    link_bytes = sum(ir.spec(t).nbytes or 0 for t, _ in crossing)
    link_s = sum(spec.transfer_s(ir.spec(t).nbytes or 0) for t, _ in crossing)
    compute_s = profile.estimated_step_s
    return {"gpu": spec.name, "compute_s": compute_s, "link_bytes": link_bytes, "link_s": link_s,
            "low_s": max(compute_s, link_s), "high_s": compute_s + link_s}


def step_flops(built: Built) -> float:
    """The cost model's floating-point operations in one training step of ``built`` (as built, unoptimized).

    The work a step does, so that throughputs at different sizes compare per unit of work: a ResNet's grows
    with its depth, an unrolled RNN's with its length, a top-k MoE's hardly with its expert count.
    """
    ir = load(built.graph, built.feed_shapes)
    return float(sum(op_flops(node, ir) for node in ir.nodes))


def search_largest(fits: Callable[[int], bool], start: int, minimum: int, maximum: int,
                   resolution: int = 1) -> tuple[int | None, int | None]:
    """The largest size in ``[minimum, maximum]`` for which ``fits`` holds, by galloping then bisection.

    Doubles from ``start`` while sizes fit (halves while they do not), then bisects the bracket until it is at
    most ``resolution`` wide. Assumes ``fits`` is monotone (true up to some size, false above).

    Returns
    -------
    (largest size that fits or None, smallest size seen not to fit or None)

    Raises
    ------
    BadInputError
        If not ``1 <= minimum <= start <= maximum`` or ``resolution < 1``.

    Examples
    --------
    >>> tried = []
    >>> def fits(size):
    ...     tried.append(size)
    ...     return size <= 37
    >>> search_largest(fits, start=4, minimum=1, maximum=1000)
    (37, 38)
    >>> tried
    [4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
    >>> search_largest(lambda s: s <= 5, start=16, minimum=2, maximum=64), search_largest(bool, 2, 1, 9)
    ((5, 6), (9, None))
    """
    if not (1 <= minimum <= start <= maximum) or resolution < 1:
        raise tfmem.BadInputError(f"max_size: need 1 <= minimum <= start <= maximum and resolution >= 1; got "
                                  f"minimum={minimum}, start={start}, maximum={maximum}, resolution={resolution}")
    lo, hi = (start, None) if fits(start) else (None, start)
    while lo is not None and hi is None and lo < maximum:       # gallop up
        size = min(2 * lo, maximum)
        lo, hi = (size, hi) if fits(size) else (lo, size)
    while hi is not None and lo is None and hi > minimum:       # gallop down
        size = max(hi // 2, minimum)
        lo, hi = (size, hi) if fits(size) else (lo, size)
    while lo is not None and hi is not None and hi - lo > resolution:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, hi


@dataclass
class Prober:
    """Runs and records probes of one family on one testbed; each (mode, size) is probed once."""

    family: Family
    testbed: Testbed
    budget_bytes: int
    passes: str | list[str] | None
    plan_fraction: float
    steps: int
    progress: tqdm
    rows: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    checkpoint: Callable[[list[dict[str, Any]]], None] | None = None   # called with every probe so far

    def fits(self, mode: str, size: int) -> bool:
        if (mode, size) not in self.rows:
            self.progress.set_postfix_str(f"{mode} {self.family.label_name}={self.family.label(size)}")
            self.rows[(mode, size)] = self.probe(mode, size)
            self.progress.update()
            if self.checkpoint is not None:  # a long search that is stopped still leaves its probes behind
                self.checkpoint(list(self.rows.values()))
        return self.rows[(mode, size)]["status"] == "ok"

    def probe(self, mode: str, size: int) -> dict[str, Any]:
        built = self.family.build(size)
        row: dict[str, Any] = {"mode": mode, "size": size, self.family.label_name: self.family.label(size),
                               "params": built.params, "ops": len(built.graph.get_operations())}
        graph, config = built.graph, None
        if mode == "tfmem":
            start = time.perf_counter()
            try:
                opt = tfmem.optimize(built.graph, built.fetches, budget=int(self.plan_fraction * self.budget_bytes),
                                     feed_shapes=built.feed_shapes, device=DEVICE, host=HOST, passes=self.passes)
            except tfmem.InfeasibleBudgetError as e:
                return {**row, "status": "refused", "optimize_s": time.perf_counter() - start,
                        "simulated_peak_bytes": e.best_peak_bytes, "lower_bound_bytes": e.lower_bound_bytes,
                        "error": tfmem.errors.first_line(e)}
            except tfmem.TfmemError as e:
                return {**row, "status": "error", "error": f"{type(e).__name__}: {tfmem.errors.first_line(e)}"}
            row.update(optimize_s=time.perf_counter() - start, simulated_before_bytes=opt.report.before.peak_bytes,
                       simulated_peak_bytes=opt.report.after.peak_bytes,
                       passes_changed=[r.name for r in opt.report.passes if r.changed])
            graph, config = opt.graph, opt.config
        try:
            result = self.testbed.run(graph, built.fetches, built.feeds, steps=self.steps, config=config)
        except tfmem.TestbedError as e:
            return {**row, "status": "error", "error": tfmem.errors.first_line(e)}
        if result.oom:
            return {**row, "status": "oom", "error": result.error}
        step_s = float(result.step_time_s or 0.0)
        row["gpu_estimate"] = gpu_estimate(graph, built.fetches, built.feed_shapes)
        return {**row, "status": "ok", "device_peak_bytes": result.device_peak_bytes,
                "host_peak_bytes": result.host_peak_bytes, "step_time_s": step_s,
                "samples_per_s": self.family.batch / step_s if step_s else None,
                "loss": float(result.outputs["loss:0"])}


def run_family(family: Family, budget: str, passes: str | list[str] | None, plan_fraction: float, steps: int,
               maximum: int, quiet: bool, modes: tuple[str, ...] = MODES,
               checkpoint: Callable[[list[dict[str, Any]]], None] | None = None) -> dict[str, Any]:
    """Search ``family`` for vanilla then tfmem (``modes``) under ``budget``; the summary and every probe."""
    budget_bytes = parse_bytes(budget, what="budget")
    with Testbed(budget) as tb, tqdm(desc=f"max_size {family.name}", unit="probe", disable=quiet) as bar:
        prober = Prober(family, tb, budget_bytes, passes, plan_fraction, steps, bar, checkpoint=checkpoint)
        vanilla: tuple[int | None, int | None] = (None, None)
        tuned: tuple[int | None, int | None] = (None, None)
        if "vanilla" in modes:
            vanilla = search_largest(lambda s: prober.fits("vanilla", s), family.start, family.minimum, maximum,
                                     family.resolution)
        if "tfmem" in modes:
            start = min(max(vanilla[0] or family.start, family.start), maximum)
            tuned = search_largest(lambda s: prober.fits("tfmem", s), start, family.minimum, maximum,
                                   family.resolution)
            if vanilla[0] is not None:
                prober.fits("tfmem", vanilla[0])   # both sides at vanilla's largest: compare results
    rows = sorted(prober.rows.values(), key=lambda r: (r["mode"], r["size"]))
    return {"family": family.name, "size_name": family.size_name, "label_name": family.label_name,
            "testbed_budget": budget, "testbed_budget_bytes": budget_bytes,
            "plan_budget_bytes": int(plan_fraction * budget_bytes), "passes": passes, "steps": steps,
            "modes": list(modes),
            "builder": f"{family.builder.__module__}.build", "builder_kwargs": family.kwargs,
            "search": {"minimum": family.minimum, "start": family.start, "maximum": maximum,
                       "resolution": family.resolution},
            "summary": summarise(family, prober.rows, vanilla, tuned, maximum), "probes": rows}


def summarise(family: Family, rows: dict[tuple[str, int], dict[str, Any]], vanilla: tuple[int | None, int | None],
              tuned: tuple[int | None, int | None], maximum: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, (lo, hi) in (("vanilla", vanilla), ("tfmem", tuned)):
        best = rows.get((mode, lo)) if lo is not None else None
        out[mode] = {"largest_size": lo, f"largest_{family.label_name}": family.label(lo) if lo else None,
                     "first_failing_size": hi, "failing_status": rows[(mode, hi)]["status"] if hi else None,
                     "params": best and best["params"], "device_peak_bytes": best and best["device_peak_bytes"],
                     "step_time_s": best and best["step_time_s"], "samples_per_s": best and best["samples_per_s"],
                     # the search stopped at its maximum with that size fitting: the true largest may be larger
                     "capped": lo is not None and hi is None and lo == maximum,
                     "gpu_estimate": best and best.get("gpu_estimate")}
    for mode, (lo, _) in (("vanilla", vanilla), ("tfmem", tuned)):
        step = out[mode]["step_time_s"]
        if lo is not None and step:
            flops = rows[(mode, lo)].get("step_flops") or step_flops(family.build(lo))
            out[mode].update(step_flops=flops, flops_per_s=flops / step)
    v, t = out["vanilla"], out["tfmem"]
    # Throughput per unit of work: the slowdown that the passes cost, apart from the larger model's extra work.
    out["work_slowdown"] = v["flops_per_s"] / t["flops_per_s"] if v.get("flops_per_s") and t.get("flops_per_s") \
        else None
    out["ratio"] = t[f"largest_{family.label_name}"] / v[f"largest_{family.label_name}"] \
        if v["largest_size"] and t["largest_size"] else None
    out["slowdown"] = v["samples_per_s"] / t["samples_per_s"] if v["samples_per_s"] and t["samples_per_s"] else None
    if v["gpu_estimate"] and t["gpu_estimate"]:   # the same ratio from the cost model's named GPU and link
        out["gpu_slowdown_range"] = [t["gpu_estimate"]["low_s"] / v["gpu_estimate"]["low_s"],
                                     t["gpu_estimate"]["high_s"] / v["gpu_estimate"]["high_s"]]
    same = rows.get(("tfmem", vanilla[0])) if vanilla[0] is not None else None
    base = rows.get(("vanilla", vanilla[0])) if vanilla[0] is not None else None
    out["same_loss_at_vanilla_largest"] = (same["loss"] == base["loss"]) if same and base and \
        same["status"] == "ok" else None
    out["tfmem_refusals"] = sum(r["status"] == "refused" for r in rows.values())
    out["errors"] = sum(r["status"] == "error" for r in rows.values())
    return out


def render(path: Path) -> Path:
    """Recompute the summary of a results file from its probes and rewrite its ``.json`` and ``.md``.

    For a summary that gained a figure after the probes ran (e.g. the work per step); no probe runs again and
    the command stays the one that produced the probes. Returns the markdown file's path.
    """
    data = json.loads(path.read_text())
    family = dataclasses.replace(families(tiny=False)[data["family"]], kwargs=data["builder_kwargs"])
    rows = {(r["mode"], r["size"]): r for r in data["probes"]}
    old = data["summary"]
    sides = [(old[m]["largest_size"], old[m]["first_failing_size"]) for m in MODES]
    data["summary"] = summarise(family, rows, sides[0], sides[1], data["search"]["maximum"])
    data["summary_rendered"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    _, md_path = write(path.stem, data, markdown(data), path.parent)
    return md_path


def _passes(text: str) -> str | list[str] | None:
    if text == "auto":
        return "auto"
    if text in ("none", ""):
        return None
    return [p.strip() for p in text.split(",") if p.strip()]


def _override(family: Family, items: list[str]) -> Family:
    kwargs = dict(family.kwargs)
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise tfmem.BadInputError(f"max_size: --set takes key=value, got {item!r}")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value          # a bare word, e.g. cell=gru
    return dataclasses.replace(family, kwargs=kwargs)


def main(argv: list[str] | None = None, default_families: list[str] | None = None) -> int:
    """The command line; ``default_families`` replaces "every family" when none is named (the table modules)."""
    parser = argparse.ArgumentParser(prog="python -m experiments.max_size", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", help="moe, resnet16, resnet32, deepspeech (default: all)")
    parser.add_argument("--tiny", action="store_true", help="small models and budget: a smoke run")
    parser.add_argument("--budget", help="testbed device budget, e.g. 64MiB (default: the family's)")
    parser.add_argument("--passes", default="auto", help="'auto', 'none' or a comma-separated list of passes")
    parser.add_argument("--plan-fraction", type=float, default=1.0,
                        help="give optimize this fraction of the budget (optimize keeps its own safety margin)")
    parser.add_argument("--steps", type=int, help="timed steps per probe (default 2, tiny 1)")
    parser.add_argument("--max-size", type=int, help="largest size to try (default: the family's)")
    parser.add_argument("--resolution", type=int,
                        help="stop bisecting when the bracket is this narrow, in sizes (default: the family's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a builder argument, e.g. --set width=16 (repeatable)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="which sides to search: 'vanilla,tfmem' (default), 'vanilla' or 'tfmem'")
    parser.add_argument("--out", default=str(RESULTS), help="directory for the results files")
    parser.add_argument("--render", nargs="+", metavar="JSON", type=Path,
                        help="recompute the summaries of these results files and rewrite them; runs no probe")
    args = parser.parse_args(argv)
    if args.render:
        for path in args.render:
            if not path.is_file():
                parser.error(f"--render: no results file {path}")
            try:
                print(f"rewrote {render(path)}")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                parser.error(f"--render: {path} is not a max_size results file ({type(e).__name__}: {e})")
        return 0
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes takes a comma-separated subset of {', '.join(MODES)}, got {args.modes!r}")
    known = families(args.tiny)
    unknown = [f for f in args.families if f not in known]
    if unknown:
        parser.error(f"unknown family {unknown[0]!r}; choose from {', '.join(known)}")
    if not 0.0 < args.plan_fraction <= 1.0:
        parser.error(f"--plan-fraction must be in (0, 1], got {args.plan_fraction}")
    for name in dict.fromkeys(args.families) or default_families or list(known):   # each once, in the order given
        family = _override(known[name], args.set)
        maximum = args.max_size or family.maximum
        if maximum < family.start:
            parser.error(f"--max-size must be >= {family.start} for {name}")
        if args.resolution is not None:
            family = dataclasses.replace(family, resolution=args.resolution)
        partial = Path(args.out) / f"max_size_{name}.partial.json"

        def checkpoint(probes: list[dict[str, Any]], partial: Path = partial, name: str = name) -> None:
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(provenance(argv, family=name, probes=probes, complete=False),
                                          indent=1, default=str))

        started, load_start = time.perf_counter(), os.getloadavg()
        result = run_family(family, args.budget or family.budget, _passes(args.passes), args.plan_fraction,
                            args.steps or (1 if args.tiny else 2), maximum, quiet=args.tiny, modes=modes,
                            checkpoint=checkpoint)
        result = provenance(argv, **result, run_s=round(time.perf_counter() - started, 1),
                            load_average={"start": load_start, "end": os.getloadavg()})
        json_path, md_path = write(f"max_size_{name}", result, markdown(result), Path(args.out))
        partial.unlink(missing_ok=True)
        print(markdown(result))
        print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
