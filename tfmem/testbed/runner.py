"""The testbed: run a graph for real on emulated accelerators whose memory is capped, and measure their peaks.

Two child processes make one emulated machine (``machines=M`` starts M of them, 2M children, one cluster):

- the *device* process, a ``tf.distribute.Server`` for job ``worker`` (task = machine) whose CPU allocator is
  TensorFlow's BFC allocator capped at ``device_memory`` (``TF_CPU_ALLOCATOR_USE_BFC=true
  TF_CPU_BFC_MEM_LIMIT_IN_MB=...``, oneDNN off because its allocator ignores the cap). Going over the cap is a real ``ResourceExhaustedError``.
- the *host* process, job ``host`` (task = machine), uncapped. Tensors moving between any two servers are real
  copies over loopback gRPC.

The calling process is the client: it runs a ``tf.compat.v1.Session`` against machine 0's device server, which
is also the master (so Grappler runs there, on the session's config). Each device server's allocator is capped
on its own, so an out-of-memory names the device that went over.

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
import dataclasses
import hashlib
import logging
import os
import re
import shutil
import statistics
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from tfmem.errors import (
    BadInputError,
    TestbedCrashError,
    TestbedError,
    TestbedTimeoutError,
    TfmemError,
    first_line,
)
from tfmem.testbed.eager import Connected, connect
from tfmem.testbed.graph import (
    DEVICE,
    HOST,
    GraphLike,
    check_names,
    device_name,
    initializer_names,
    place_on_device,
)
from tfmem.testbed.proc import COMMON_ENV, ServerProcess, free_ports
from tfmem.testbed.watch import Ending, Phase, watch
from tfmem.units import format_bytes, parse_bytes

__all__ = ["DEVICE", "HOST", "RunResult", "Testbed", "initializer_names", "place_on_device"]

_log = logging.getLogger(__name__)
_LIVE: weakref.WeakSet[Testbed] = weakref.WeakSet()
# A phase of a run (initialisation, the warm-up, a step) may take this many times its longest phase in the last
# run of the same graph that ran (a roomy run, typically), and at least MIN_PHASE_TIMEOUT_S: a hang then costs
# seconds, not step_timeout_s. Keyed by a digest of the placed graph and fetches, for every testbed in the process.
PHASE_TIMEOUT_FACTOR = 10.0
MIN_PHASE_TIMEOUT_S = 20.0
SETTLE_TIMEOUT_S = 30.0
TF_DEADLINE_SLACK_S = 5.0   # TF's deadline on a call: the phase limit and this (the watch acts first)
_PHASE_TIMES: dict[bytes, float] = {}
# TF_BFC_MEMORY_DUMP's prefix in the work dir, then the machine: a device allocator's maps at failed requests
# are files bfc-<machine>_<...>.
_DUMP_NAME = "bfc"
MAX_MACHINES = 16
_TIMEOUT_HINT = ("A step that is slow rather than stuck needs a larger step_timeout_s; a first run of a graph "
                 "gets step_timeout_s, later runs of it 10x their longest phase in its last run that ran.")


@dataclass(frozen=True)
class RunResult:
    """What one ``Testbed.run`` measured.

    ``ending`` is ``"ran"`` or ``"oom"`` (the device went over its cap; ``oom`` is then True and ``error``
    says where: the phase, and the op and the allocation when TensorFlow named them); a run that timed out or
    whose server crashed raises instead (``TestbedTimeoutError``, ``TestbedCrashError``), and code that keeps
    going records those as ``RunResult.failed(...)``, ``ending`` ``"timeout"`` or ``"crash"``. Peaks are allocator
    bytes (BFC chunk sizes) over the timed steps, resident variables and constants included: ``device_peaks`` and
    ``host_peaks`` per device string, ``device_peak_bytes`` and ``host_peak_bytes`` the largest of them (one
    machine: its device's and its host's); an OOM's ``oom_device`` names the device that went over; ``step_time_s`` is
    the median client wall time of the timed steps; ``outputs`` maps each tensor fetch to its value at the last
    step. ``run_metadata`` is the last step's full trace when ``run(trace=True)``. ``reached_s`` is how long the
    run took to reach its ending (for an OOM, the failed request), ``elapsed_s`` how long ``run`` took.
    """

    oom: bool
    error: str | None
    device_peak_bytes: int | None
    host_peak_bytes: int | None
    step_time_s: float | None
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    run_metadata: tf.compat.v1.RunMetadata | None = None
    ending: str = ""
    reached_s: float | None = None
    elapsed_s: float | None = None
    device_peaks: dict[str, int] = field(default_factory=dict)
    host_peaks: dict[str, int] = field(default_factory=dict)
    oom_device: str | None = None

    def __post_init__(self) -> None:
        if not self.ending:
            object.__setattr__(self, "ending", "oom" if self.oom else "ran")
        if self.ending not in ENDINGS or self.oom != (self.ending == "oom"):
            raise ValueError(f"RunResult: ending must be one of {ENDINGS} and 'oom' exactly when oom=True; got "
                             f"ending={self.ending!r}, oom={self.oom}")

    @property
    def ran(self) -> bool:
        """Whether the steps ran to the end (no OOM, timeout or crash)."""
        return self.ending == "ran"

    @classmethod
    def failed(cls, error: TestbedError) -> RunResult:
        """A run that timed out or crashed, or that TensorFlow rejected, as a result (for tables that go on)."""
        ending = ("timeout" if isinstance(error, TestbedTimeoutError)
                  else "crash" if isinstance(error, TestbedCrashError) else "failed")
        return cls(oom=False, error=f"{ending}: {str(error).splitlines()[0][:300]}", device_peak_bytes=None,
                   host_peak_bytes=None, step_time_s=None, ending=ending)


ENDINGS = ("ran", "oom", "timeout", "crash", "failed")


def _physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def is_oom(error: tf.errors.OpError) -> bool:
    text = str(error)
    return "OOM when allocating" in text or "out of memory" in text.lower()


def one_line(error: BaseException) -> str:
    r"""The informative line of a TF error: the OOM line if any, else the first line that is not boilerplate.

    >>> e = RuntimeError("Graph execution error:\n\nDetected at node 'add' defined at (most recent call last):\n"
    ...                  '  File "x.py", line 1, in <module>\nNode: \'add\'\nFusion is not implemented: '
    ...                  "[BiasAdd,Add]\n\t [[{{node add}}]]")
    >>> one_line(e)
    'RuntimeError: Fusion is not implemented: [BiasAdd,Add]'
    """
    lines = [ln.strip() for ln in str(getattr(error, "message", error)).splitlines() if ln.strip()]
    oom = [ln for ln in lines if ln.startswith("OOM when allocating")]
    node = getattr(error, "node_def", None)
    where = f" at node {getattr(node, 'name', '')!r}" if getattr(node, "name", "") else ""
    # Graph errors open with "Detected at node ..." and the Python traceback that built the node; the cause comes
    # after it (after "Node: ..." where TF writes one), before the "[[{{node ...}}]]" tail.
    body = [ln for ln in lines if ln != "Graph execution error:" and not ln.startswith("[[")]
    if body and body[0].startswith("Detected at node"):
        named = [i for i, ln in enumerate(body) if ln.startswith("Node: ")]
        body = body[named[-1] + 1:] if named and named[-1] + 1 < len(body) else body[-1:]
    text = oom[0] if oom else (body[0] if body else "")
    return f"{type(error).__name__}{where}: {text}"[:500]


class Testbed:
    """``machines`` emulated accelerators with ``device_memory`` bytes each, each with an uncapped host; a context
    manager.

    Parameters
    ----------
    device_memory : int or str
        Each device's cap, e.g. ``"1GiB"`` (whole MiB; ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` takes MiB).
    machines : int
        How many machines (1 to ``MAX_MACHINES``): machine ``m``'s device is ``devices[m]``
        (``/job:worker/replica:0/task:m/device:CPU:0``) and its host ``hosts[m]``; machine 0's are ``DEVICE``
        and ``HOST``, where unplaced nodes run. Each server is a TensorFlow process, about 570 MiB resident
        before it holds tensors (much of it TensorFlow's shared libraries; experiments/results/testbed_machines.md).
    inter_op_threads, intra_op_threads : int, optional
        The device server's executor and kernel thread pools (TF's defaults when None). ``run`` can ask for
        another inter-op count; the servers are then restarted.
    start_timeout_s : float
        How long to wait for both servers to accept connections.
    step_timeout_s : float
        The longest one phase of a run may take (initialisation, the warm-up step, a timed step); a graph that
        ran before gets at most ``PHASE_TIMEOUT_FACTOR`` times its longest phase then (at least
        ``MIN_PHASE_TIMEOUT_S``). A phase past its limit raises ``TestbedTimeoutError`` instead of hanging. A run
        cut short leaves its TF call waiting on the killed servers for up to this long (and 5 s), in a thread.

    Raises
    ------
    BadInputError
        If ``device_memory`` is under 1 MiB, ``machines`` is out of range, or the thread counts are negative.
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

    def __init__(self, device_memory: int | str, *, machines: int = 1, inter_op_threads: int | None = None,
                 intra_op_threads: int | None = None, start_timeout_s: float = 120.0,
                 step_timeout_s: float = 300.0) -> None:
        budget = parse_bytes(device_memory, what="device_memory")
        if budget < 2**20:
            raise BadInputError(f"testbed: device_memory must be at least 1 MiB, got {format_bytes(budget)}")
        if isinstance(machines, bool) or not isinstance(machines, int) or not 1 <= machines <= MAX_MACHINES:
            raise BadInputError(f"testbed: machines must be an int from 1 to {MAX_MACHINES} (two TensorFlow "
                                f"processes each), got {machines!r}")
        for name, n in (("inter_op_threads", inter_op_threads), ("intra_op_threads", intra_op_threads)):
            if n is not None and n < 0:
                raise BadInputError(f"testbed: {name} must be >= 0 (0 = TF's default), got {n}")
        self.device_memory_bytes = budget // 2**20 * 2**20
        self.machines = machines
        self.devices = [device_name(m) for m in range(machines)]
        self.hosts = [device_name(m, "host") for m in range(machines)]
        self.inter_op_threads = inter_op_threads or 0
        self.intra_op_threads = intra_op_threads or 0
        self.start_timeout_s = start_timeout_s
        self.step_timeout_s = step_timeout_s
        _remove_orphaned_workdirs()
        self._workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-"))
        self._procs: dict[str, ServerProcess] = {}
        self._running_inter_op = -1   # the pool of the ready servers; -1: none ready
        self._spawned_inter_op = -1   # the pool of the servers started, ready or not
        self._last_words: list[str] = []
        self._closed = False
        self._connected: Connected | None = None
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
        return f"grpc://{self.cluster['worker'][0]}"   # machine 0's device server: the master

    def connect(self) -> Connected:
        """Join this process's eager runtime to the testbed's servers, for TF2 functions and Keras ``fit``.

        Returns a ``Connected`` (``tfmem.testbed.eager``): its ``device`` and ``host`` names, and ``measure`` to run
        steps and read the peaks. Once connected, ``run`` (sessions) is refused and the servers are never restarted:
        the variables live in them. TensorFlow cannot leave a cluster, so one testbed per process may connect; the
        process must run with ``TF_ENABLE_ONEDNN_OPTS=0``, as the servers do.
        """
        if self._connected is None:
            if self._closed:
                raise TestbedError("testbed: connect() on a closed Testbed; open a new one")
            if not self._healthy():
                self._start(self._running_inter_op if self._running_inter_op >= 0 else self.inter_op_threads)
            self._clear_dumps()
            self._connected = connect(id(self), self.cluster, dict(self._procs), self._dumps, self._kill_servers)
        return self._connected

    @property
    def pids(self) -> dict[str, int]:
        """Process ids of the running servers, by ``"job:machine"`` (``"worker:0"``, ``"host:0"``, ...)."""
        return {name: p.pid for name, p in self._procs.items()}

    def _workers(self) -> list[ServerProcess]:
        """The device servers, machine 0 first."""
        return [p for p in self._procs.values() if p.job == "worker"]

    def _env(self, job: str, machine: int) -> dict[str, str]:
        # The host gets a BFC allocator too, capped at physical memory (i.e. uncapped): TF's default CPU
        # allocator keeps no statistics, so get_memory_info would fail there.
        limit = self.device_memory_bytes if job == "worker" else _physical_memory_bytes()
        env = {**COMMON_ENV, "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(limit // 2**20)}
        if job == "worker":  # the allocator writes its map at every failed request: how ``watch`` sees an OOM
            env["TF_BFC_MEMORY_DUMP"] = str(self._workdir / f"{_DUMP_NAME}-{machine}")
        return env

    def _spawn(self, inter_op: int) -> None:
        """Start every server without waiting for them: they import TensorFlow in parallel while the caller goes
        on (after a run cut short, the next run finds them ready or nearly)."""
        self._kill_servers()
        ports = free_ports(2 * self.machines)
        self.cluster = {job: [f"127.0.0.1:{port}" for port in ports[i * self.machines:(i + 1) * self.machines]]
                        for i, job in enumerate(("worker", "host"))}
        for job in ("worker", "host"):
            for machine in range(self.machines):
                args = (inter_op, self.intra_op_threads, self.device_memory_bytes) if job == "worker" else ()
                proc = ServerProcess(job, machine, self.cluster, self._env(job, machine), self._workdir, *args)
                self._procs[proc.name] = proc
        self._spawned_inter_op = inter_op

    def _start(self, inter_op: int) -> None:
        """Every server ready with an ``inter_op`` executor pool: those spawned in advance if they match."""
        for attempt in range(3):
            # Servers spawned in advance are used once: ready ones reach here only when unhealthy (a SIGKILLed
            # server can look alive until it is reaped) or for another pool.
            if self._running_inter_op >= 0 or self._server_died() or self._spawned_inter_op != inter_op:
                self._spawn(inter_op)
            try:
                deadline = time.monotonic() + self.start_timeout_s
                for proc in self._procs.values():
                    proc.wait_ready(max(deadline - time.monotonic(), 1.0))
                self._running_inter_op = inter_op
                self._idle_bytes = [int(p.call("stats")["current"]) for p in self._workers()]
                return
            except TestbedError as e:
                self._kill_servers()
                lost_port = "Could not start gRPC server" in str(e)  # a port taken between probe and bind
                if not lost_port or attempt == 2:
                    raise

    def _kill_servers(self) -> None:
        for proc in self._procs.values():   # all die at once, then all are reaped
            proc.signal_kill()
        for proc in self._procs.values():
            proc.kill()
        self._procs = {}
        self._running_inter_op = -1
        self._spawned_inter_op = -1

    def _stop_run(self) -> None:
        """Cut a run short (``watch``): note what dead servers said, kill them all and spawn the next ones."""
        self._last_words = [f"{p.name} server (pid {p.pid}) died; its stderr ends with:\n{p.stderr_tail()}"
                            for p in self._procs.values() if not p.alive()]
        inter_op = self._running_inter_op if self._running_inter_op >= 0 else self.inter_op_threads
        if not self._closed:
            self._spawn(inter_op)   # kills the old servers first
        else:
            self._kill_servers()

    def close(self) -> None:
        """Kill every server and remove the temp dir. Idempotent."""
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
        if not self._procs:
            return False
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
            The client session's config (Grappler options etc.). Its ``inter_op_parallelism_threads``, when set
            and ``inter_op_threads`` is not, sizes the device's executor pool, as it would a local session's.
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
            ``ending="ran"``, or ``"oom"`` (``oom=True``, and no exception) when the device went over its cap
            anywhere: building constants, receiving feeds, running an op. An OOM is seen when the allocator
            first fails a request (``tfmem.testbed.watch``), and reported within about twice the time the run
            took to reach it.

        Raises
        ------
        BadInputError
            If a fetch or feed names no node of the graph, or ``steps < 1``.
        TestbedTimeoutError
            A phase took longer than its limit (``step_timeout_s``, or for a graph that ran before, 10x its
            longest phase then); the message names the phase.
        TestbedCrashError
            A server died; the message ends with its stderr.
        TestbedError
            On any other failure (a bad feed value, an uninitialised variable). After any of these the Testbed
            stays usable: stopped servers start again on the next run.

        Examples
        --------
        >>> with Testbed("64MiB") as tb:                                     # doctest: +SKIP
        ...     r = tb.run(graph, ["train_op", "loss:0"], {"x:0": batch}, steps=5)
        >>> r.device_peak_bytes, r.outputs["loss:0"]                         # doctest: +SKIP
        """
        if inter_op_threads is None and config is not None and config.inter_op_parallelism_threads:
            # A local session sizes its executor pool by the config; the device server's pool is fixed at its
            # start, so the config's choice (``tfmem.optimize`` may set one thread) restarts the servers with it.
            inter_op_threads = config.inter_op_parallelism_threads
        g, init, digest = self._prepare(graph, fetches, feeds, steps, inter_op_threads, init_ops)
        started = time.monotonic()
        limit = self._phase_limit(digest)
        self._clear_dumps()
        # The run keeps to the servers it started on: a helper left behind by a cut-short run must never talk to
        # the next pair (a protocol line read by two threads, a reset of another run's variables).
        target, procs = self.target, dict(self._procs)
        ending = watch(lambda phase: self._measure(phase, limit, target, procs, g, list(fetches), dict(feeds or {}),
                                                   steps, config, init, trace),
                       started=started, dumps=self._dumps, dead=self._server_died, stop=self._stop_run,
                       abort=self._kill_servers)
        elapsed = time.monotonic() - started
        try:
            return self._result(ending, fetches, digest, elapsed)
        finally:
            self._clear_dumps()

    def _result(self, ending: Ending, fetches: list[str], digest: bytes, elapsed: float) -> RunResult:
        """The ``RunResult`` of a watched run, or the error it raises (see ``run``); the servers settled first."""
        error = ending.error
        if ending.kind == "failed" and isinstance(error, tf.errors.UnavailableError) and self._dies_soon():
            # the server's connection closed before the process was reaped: a crash seen from the client first
            self._stop_run()
            ending = dataclasses.replace(ending, kind="crash")
        self._settle()
        if ending.kind == "ran":
            result: RunResult
            longest: float
            result, longest = ending.value
            _PHASE_TIMES[digest] = longest
            return dataclasses.replace(result, reached_s=elapsed, elapsed_s=elapsed)
        if ending.kind == "oom":
            told = one_line(error) if isinstance(error, tf.errors.OpError) and is_oom(error) else None
            device = oom_device(ending.dump, error, self.machines)
            where = f"out of memory{naming(device, self.machines)} in the {ending.phase} after {ending.after_s:.2f} s"
            text = f"{where}: {told}" if told else f"{where}: {unserved(ending.dump)}"
            return RunResult(oom=True, error=text, device_peak_bytes=None, host_peak_bytes=None, step_time_s=None,
                             reached_s=ending.after_s, elapsed_s=elapsed, oom_device=device)
        if ending.kind == "timeout":
            raise TestbedTimeoutError(
                f"testbed: the {ending.phase} did not finish within {ending.limit_s:.3g} s (no allocation had failed "
                f"and both servers were alive; the servers were stopped and restart on the next run). "
                f"{_TIMEOUT_HINT}", phase=ending.phase, limit_s=ending.limit_s or 0.0)
        if ending.kind == "crash":
            raise TestbedCrashError("\n".join([f"testbed: a server died in the {ending.phase} after "
                                                f"{ending.after_s:.1f} s" + (f" ({one_line(error)})" if error else ""),
                                                *self._last_words]), phase=ending.phase)
        assert error is not None
        if isinstance(error, tf.errors.ResourceExhaustedError) and is_oom(error):  # an allocation without retry
            device = oom_device(None, error, self.machines)
            return RunResult(oom=True, error=f"out of memory{naming(device, self.machines)} in the {ending.phase}: "
                                             f"{one_line(error)}",
                             device_peak_bytes=None, host_peak_bytes=None, step_time_s=None,
                             reached_s=ending.after_s, elapsed_s=elapsed, oom_device=device)
        if isinstance(error, tf.errors.OpError):
            raise TestbedError(
                f"testbed: running fetches {fetches[:5]} failed with {one_line(error)}. Check the feed values, and "
                f"that every variable is initialised (initializer_names() finds 'v/Assign' ops; else pass "
                f"init_ops=...).") from error
        if isinstance(error, TfmemError | KeyboardInterrupt):
            raise error
        # TensorFlow's own error formatting can fail on odd node names (binary bytes in a constant's name)
        raise TestbedError(f"testbed: running fetches {fetches[:5]} failed in the {ending.phase}: "
                           f"{type(error).__name__}: {first_line(error)}") from error

    def _phase_limit(self, digest: bytes) -> float:
        """How long one phase of a run of this graph may take: ``PHASE_TIMEOUT_FACTOR`` times its longest phase
        in its last run that ran (at least ``MIN_PHASE_TIMEOUT_S``), never more than ``step_timeout_s``."""
        known = _PHASE_TIMES.get(digest)
        if known is None:
            return self.step_timeout_s
        return min(self.step_timeout_s, max(MIN_PHASE_TIMEOUT_S, PHASE_TIMEOUT_FACTOR * known))

    def _dumps(self) -> list[Path]:
        return sorted(self._workdir.glob(f"{_DUMP_NAME}-*_*"))

    def _clear_dumps(self) -> None:
        for path in self._dumps():
            path.unlink(missing_ok=True)

    def _dies_soon(self, within_s: float = 2.0) -> bool:
        deadline = time.monotonic() + within_s
        while not self._server_died():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _server_died(self) -> bool:
        return not self._procs or not all(p.alive() for p in self._procs.values())

    def _prepare(self, graph: GraphLike, fetches: list[str], feeds: dict[str, Any] | None, steps: int,
                 inter_op_threads: int | None, init_ops: list[str] | None) -> tuple[tf.Graph, list[str], bytes]:
        """Check the arguments, (re)start the servers if needed, and import the placed graph; with a digest of
        the placed graph and fetches that keys its phase limits."""
        if self._closed:
            raise TestbedError("testbed: run() on a closed Testbed; open a new one")
        if steps < 1:
            raise BadInputError(f"testbed: steps must be >= 1, got {steps}")
        if self._connected is not None:
            raise BadInputError("testbed: run() on a Testbed this process's eager runtime joined (connect()); a "
                                "session's reset would drop the connected variables: use another Testbed in "
                                "another process for sessions")
        graph_def = place_on_device(graph)
        check_names(graph_def, [*fetches, *(feeds or {})])
        inter_op = self.inter_op_threads if inter_op_threads is None else inter_op_threads
        if inter_op != self._running_inter_op or not self._healthy():
            self._start(inter_op)
        g = tf.Graph()
        with g.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        digest = hashlib.sha256(b"\0".join([graph_def.SerializeToString(deterministic=True),
                                              *(f.encode() for f in fetches)])).digest()
        return g, initializer_names(graph_def) if init_ops is None else list(init_ops), digest

    def _measure(self, phase: Phase, limit_s: float, target: str, procs: dict[str, ServerProcess], g: tf.Graph,
                 fetches: list[str], feeds: dict[str, Any], steps: int, config: tf.compat.v1.ConfigProto | None,
                 init: list[str], trace: bool = False) -> tuple[RunResult, float]:
        """The run itself, in ``watch``'s helper thread: it names each phase, and ``watch`` cuts it short.
        Returns the result and the longest phase's seconds (what later runs' limits scale)."""
        phase.enter("reset before the run", limit_s)
        # Reset drops every resource container (variables) on both jobs, so runs are independent.
        tf.compat.v1.Session.reset(target)
        config = copy.deepcopy(config) or tf.compat.v1.ConfigProto()
        config.isolate_session_state = False  # variables must outlive the init session
        # TF's own deadline on every call, past the watch's: a call whose servers the watch killed waits for the
        # lost master without end (tfmem.testbed.watch); this ends it, and its thread, within the phase limit.
        deadline_ms = int(min(limit_s + TF_DEADLINE_SLACK_S, 2**31 / 1000 - 1) * 1000)
        config.operation_timeout_in_ms = deadline_ms
        longest = 0.0
        if init:  # own session: closing it frees the init graph's Const kernels; variables stay in the worker
            phase.enter("initialisation (variables and their constants)", limit_s)
            _run_and_close(target, g, config,
                           lambda sess: sess.run(init, options=tf.compat.v1.RunOptions(timeout_in_ms=deadline_ms)))
            longest = time.monotonic() - phase.since
        times, values = [], []
        metadata = tf.compat.v1.RunMetadata() if trace else None

        def steps_in(sess: tf.compat.v1.Session) -> None:
            nonlocal values, longest
            # Warm-up first: the master runs Grappler on it, in the device process, and constant folding's
            # temporaries would otherwise count. Kernels' Const tensors and variables stay resident, so
            # resetting the peak afterwards still counts them.
            phase.enter("warm-up step", limit_s)
            sess.run(fetches, feeds, options=tf.compat.v1.RunOptions(timeout_in_ms=deadline_ms))
            longest = max(longest, time.monotonic() - phase.since)
            for proc in procs.values():
                proc.call("reset")
            for i in range(steps):
                options = tf.compat.v1.RunOptions(timeout_in_ms=deadline_ms)
                traced = trace and i == steps - 1
                if traced:
                    options.trace_level = tf.compat.v1.RunOptions.FULL_TRACE
                phase.enter(f"timed step {i + 1} of {steps}", limit_s)
                start = time.perf_counter()
                values = sess.run(fetches, feeds, options=options, run_metadata=metadata if traced else None)
                times.append(time.perf_counter() - start)
                longest = max(longest, time.monotonic() - phase.since)

        _run_and_close(target, g, config, steps_in)
        phase.enter("reading the peaks", limit_s)
        peaks = read_peaks(procs)
        outputs = {name: np.asarray(v) for name, v in zip(fetches, values, strict=True) if ":" in name}
        return RunResult(oom=False, error=None, step_time_s=statistics.median(times), outputs=outputs,
                         run_metadata=metadata, **peaks), longest

    def _settle(self) -> None:
        """Free the last run's state; stop the servers (the next run starts them) if that does not bring the device
        back to idle, or does not finish within ``SETTLE_TIMEOUT_S``."""
        if self._running_inter_op < 0:   # stopped by the watch: the next run waits for the new pair
            return
        if self._server_died():  # a reset would wait on a dead master
            self._stop_run()
            return

        target, workers = self.target, self._workers()   # as in run: never the next servers

        def reset(phase: Phase) -> list[int]:
            phase.enter("reset after the run", SETTLE_TIMEOUT_S)
            current: list[int] = []
            tf.compat.v1.Session.reset(target)
            for _ in range(10):  # graph deregistration may lag the reset a little
                current = [int(w.call("stats")["current"]) for w in workers]
                if current == self._idle_bytes:
                    break
                time.sleep(0.05)
            return current

        ending = watch(reset, started=time.monotonic(), dumps=lambda: [], dead=self._server_died,
                       stop=self._stop_run, abort=self._kill_servers)
        if ending.kind == "ran" and ending.value == self._idle_bytes:
            return
        _log.info("testbed: after a run the devices hold %s bytes (idle: %s) or did not reset (%s); starting new "
                  "servers", ending.value, self._idle_bytes, ending.kind)
        if ending.kind == "ran":
            self._stop_run()


def oom_device(dump: Path | None, error: BaseException | None, machines: int) -> str | None:
    """The device that went over its cap: whose allocator wrote ``dump`` (``bfc-<machine>_...``), else the one
    TensorFlow's error names."""
    machine = dump.name[len(_DUMP_NAME) + 1:].split("_", 1)[0] if dump is not None else ""
    if not machine.isdigit() and error is not None:
        found = re.search(r"/job:worker/replica:0/task:(\d+)", str(error))
        machine = found.group(1) if found else ""
    return device_name(int(machine)) if machine.isdigit() and int(machine) < machines else None


