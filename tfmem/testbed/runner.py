"""The testbed: run a graph for real on an emulated accelerator whose memory is capped, and measure its peak.

Two child processes make the emulated machine:

- the *device* process, a ``tf.distribute.Server`` for job ``worker`` whose CPU allocator is TensorFlow's BFC
  allocator capped at ``device_memory`` (``TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=...``,
  oneDNN off because its allocator ignores the cap). Going over the cap is a real ``ResourceExhaustedError``.
- the *host* process, job ``host``, uncapped. Tensors moving between the two are real copies over loopback gRPC.

The calling process is the client: it runs a ``tf.compat.v1.Session`` against the device server, which is also
the master (so Grappler runs there, on the session's config).

Measurement. Each child reports ``tf.config.experimental.get_memory_info('CPU:0')``: that reads the allocator
of the child's eager CPU device, which is the same process-wide ``ProcessState`` CPU allocator the server's
kernels allocate from (``bfc_cpu_allocator_for_gpu`` in step stats; the tests check that the figure follows the
served graph's tensors and variables). A run initialises variables in a session of its own (so the init graph's
constants are freed), runs one warm-up step, resets the peak, then runs the timed steps: the peak includes
what stays resident (variables, Const kernels' tensors) plus the steps' transients, but not what the master
allocates while it optimises the graph on the first step (Grappler's constant folding evaluates in the device
process). Figures are BFC chunk sizes: each request is rounded up to 256 bytes, and a free chunk of c bytes
is split for a request of r only if c >= 2r or c - r >= 128 MiB, else used whole; so near the cap the peak can
exceed the sum of live tensor sizes. The device process reserves its whole budget at start (a 2 MiB region
and one of the rest, as a GPU's BFC holds one region): every run then starts from the same allocator state,
and peaks do not depend on earlier runs. The host's allocator grows by regions and is not reserved, so its
peak can overcount by whole-chunk reuse.

Facts ``tests/test_testbed.py`` pins: a fed tensor lives in the device process for the whole step and is never
forwarded; elementwise ops forward a dying input's buffer in place; a tensor an op reads on the other job is a
real copy.

Gaps. TensorFlow's gRPC server listens on ``0.0.0.0`` (hard-coded in ``grpc_server_lib.cc``); the cluster's
addresses are ``127.0.0.1`` so all traffic stays on loopback, but the ports are reachable from outside while a
testbed is open. ``PR_SET_PDEATHSIG`` fires when the *thread* that started a child exits, so create and use a
Testbed from one long-lived thread.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import shutil
import statistics
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from tfmem.errors import BadInputError, TestbedError
from tfmem.testbed.graph import DEVICE, HOST, GraphLike, check_names, initializer_names, place_on_device
from tfmem.testbed.proc import COMMON_ENV, ServerProcess, free_ports
from tfmem.units import format_bytes, parse_bytes

__all__ = ["DEVICE", "HOST", "RunResult", "Testbed", "initializer_names", "place_on_device"]

_log = logging.getLogger(__name__)
_LIVE: weakref.WeakSet[Testbed] = weakref.WeakSet()


@dataclass(frozen=True)
class RunResult:
    """What one ``Testbed.run`` measured.

    ``oom`` is True when the device went over its cap; ``error`` then holds a one-line summary. Peaks are
    allocator bytes (BFC chunk sizes) over the timed steps, resident variables and constants included;
    ``step_time_s`` is the median client wall time of the timed steps; ``outputs`` maps each tensor fetch to
    its value at the last step. ``run_metadata`` is the last step's full trace when ``run(trace=True)``.
    """

    oom: bool
    error: str | None
    device_peak_bytes: int | None
    host_peak_bytes: int | None
    step_time_s: float | None
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    run_metadata: tf.compat.v1.RunMetadata | None = None


def _physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _is_oom(error: tf.errors.OpError) -> bool:
    text = str(error)
    return "OOM when allocating" in text or "out of memory" in text.lower()


def _one_line(error: BaseException) -> str:
    """The informative line of a TF error: the OOM line if any, else the first line that is not boilerplate."""
    lines = [ln.strip() for ln in str(getattr(error, "message", error)).splitlines() if ln.strip()]
    oom = [ln for ln in lines if ln.startswith("OOM when allocating")]
    node = getattr(error, "node_def", None)
    where = f" at node {getattr(node, 'name', '')!r}" if getattr(node, "name", "") else ""
    text = oom[0] if oom else next((ln for ln in lines if ln != "Graph execution error:"), "")
    return f"{type(error).__name__}{where}: {text}"[:500]


class Testbed:
    """An emulated accelerator with ``device_memory`` bytes, plus an uncapped host; a context manager.

    Parameters
    ----------
    device_memory : int or str
        The device's cap, e.g. ``"1GiB"`` (whole MiB; ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` takes MiB).
    inter_op_threads, intra_op_threads : int, optional
        The device server's executor and kernel thread pools (TF's defaults when None). ``run`` can ask for
        another inter-op count; the servers are then restarted.
    start_timeout_s : float
        How long to wait for both servers to accept connections.
    step_timeout_s : float
        The longest any one ``Session.run`` may take (initialisation, warm-up, a timed step); a run that
        takes longer raises ``TestbedError`` (naming a server that died, if one did) instead of hanging.

    Raises
    ------
    BadInputError
        If ``device_memory`` is under 1 MiB or the thread counts are negative.
    TestbedError
        If a server does not start; the message carries the end of its stderr.

    Examples
    --------
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.compat.v1.placeholder(tf.float32, [1024], name="x")
    ...     y = tf.multiply(x, 2.0, name="y")
    >>> with Testbed(device_memory="64MiB") as tb:                       # doctest: +SKIP
    ...     r = tb.run(g, ["y:0"], {"x:0": np.ones(1024, np.float32)})
    >>> r.oom, r.outputs["y:0"][0]                                       # doctest: +SKIP
    (False, 2.0)

    A Testbed is not thread-safe; use it from one thread, which should outlive it (see the module's gaps).
    """

    __test__ = False  # not a pytest test class

    def __init__(self, device_memory: int | str, *, inter_op_threads: int | None = None,
                 intra_op_threads: int | None = None, start_timeout_s: float = 120.0,
                 step_timeout_s: float = 600.0) -> None:
        budget = parse_bytes(device_memory, what="device_memory")
        if budget < 2**20:
            raise BadInputError(f"testbed: device_memory must be at least 1 MiB, got {format_bytes(budget)}")
        for name, n in (("inter_op_threads", inter_op_threads), ("intra_op_threads", intra_op_threads)):
            if n is not None and n < 0:
                raise BadInputError(f"testbed: {name} must be >= 0 (0 = TF's default), got {n}")
        self.device_memory_bytes = budget // 2**20 * 2**20
        self.inter_op_threads = inter_op_threads or 0
        self.intra_op_threads = intra_op_threads or 0
        self.start_timeout_s = start_timeout_s
        self.step_timeout_s = step_timeout_s
        _remove_orphaned_workdirs()
        self._workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-"))
        self._procs: dict[str, ServerProcess] = {}
        self._running_inter_op = -1
        self._closed = False
        _LIVE.add(self)
        try:
            self._start(self.inter_op_threads)
        except BaseException:
            self.close()
            raise

    # -- life cycle -------------------------------------------------------------------------------------

    @property
    def target(self) -> str:
        """The device server's gRPC target, for ``tf.compat.v1.Session(target=...)``."""
        return f"grpc://{self.cluster['worker'][0]}"

    @property
    def pids(self) -> dict[str, int]:
        """Process ids of the running servers, by job."""
        return {job: p.pid for job, p in self._procs.items()}

    def _env(self, job: str) -> dict[str, str]:
        # The host gets a BFC allocator too, capped at physical memory (i.e. uncapped): TF's default CPU
        # allocator keeps no statistics, so get_memory_info would fail there.
        limit = self.device_memory_bytes if job == "worker" else _physical_memory_bytes()
        return {**COMMON_ENV, "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(limit // 2**20)}

    def _start(self, inter_op: int) -> None:
        for attempt in range(3):
            worker_port, host_port = free_ports(2)
            self.cluster = {"worker": [f"127.0.0.1:{worker_port}"], "host": [f"127.0.0.1:{host_port}"]}
            for job in ("worker", "host"):  # both start now and import TF in parallel
                args = (inter_op, self.intra_op_threads, self.device_memory_bytes) if job == "worker" else ()
                self._procs[job] = ServerProcess(job, self.cluster, self._env(job), self._workdir, *args)
            try:
                deadline = time.monotonic() + self.start_timeout_s
                for proc in self._procs.values():
                    proc.wait_ready(max(deadline - time.monotonic(), 1.0))
                self._running_inter_op = inter_op
                self.idle_device_bytes = int(self._procs["worker"].call("stats")["current"])
                return
            except TestbedError as e:
                self._kill_servers()
                lost_port = "Could not start gRPC server" in str(e)  # a port taken between probe and bind
                if not lost_port or attempt == 2:
                    raise

    def _kill_servers(self) -> None:
        for proc in self._procs.values():
            proc.kill()
        self._procs = {}
        self._running_inter_op = -1

    def _restart(self, inter_op: int) -> None:
        self._kill_servers()
        self._start(inter_op)

    def close(self) -> None:
        """Kill both servers and remove the temp dir. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._kill_servers()
        for path in sorted(self._workdir.glob("*")):
            path.unlink(missing_ok=True)
        self._workdir.rmdir()
        _LIVE.discard(self)

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()

    def _healthy(self) -> bool:
        try:
            return all(p.alive() and p.call("ping", timeout_s=10)["ok"] for p in self._procs.values())
        except TestbedError:
            return False

    # -- running ----------------------------------------------------------------------------------------

    def run(self, graph: GraphLike, fetches: list[str], feeds: dict[str, Any] | None = None, steps: int = 3,
            config: tf.compat.v1.ConfigProto | None = None, inter_op_threads: int | None = None,
            init_ops: list[str] | None = None, trace: bool = False) -> RunResult:
        """Run ``graph`` on the testbed: initialise variables, one warm-up step, ``steps`` timed steps.

        Parameters
        ----------
        graph : tf.Graph or GraphDef
            Placed with ``place_on_device`` first, so unplaced nodes run on the capped device.
        fetches : list of str
            Tensor names (``"y:0"``, whose values come back in ``outputs``) and op names (run as targets).
        feeds : dict, optional
            Tensor name to value.
        steps : int
            Timed steps after the warm-up; at least 1.
        config : ConfigProto, optional
            The client session's config (Grappler options etc.).
        inter_op_threads : int, optional
            The device's executor pool for this run; None means the Testbed's default. A change restarts the
            servers (the pool is fixed when a server starts).
        init_ops : list of str, optional
            Ops to run once before measuring; default ``initializer_names(graph_def)``.
        trace : bool
            Trace the last timed step (``RunOptions.FULL_TRACE``: every op's start and end and the allocator's
            bytes in use after it) into ``RunResult.run_metadata``; that step's time then includes tracing.

        Returns
        -------
        RunResult
            ``oom=True`` (and no exception) when the device went over its cap.

        Raises
        ------
        BadInputError
            If a fetch or feed names no node of the graph, or ``steps < 1``.
        TestbedError
            On any other TensorFlow error (bad feed value, uninitialised variable, dead server); the servers
            are restarted if needed, so the Testbed stays usable.

        Examples
        --------
        >>> with Testbed("64MiB") as tb:                                     # doctest: +SKIP
        ...     r = tb.run(graph, ["train_op", "loss:0"], {"x:0": batch}, steps=5)
        >>> r.device_peak_bytes, r.outputs["loss:0"]                         # doctest: +SKIP
        """
        g, init = self._prepare(graph, fetches, feeds, steps, inter_op_threads, init_ops)
        try:
            return self._measure(g, list(fetches), dict(feeds or {}), steps, config, init, trace)
        except tf.errors.ResourceExhaustedError as e:
            if not _is_oom(e):  # e.g. gRPC's message-size limit also says RESOURCE_EXHAUSTED
                raise self._failed(fetches, e) from e
            self._settle()
            return RunResult(oom=True, error=_one_line(e), device_peak_bytes=None, host_peak_bytes=None,
                             step_time_s=None)
        except tf.errors.InvalidArgumentError as e:
            # The worker turns fed values into tensors with the capped allocator; when that allocation fails
            # TF reports the feed as an "Invalid TensorProto": the device is out of memory before any op runs.
            if "Invalid TensorProto for feed value" not in str(e):
                raise self._failed(fetches, e) from e
            self._settle()
            return RunResult(oom=True, error=f"the feeds do not fit in device memory ({_one_line(e)})",
                             device_peak_bytes=None, host_peak_bytes=None, step_time_s=None)
        except tf.errors.OpError as e:
            raise self._failed(fetches, e) from e

    def _failed(self, fetches: list[str], error: tf.errors.OpError) -> TestbedError:
        dead = [f"{p.job} server died; its stderr ends with:\n{p.stderr_tail()}"
                for p in self._procs.values() if not p.alive()]
        self._settle()
        message = (
            f"testbed: running fetches {fetches[:5]} failed with {_one_line(error)}. Check the feed values, and "
            f"that every variable is initialised (initializer_names() finds 'v/Assign' ops; else pass init_ops=...)."
        )
        return TestbedError("\n".join([message, *dead]))

    def _prepare(self, graph: GraphLike, fetches: list[str], feeds: dict[str, Any] | None, steps: int,
                 inter_op_threads: int | None, init_ops: list[str] | None) -> tuple[tf.Graph, list[str]]:
        """Check the arguments, (re)start the servers if needed, and import the placed graph."""
        if self._closed:
            raise TestbedError("testbed: run() on a closed Testbed; open a new one")
        if steps < 1:
            raise BadInputError(f"testbed: steps must be >= 1, got {steps}")
        graph_def = place_on_device(graph)
        check_names(graph_def, [*fetches, *(feeds or {})])
        inter_op = self.inter_op_threads if inter_op_threads is None else inter_op_threads
        if inter_op != self._running_inter_op or not self._healthy():
            self._restart(inter_op)
        g = tf.Graph()
        with g.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        return g, initializer_names(graph_def) if init_ops is None else list(init_ops)

    def _measure(self, g: tf.Graph, fetches: list[str], feeds: dict[str, Any], steps: int,
                 config: tf.compat.v1.ConfigProto | None, init: list[str], trace: bool = False) -> RunResult:
        # Reset drops every resource container (variables) on both jobs, so runs are independent.
        tf.compat.v1.Session.reset(self.target)
        config = copy.deepcopy(config) or tf.compat.v1.ConfigProto()
        config.isolate_session_state = False  # variables must outlive the init session
        # A server that dies mid-step leaves the client waiting forever on gRPC: bound every call instead.
        config.operation_timeout_in_ms = int(self.step_timeout_s * 1000)
        if init:  # own session: closing it frees the init graph's Const kernels; variables stay in the worker
            with tf.compat.v1.Session(self.target, graph=g, config=config) as sess:
                sess.run(init, options=tf.compat.v1.RunOptions(timeout_in_ms=int(self.step_timeout_s * 1000)))
        times, values = [], []
        # Per call too: a distributed session does not apply operation_timeout_in_ms to its RunStep RPC, and a
        # device server that crashes mid-step (TF's gRPC receive path can crash instead of raising OOM) would
        # otherwise leave this call waiting forever.
        options = tf.compat.v1.RunOptions(timeout_in_ms=int(self.step_timeout_s * 1000))
        with tf.compat.v1.Session(self.target, graph=g, config=config) as sess:
            # Warm-up first: the master runs Grappler on it, in the device process, and constant folding's
            # temporaries would otherwise count. Kernels' Const tensors and variables stay resident, so
            # resetting the peak afterwards still counts them.
            sess.run(fetches, feeds, options=options)
            for proc in self._procs.values():
                proc.call("reset")
            metadata = tf.compat.v1.RunMetadata() if trace else None
            for i in range(steps):
                traced = trace and i == steps - 1
                if traced:
                    options.trace_level = tf.compat.v1.RunOptions.FULL_TRACE
                start = time.perf_counter()
                values = sess.run(fetches, feeds, options=options, run_metadata=metadata if traced else None)
                times.append(time.perf_counter() - start)
            device, host = (self._procs[j].call("stats") for j in ("worker", "host"))
        self._settle()
        outputs = {name: np.asarray(v) for name, v in zip(fetches, values, strict=True) if ":" in name}
        return RunResult(oom=False, error=None, device_peak_bytes=int(device["peak"]),
                         host_peak_bytes=int(host["peak"]), step_time_s=statistics.median(times),
                         outputs=outputs, run_metadata=metadata)

    def _settle(self) -> None:
        """Free the last run's state; restart the servers if that does not bring the device back to idle."""
        current = -1
        if not all(p.alive() for p in self._procs.values()):  # a reset would wait on a dead master forever
            self._restart(self._running_inter_op)
            return
        try:
            tf.compat.v1.Session.reset(self.target)
            for _ in range(10):  # graph deregistration may lag the reset a little
                current = int(self._procs["worker"].call("stats")["current"])
                if current == self.idle_device_bytes:
                    return
                time.sleep(0.05)
        except (tf.errors.OpError, TestbedError):
            pass
        _log.info("testbed: device holds %d bytes after a run (idle: %d); restarting the servers",
                  current, self.idle_device_bytes)
        self._restart(self._running_inter_op)


WORKDIR_PREFIX = "tfmem-testbed-"   # then the owner's pid: tfmem-testbed-<pid>-<random>


def _remove_orphaned_workdirs() -> None:
    """Remove the temp dirs of testbeds whose process ended without closing them (SIGKILLed: no exit hook ran;
    the servers die with it, their stderr files stay). Each dir's name carries its owner's pid; a dir whose owner
    still runs (or whose pid a new process took), or without a pid in its name, is left alone."""
    for path in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*-*"):
        owner = path.name[len(WORKDIR_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not _process_exists(int(owner)):
            shutil.rmtree(path, ignore_errors=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@atexit.register
def _close_all() -> None:
    for tb in list(_LIVE):
        tb.close()
