"""The ``tfmem`` command line: analyze, optimize and run TensorFlow graphs stored as .pb/.pbtxt files.

Usage::

    tfmem analyze GRAPH [--fetch NAME ...] [--feed-shape x:0=32,784 ...] [--device-memory 12GiB] [--json]
                        [--inter-op-threads N]
    tfmem optimize GRAPH -o OUT [--budget 2GiB] [--passes auto|none|name,name] [--report R.md] [--plot M.png]
                                [--trace T.json] [--inter-op-threads N] [--fetch ...] [--feed-shape ...]
    tfmem optimize SAVED_MODEL_DIR --function NAME --budget 2GiB -o OUT_DIR [--device D --host H]
                                [--logical-cpus N] [--passes ...] [--report R.md] [--inter-op-threads N]
    tfmem run GRAPH --testbed 1GiB [--steps 3] [--inter-op-threads N] [--fetch ...] [--feed-shape ...]

Exit codes: 0 success; 2 bad input (one line ``tfmem: error: ...`` on stderr, never a traceback); 3 the graph
ran out of memory on the testbed; 1 an internal error (a bug: ``--traceback`` shows it); 130 interrupted.
"""

from __future__ import annotations

import os

# TensorFlow reads these when it is first imported, so they only help when nothing has imported it yet
# (``import tfmem`` does not: ``tfmem/__init__`` loads its TensorFlow names on first use). Level 2 hides
# INFO/WARNING lines; oneDNN off drops its start-up notice, which ignores the level, and matches the testbed.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import networkx as nx
import numpy as np

import tfmem
from tfmem.errors import BadInputError, TfmemError
from tfmem.ir.graph import GraphIR
from tfmem.ir.ops import CHECKPOINT_OPS, INIT_CHECK_OPS, PLACEHOLDER_OPS, VARIABLE_OPS, VARIABLE_READ_OPS
from tfmem.units import format_bytes, parse_bytes

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT, EXIT_OOM, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
TOP_LIVE = 10  # live tensors listed at the peak
FEED_SEED = 0  # random feeds of ``run`` are reproducible

# Sinks that are bookkeeping, not the step: see ``default_fetches``.
_SOURCE_OPS = PLACEHOLDER_OPS | VARIABLE_OPS | {"Const"}


class _UsageError(BadInputError):
    """A command line argparse rejects; reported like any other bad input."""