def naming(device: str | None, machines: int) -> str:
    """``" on <device>"`` for an OOM's message when there is more than one device to tell apart, else ``""``."""
    return f" on {device}" if device and machines > 1 else ""


def read_peaks(procs: dict[str, ServerProcess]) -> dict[str, Any]:
    """Every server's allocator peak since its last reset: ``RunResult``'s peak fields."""
    device_peaks: dict[str, int] = {}
    host_peaks: dict[str, int] = {}
    for proc in procs.values():
        (device_peaks if proc.job == "worker" else host_peaks)[device_name(proc.task, proc.job)] = \
            int(proc.call("stats")["peak"])
    return {"device_peaks": device_peaks, "host_peaks": host_peaks, "device_peak_bytes": max(device_peaks.values()),
            "host_peak_bytes": max(host_peaks.values())}


def _run_and_close(target: str, g: tf.Graph, config: tf.compat.v1.ConfigProto,
                   body: Callable[[tf.compat.v1.Session], object]) -> None:
    """``body(session)`` in a session that is closed afterwards, even on error (without ``with``: its exit waits
    30 s for a close after an error, and ``watch`` has stopped the servers by then)."""
    sess = tf.compat.v1.Session(target, graph=g, config=config)
    try:
        body(sess)
    finally:
        sess.close()


def unserved(dump: Path | None) -> str:
    """What the allocator's memory map at a failed request says: in use, free, and the largest free chunk."""
    from tensorflow.core.protobuf.bfc_memory_map_pb2 import MemoryDump

    try:
        memory = MemoryDump.FromString(dump.read_bytes()) if dump is not None else None
    except (OSError, ValueError):
        memory = None
    if memory is None:
        return "the device allocator could not serve a request"
    free = [c.size for c in memory.chunk if not c.in_use]
    return (f"the device allocator could not serve a request with {format_bytes(memory.stats.bytes_in_use)} in use "
            f"and {format_bytes(sum(free))} free in {len(free)} chunk(s), the largest "
            f"{format_bytes(max(free, default=0))} (TensorFlow would fail it after waiting up to 10 s for memory)")


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