class _Parser(argparse.ArgumentParser):
    # argparse prints usage and exits on its own; raise instead so that main() prints one line and returns 2.
    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    """The ``tfmem`` argument parser (subcommands ``analyze``, ``optimize``, ``run``)."""
    parser = _Parser(prog="tfmem", description="Lower the peak device memory of TensorFlow graphs.")
    parser.add_argument("--traceback", action="store_true", help="show the traceback of internal errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{analyze,optimize,run}")
    common = _Parser(add_help=False)
    common.add_argument("graph", help="a GraphDef or MetaGraphDef, binary (.pb) or text (.pbtxt); optimize also "
                        "takes a SavedModel directory")
    common.add_argument("--fetch", action="append", default=[], metavar="NAME",
                        help="tensor ('loss:0') or op ('train_op') to compute; repeat; default: the graph's sinks")
    common.add_argument("--feed-shape", action="append", default=[], metavar="NAME=D1,D2",
                        help="full shape of a fed tensor, e.g. x:0=32,784; repeat")
    common.add_argument("--device", help="device string of the memory to lower (default: where ops are placed)")
    common.add_argument("--host", help="device string of host memory (where swapped tensors go)")
    a = sub.add_parser("analyze", parents=[common], help="simulate one step and explain its peak memory")
    a.add_argument("--device-memory", default="12GiB", help="memory of the virtual GPU for Grappler's estimate")
    a.add_argument("--json", action="store_true", help="print the analysis as JSON")
    a.add_argument("--inter-op-threads", type=int,
                   help="the inter-op threads the session will run with (default: TF's, one per core)")
    o = sub.add_parser("optimize", parents=[common], help="rewrite the graph to fit a memory budget")
    o.add_argument("-o", "--output", required=True,
                   help="where to write the optimized GraphDef (.pb or .pbtxt), or the new SavedModel directory")
    o.add_argument("--function", metavar="NAME",
                   help="with a SavedModel: the function to plan (an attribute such as train_step, a dotted path, "
                        "or a signature key); it must have been saved with a fully defined input_signature")
    o.add_argument("--logical-cpus", type=int, metavar="N",
                   help="with a SavedModel: split the CPU into N logical devices (/CPU:0 ... /CPU:N-1) before "
                        "TensorFlow starts, so that a CPU-only machine has a host to plan for (--host /CPU:1)")
    o.add_argument("--budget", help="device memory to fit in, e.g. 2GiB (default: as low as is cheap)")
    o.add_argument("--device-host", action="append", default=[], metavar="DEVICE=HOST",
                   help="repeatable, instead of --device/--host: plan each DEVICE of a graph over several machines "
                        "against --budget, swapping only to its own HOST, e.g. "
                        "/job:worker/task:1/device:GPU:0=/job:worker/task:1/device:CPU:0")
    o.add_argument("--passes", default="auto", help="'auto', 'none' or comma-separated pass names")
    o.add_argument("--report", help="write the report as markdown to this file")
    o.add_argument("--plot", help="write device memory over one step, before vs after, as a PNG")
    o.add_argument("--trace", help="write the simulated schedule as Chrome trace JSON")
    o.add_argument("--inter-op-threads", type=int,
                   help="the inter-op threads the session will run with (default: TF's, one per core)")
    r = sub.add_parser("run", parents=[common], help="run steps for real on the memory-capped testbed")
    r.add_argument("--testbed", required=True, metavar="SIZE", help="device memory cap, e.g. 1GiB")
    r.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    r.add_argument("--inter-op-threads", type=int, help="the device's inter-op threads (default: TF's)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tfmem`` command line and return its exit code.

    Parameters
    ----------
    argv : arguments without the program name; ``sys.argv[1:]`` when None

    Returns
    -------
    int
        0 on success, 2 on bad input, 3 when ``run`` ran out of memory, 1 on an internal error.

    Examples
    --------
    >>> main(["analyze", "missing.pb"])  # doctest: +SKIP
    tfmem: error: graph file 'missing.pb' does not exist
    2
    """
    args = None
    try:
        args = build_parser().parse_args(argv)
        _quiet_tensorflow()
        return int(_COMMANDS[args.command](args))
    except SystemExit as e:  # --help
        return int(e.code or 0) if isinstance(e.code, int | None) else EXIT_BAD_INPUT
    except TfmemError as e:
        _fail(str(e))
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        _fail("interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:
        if args is not None and args.traceback:
            raise
        _fail(f"internal error: {type(e).__name__}: {e} (rerun with --traceback and report it)")
        return EXIT_INTERNAL


def _fail(message: str) -> None:
    print(f"tfmem: error: {' '.join(message.split())}", file=sys.stderr, flush=True)


def _quiet_tensorflow() -> None:
    # Python-side chatter (deprecation notices through absl and the "tensorflow" logger) would bury the output.
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:  # absl comes with TensorFlow; nothing to silence without it
        pass


# -- shared: graph, fetches, feeds --------------------------------------------------------------------------


def default_fetches(ir: GraphIR) -> list[str]:
    """The fetches ``tfmem`` assumes when none are given: the graph's sinks, minus bookkeeping.

    A sink is a node no other node reads or waits for. Left out, because they are not what a step computes:
    nodes without inputs (constants, placeholders, variables), variable initializers (``v/Assign``,
    ``VarIsInitializedOp`` and NoOps that only group initializers), bare reads of a variable or constant
    (``v/Read/ReadVariableOp``), reads of a variable after an update that another sink runs already (tf_keras'
    batch-norm moving averages), helpers ``tf.gradients`` leaves unused (anything in a ``gradients*/`` scope)
    and checkpoint ops (a ``save/`` scope). A sink with outputs is fetched as tensors (``loss:0``), one without
    (``train_op``) as an op.

    Raises
    ------
    BadInputError
        When no sink is left; pass fetches explicitly then.

    Examples
    --------
    >>> import tensorflow as tf
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.compat.v1.placeholder(tf.float32, (4,), name="x")
    ...     _ = tf.reduce_sum(x * 2.0, name="y")
    >>> default_fetches(tfmem.load(g))
    ['y:0']
    """
    from tfmem.testbed import initializer_names

    inits = set(initializer_names(ir.to_graph_def()))
    sources = {n.name for n in ir if not n.predecessors or n.op in _SOURCE_OPS}
    sinks = []
    for node in ir:
        preds = node.predecessors
        scope = node.name.split("/", 1)[0]
        if (ir.successors[node.name] or node.name in sources or node.name in inits
                or node.op in INIT_CHECK_OPS or node.op in CHECKPOINT_OPS
                or scope.startswith("gradients") or scope == "save"
                or all(p in sources for p in preds) or (node.op == "NoOp" and all(p in inits for p in preds))):
            continue
        sinks.append(node)
    # A variable read after its update (tf_keras reads each batch-norm moving average so) is bookkeeping when
    # the other sinks run that update already.
    reads = [n for n in sinks if n.op in VARIABLE_READ_OPS]
    kept = [n for n in sinks if n.op not in VARIABLE_READ_OPS]
    ran = set().union(*(nx.ancestors(ir.nx, n.name) for n in kept))
    kept += [n for n in reads if not kept or not set(n.predecessors) - sources <= ran]
    order = {n.name: i for i, n in enumerate(sinks)}
    fetches: list[str] = []
    for node in sorted(kept, key=lambda n: order[n.name]):
        fetches += [f"{node.name}:{i}" for i in range(len(node.outputs))] or [node.name]
    if not fetches:
        raise BadInputError("found no sink to fetch in the graph; name what a step computes with --fetch")
    return fetches


def _load(args: argparse.Namespace) -> tuple[GraphIR, list[str], bool]:
    """The annotated graph, the fetches, and whether those were assumed (no --fetch given)."""
    from tfmem.ir.devices import check_device
    from tfmem.ir.execution import parse_fetches
    from tfmem.ir.shapes import parse_feed_shapes

    check_device(args.device, "--device")
    check_device(args.host, "--host")
    args.feed_shapes = parse_feed_shapes(args.feed_shape) or None
    ir = tfmem.load(args.graph, args.feed_shapes)
    if not args.fetch:
        return ir, default_fetches(ir), True
    parse_fetches(ir, args.fetch)  # a typo fails here, by name, before Grappler sees it
    return ir, list(args.fetch), False


SAID_FETCHES = 8   # fetches named in the printed line; --json lists them all


def _say_fetches(fetches: list[str], assumed: bool) -> None:
    how = "assumed: the graph's sinks; choose with --fetch" if assumed else "given"
    more = f" and {len(fetches) - SAID_FETCHES} more" if len(fetches) > SAID_FETCHES else ""
    print(f"fetches ({how}): {', '.join(fetches[:SAID_FETCHES])}{more}")


# -- analyze ------------------------------------------------------------------------------------------------


def cmd_analyze(args: argparse.Namespace) -> int:
    """``tfmem analyze``: simulator and Grappler peaks side by side, and what is live at the peak."""
    from tfmem.measure import grappler_peak

    device_memory = parse_bytes(args.device_memory, what="--device-memory", minimum=1)
    ir, fetches, assumed = _load(args)
    if args.inter_op_threads is not None:
        from tfmem.sim.arguments import check_count

        check_count(args.inter_op_threads, "--inter-op-threads (0: TensorFlow's default)")
    # The step as the session runs it, simulated as optimize simulates its "before": one vanilla peak.
    profile = tfmem.unoptimized_profile(ir, fetches, feed_shapes=args.feed_shapes, device=args.device,
                                        host=args.host, inter_op_threads=args.inter_op_threads or None)
    grappler = grappler_peak(ir, fetches, memory=device_memory, host=args.host)
    result = _analysis(args.graph, ir, fetches, assumed, profile, grappler, device_memory)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_analysis(result)
    return EXIT_OK


def _analysis(path: str, ir: GraphIR, fetches: list[str], assumed: bool, profile: tfmem.MemoryProfile,
              grappler: int, device_memory: int) -> dict[str, Any]:
    live = [{"tensor": t.tensor, "nbytes": t.nbytes, "kind": t.kind, "producer": t.producer}
            for t in profile.live_at_peak[:TOP_LIVE]]
    return {
        "graph": path, "ops": len(ir), "ops_per_step": len(profile.schedule.order),
        "fetches": fetches, "fetches_assumed": assumed,
        "simulator": {"peak_bytes": profile.peak_bytes, "persistent_bytes": profile.persistent_bytes,
                      "transient_bytes": profile.transient_peak_bytes, "host_peak_bytes": profile.host_peak_bytes,
                      "peak_at": profile.peak_unit, "estimated_step_s": profile.estimated_step_s},
        "grappler": {"peak_bytes": grappler, "virtual_gpu_memory_bytes": device_memory},
        "live_at_peak": live, "notes": list(profile.notes),
    }


def _print_analysis(r: dict[str, Any]) -> None:
    sim, grap = r["simulator"], r["grappler"]
    print(f"graph: {r['graph']} ({r['ops']} ops; {r['ops_per_step']} run per step after Grappler)")
    _say_fetches(r["fetches"], r["fetches_assumed"])
    print()
    rows = [
        ("device peak", sim["peak_bytes"], "simulator"),
        ("device peak", grap["peak_bytes"],
         f"Grappler estimate (virtual GPU, {format_bytes(grap['virtual_gpu_memory_bytes'])})"),
        ("  persistent", sim["persistent_bytes"], "simulator (constants, variables)"),
        ("  transient", sim["transient_bytes"], "simulator (activations, gradients, scratch)"),
        ("host peak", sim["host_peak_bytes"], "simulator"),
    ]
    print(f"{'figure':<14}{'bytes':>12}  instrument")
    for label, nbytes, instrument in rows:
        print(f"{label:<14}{format_bytes(nbytes):>12}  {instrument}")
    print(f"\npeak reached while running {sim['peak_at']}; largest tensors live there (simulator):")
    for t in r["live_at_peak"]:
        print(f"  {format_bytes(t['nbytes']):>12}  {t['kind']:<10}  {t['tensor']} ({t['producer']})")
    for note in r["notes"]:
        print(f"note: {note}")


# -- optimize -----------------------------------------------------------------------------------------------


def cmd_optimize(args: argparse.Namespace) -> int:
    """``tfmem optimize``: run the passes for a budget and write the optimized GraphDef and the report."""
    from tfmem.saved_model import is_saved_model

    if args.function is not None or is_saved_model(args.graph):
        return _optimize_saved_model(args)
    if args.logical_cpus is not None:
        raise BadInputError("--logical-cpus applies to a SavedModel (a graph file is planned without running "
                            "TensorFlow's devices)")
    budget = parse_bytes(args.budget, what="--budget", minimum=1) if args.budget is not None else None
    passes = _passes(args.passes)
    ir, fetches, assumed = _load(args)
    _say_fetches(fetches, assumed)
    if args.inter_op_threads is not None:
        from tfmem.sim.arguments import check_count

        check_count(args.inter_op_threads, "--inter-op-threads (0: TensorFlow's default)")
    devices = _device_hosts(args.device_host) if args.device_host else None
    opt = tfmem.optimize(ir, fetches, budget=budget, feed_shapes=args.feed_shapes, device=args.device,
                         host=args.host, passes=passes, inter_op_threads=args.inter_op_threads or None,
                         devices=devices)
    _write(Path(args.output), lambda p: _write_graph(opt.graph_def, p))
    print(f"wrote {args.output} ({len(opt.graph_def.node)} ops)")
    if opt.config.ByteSize():
        # The GraphDef cannot carry it: a kept graph may need one inter-op thread, a graph Grappler rejects
        # needs Grappler off (tests/test_cli.py::test_optimize_prints_the_session_config_to_run_with).
        from google.protobuf import text_format

        print(f"run it with this session config (tf.compat.v1.ConfigProto): "
              f"{text_format.MessageToString(opt.config, as_one_line=True)}")
    print()
    markdown = opt.report.to_markdown()
    print(markdown, end="")
    for path, write in ((args.report, lambda p: p.write_text(markdown)), (args.plot, opt.report.plot),
                        (args.trace, opt.report.chrome_trace)):
        if path:
            _write(Path(path), write)
            print(f"wrote {path}")
    return EXIT_OK


def _device_hosts(values: list[str]) -> dict[str, str]:
    """``--device-host DEVICE=HOST`` values as ``optimize``'s ``devices``; the strings are checked there."""
    out: dict[str, str] = {}
    for value in values:
        device, sep, host = value.partition("=")
        if not sep or not device or not host:
            raise BadInputError(f"--device-host {value!r} must be DEVICE=HOST, e.g. "
                                "/job:worker/task:1/device:GPU:0=/job:worker/task:1/device:CPU:0")
        if device in out:
            raise BadInputError(f"--device-host names {device!r} twice; give each device once")
        out[device] = host
    return out


def _optimize_saved_model(args: argparse.Namespace) -> int:
    """``tfmem optimize SAVED_MODEL_DIR --function NAME``: plan a function of a SavedModel and save a new one whose
    function runs the plan, on the same variables (``tfmem.saved_model``)."""
    from tfmem.ir.devices import check_device
    from tfmem.saved_model import optimize_saved_model, saved_model_functions

    for flag, given in (("--fetch", args.fetch), ("--feed-shape", args.feed_shape)):
        if given:
            raise BadInputError(f"{flag} does not apply to a SavedModel: its function's signature gives the inputs "
                                "and its outputs and updates are what a step computes")
    if args.budget is None:
        raise BadInputError("a SavedModel needs --budget, e.g. --budget 2GiB")
    budget = parse_bytes(args.budget, what="--budget", minimum=1)
    passes = _passes(args.passes)
    check_device(args.device, "--device")
    check_device(args.host, "--host")
    if args.inter_op_threads is not None:
        from tfmem.sim.arguments import check_count

        check_count(args.inter_op_threads, "--inter-op-threads (0: TensorFlow's default)")
    if args.logical_cpus is not None:
        _split_cpu(args.logical_cpus)
    _check_devices_exist(args)
    if args.function is None:
        raise BadInputError(f"{args.graph!r} is a SavedModel: name the function to plan with --function NAME (it "
                            f"has: {', '.join(saved_model_functions(args.graph)) or 'none'})")
    result = optimize_saved_model(args.graph, args.function, args.output, budget=budget, device=args.device,
                                  host=args.host, passes=passes, inter_op_threads=args.inter_op_threads or None)
    print(f"wrote {args.output} (a SavedModel whose {args.function} runs the plan, on the source's variables; "
          f"load it where --host exists)")
    markdown = ""
    for signature, report in zip(result.signatures, result.reports, strict=True):
        markdown += f"\n{args.function}{signature}:\n\n{report.to_markdown()}"
    print(markdown, end="")
    first = result.reports[0]
    which = " (the first signature's)" if len(result.reports) > 1 else ""
    for path, write, said in ((args.report, lambda p: p.write_text(markdown.lstrip()), ""),
                              (args.plot, first.plot, which), (args.trace, first.chrome_trace, which)):
        if path:
            _write(Path(path), write)
            print(f"wrote {path}{said}")
    return EXIT_OK


def _split_cpu(count: int) -> None:
    """``--logical-cpus``: split the CPU into ``count`` logical devices, before TensorFlow starts its devices."""
    import tensorflow as tf

    if count < 1:
        raise BadInputError(f"--logical-cpus must be at least 1, got {count}")
    try:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError:   # devices started already: only when main() is called inside a TensorFlow program
        if len(tf.config.list_logical_devices("CPU")) != count:
            raise BadInputError(f"--logical-cpus {count}: TensorFlow has started its devices in this process "
                                "already; run the tfmem command in a process of its own") from None


def _check_devices_exist(args: argparse.Namespace) -> None:
    from tfmem.planned_function import check_exists

    for flag, device in (("--device", args.device), ("--host", args.host)):
        if device is None:
            continue
        try:
            check_exists(device, flag)
        except BadInputError as e:
            raise BadInputError(f"{e} (on a machine with one CPU, --logical-cpus 2 makes /CPU:1 a host to swap "
                                "to)") from None


def _passes(spec: str) -> str | list[str]:
    """``--passes``: ``auto``, ``none`` or a comma-separated list of pass names.

    Raises
    ------
    BadInputError
        For an empty name (``--passes ''``, ``a,,b``) or an unknown one; the message lists the passes.
    """
    from passes import PASSES

    if spec.strip() in ("auto", "none"):
        return "auto" if spec.strip() == "auto" else []
    known = f"{', '.join(sorted(PASSES))}; or 'auto' (the default) or 'none'"
    names = [p.strip() for p in spec.split(",")]
    for name in names:
        if not name:
            raise BadInputError(f"--passes {spec!r} has an empty pass name; give comma-separated names from {known}")
        if name not in PASSES:
            raise BadInputError(f"--passes: unknown pass {name!r}; give comma-separated names from {known}")
    return names


def _write_graph(graph_def: Any, path: Path) -> None:
    from google.protobuf import text_format

    if path.suffix == ".pbtxt":
        path.write_text(text_format.MessageToString(graph_def))
    else:
        path.write_bytes(graph_def.SerializeToString())


def _write(path: Path, write: Callable[[Path], object]) -> None:
    try:
        write(path)
    except OSError as e:
        raise BadInputError(f"cannot write {str(path)!r}: {e.strerror or e}") from None


# -- run ----------------------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    """``tfmem run``: run the graph on the testbed with random feeds; print its peaks or that it ran out."""
    from tfmem.sim.arguments import check_count
    from tfmem.testbed import Testbed

    cap = parse_bytes(args.testbed, what="--testbed", minimum=1)
    if cap < 2**20:   # the testbed's own minimum, said before anything is loaded or printed
        raise BadInputError(f"--testbed must be at least 1MiB (TensorFlow's allocator cap is in MiB), got "
                            f"{format_bytes(cap)}; e.g. --testbed 64MiB")
    if args.steps < 1:
        raise BadInputError(f"--steps must be at least 1, got {args.steps}")
    if args.inter_op_threads is not None:
        check_count(args.inter_op_threads, "--inter-op-threads (0: TensorFlow's default)")
    ir, fetches, assumed = _load(args)
    _say_fetches(fetches, assumed)
    feeds = random_feeds(ir, fetches)
    print("feeds (random, seed 0): " + (", ".join(f"{k} {v.dtype}{list(v.shape)}" for k, v in feeds.items())
                                        or "none"))
    print(f"starting the testbed (device capped at {format_bytes(cap)}) ...", flush=True)
    with Testbed(cap, inter_op_threads=args.inter_op_threads) as tb:
        result = tb.run(ir.to_graph_def(), fetches, feeds, steps=args.steps)
    if result.oom:
        print(f"OUT OF MEMORY on the testbed device (cap {format_bytes(cap)}): {result.error}")
        return EXIT_OOM
    print(f"device peak {format_bytes(result.device_peak_bytes or 0)}, host peak "
          f"{format_bytes(result.host_peak_bytes or 0)} (testbed, measured over 1 warm-up + {args.steps} steps)")
    print(f"step time {(result.step_time_s or 0) * 1e3:.2f} ms (median of {args.steps}, testbed)")
    for name, value in result.outputs.items():
        shown = f"{value.item():.6g}" if value.size == 1 and value.dtype.kind == "f" else f"{value.dtype}{list(value.shape)}"
        print(f"  {name} = {shown}")
    return EXIT_OK


def random_feeds(ir: GraphIR, fetches: Sequence[str], seed: int = FEED_SEED) -> dict[str, np.ndarray]:
    """Fixed-seed values for every placeholder that computing ``fetches`` needs.

    Floats are standard normal, integers 0 or 1 (valid labels and indices for any class count), booleans
    random, strings empty. Shapes come from the graph (with ``--feed-shape`` applied).

    Raises
    ------
    UnknownShapeError
        Listing the placeholders whose shape is not fully known.

    Examples
    --------
    >>> import tensorflow as tf
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.compat.v1.placeholder(tf.float32, (2, 3), name="x")
    ...     _ = tf.reduce_sum(x, name="y")
    >>> {k: v.shape for k, v in random_feeds(tfmem.load(g), ["y:0"]).items()}
    {'x:0': (2, 3)}
    """
    from tfmem.ir.execution import ExecutionGraph
    from tfmem.ir.shapes import require_known

    fed = sorted(ExecutionGraph.build(ir, fetches).fed)
    require_known(ir, fed)
    rng = np.random.default_rng(seed)
    feeds = {}
    for ref in fed:
        spec = ir.spec(ref)
        shape = tuple(int(d or 0) for d in spec.shape or ())
        dtype = np.dtype(_numpy_dtype(spec.dtype))
        if dtype.kind == "f":
            value = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iu":
            value = rng.integers(0, 2, shape).astype(dtype)
        elif dtype.kind == "b":
            value = rng.integers(0, 2, shape).astype(bool)
        else:
            value = np.full(shape, b"", dtype=object)
        feeds[str(ref)] = value
    return feeds


def _numpy_dtype(name: str) -> Any:
    # tf.string has no fixed-width numpy dtype; TF accepts object arrays of bytes for it.
    import tensorflow as tf

    dtype = tf.as_dtype(name)
    return object if dtype == tf.string else dtype.as_numpy_dtype


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "analyze": cmd_analyze, "optimize": cmd_optimize, "run": cmd_run,
}

if __name__ == "__main__":
    sys.exit(main())
