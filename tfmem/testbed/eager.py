"""TF2 on the testbed: this process's eager runtime joined to a testbed's cluster (``Testbed.connect``).

With ``tf.config.experimental_connect_to_cluster`` the calling process becomes a client of the testbed's two
servers: variables created under ``tf.device(connected.device)`` live in the capped device process, and a
``tf.function`` whose ops are placed there runs there, so ``Connected.measure`` reads its peak from the same
allocator statistics as a session run (``runner.py``) and an allocation over the cap is TensorFlow's own
``ResourceExhaustedError``. Inputs made on this process (a Keras ``fit``'s batches) are copied to the device
when a step on it reads them, as an accelerator's are.

Facts the tests pin (``tests/test_demo.py``'s Keras demo; case ``testbed_refusals`` of ``tests/tf2_cases.py``):
the client rewrites functions for the servers (Grappler runs in the client process), so the client needs the
servers' ``TF_ENABLE_ONEDNN_OPTS=0``: with oneDNN on, the client's rewrite changed a planned step's float
results. A dataset's ``variant`` tensors cannot be copied between jobs, so the input pipeline stays on this
process: ``run_keras_steps_on`` places plain ``fit``'s steps on the device the way ``tfmem.keras.MemoryBudget``
places its planned ones.

``measure`` runs the steps in a helper thread that ``tfmem.testbed.watch`` watches, as a session's run is: an
allocation over the cap is reported from the allocator's memory map at once (not after TensorFlow's 10 s
retry), and a server that dies ends the measurement with ``TestbedCrashError`` instead of a client waiting
forever. Both happen: when a step ran out of memory receiving a tensor from the host job, the device server
died of a segmentation fault after writing its maps (a mixture of experts created in host memory,
``experiments/tf2_keras.py``); that is reported as the out-of-memory it is. Either way the servers are stopped,
so the connection measures nothing more.

Gaps. TensorFlow has no call that leaves a cluster: once connected, this process's eager runtime keeps the
servers' devices after the testbed closes, and logs an error for each function it can no longer remove there.
Connect one testbed per process (a second ``connect`` in the process is refused). A hung step is not cut short
(no phase has a time limit here, unlike a session's run).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from tfmem.errors import BadInputError, TestbedCrashError, TestbedError
from tfmem.testbed.graph import DEVICE, HOST, device_name
from tfmem.testbed.proc import COMMON_ENV

if TYPE_CHECKING:
    from tfmem.testbed.proc import ServerProcess
    from tfmem.testbed.runner import RunResult

_CONNECTED: list[int] = []   # id of the testbed this process joined, if any (one per process: see the gaps)


class Connected:
    """This process joined to a testbed's servers; made by ``Testbed.connect()``.

    ``device`` and ``host`` are machine 0's device names (``devices`` and ``hosts``: every machine's), for
    ``tf.device`` and for ``tfmem.function`` / ``MemoryBudget``'s ``device=`` and ``host=``.

    Examples
    --------
    >>> with Testbed("40MiB") as tb:                                        # doctest: +SKIP
    ...     remote = tb.connect()
    ...     with tf.device(remote.device):
    ...         model = build_and_compile()
    ...     run_keras_steps_on(model, remote.device)
    ...     result = remote.measure(lambda: model.fit(x, y, epochs=2), warmup=lambda: model.fit(x[:64], y[:64]))
    >>> result.oom, result.device_peak_bytes                                 # doctest: +SKIP
    """

    def __init__(self, procs: dict[str, ServerProcess], dumps: Callable[[], list[Path]],
                 stop: Callable[[], None]) -> None:
        self._procs = procs
        self._dumps = dumps   # the device allocator's maps of failed requests
        self._stop = stop     # kills both servers
        self._ended: str | None = None   # why the servers were stopped, once they were
        self.machines = sum(p.job == "worker" for p in procs.values())
        self.device, self.host = DEVICE, HOST
        self.devices = [device_name(m) for m in range(self.machines)]
        self.hosts = [device_name(m, "host") for m in range(self.machines)]

    def sync(self) -> None:
        """Wait for every operation this process has sent to the servers (remote execution can be asynchronous)."""
        from tensorflow.python.eager import context

        context.async_wait()

    def reset_peaks(self) -> None:
        """Start both servers' peaks from their current use, after what was sent so far has run."""
        self.sync()
        for proc in self._procs.values():
            proc.call("reset")

    def peaks(self) -> dict[str, Any]:
        """Every server's allocator peak since the last ``reset_peaks``: ``RunResult``'s peak fields
        (``device_peaks``, ``host_peaks``, and the largest of each)."""
        from tfmem.testbed.runner import read_peaks

        self.sync()
        return read_peaks(self._procs)

    def in_use(self) -> int:
        """Bytes machine 0's device allocator holds now (variables, and whatever is still alive)."""
        self.sync()
        return int(self._procs["worker:0"].call("stats")["current"])

    def measure(self, body: Callable[[], object], *, warmup: Callable[[], object] | None = None,
                repeats: int = 1) -> RunResult:
        """Run ``warmup`` once (unmeasured: tracing, and the servers instantiating the functions), reset the peaks,
        run ``body`` ``repeats`` times and read the peaks.

        Returns a ``RunResult``: ``oom`` when the device went over its cap (TensorFlow's line, or the request the
        allocator could not serve: then the servers were stopped and the connection measures nothing more), else
        the peaks over the repeats and the median wall time of one ``body``. ``body``'s values are the caller's
        (keep them in a closure); ``outputs`` is empty.

        Raises
        ------
        TestbedCrashError
            If a server died (after no failed request); the connection cannot be repaired.
        TestbedError
            If ``body`` failed with another TensorFlow error.
        """
        from tfmem.testbed.runner import RunResult, is_oom, naming, one_line, oom_device, unserved
        from tfmem.testbed.watch import Phase, watch

        if repeats < 1:
            raise BadInputError(f"testbed: repeats must be >= 1, got {repeats}")
        if self._ended is not None:
            raise TestbedError(f"testbed: this connection is over ({self._ended}); measure again in a new process "
                               "with a new Testbed")
        started = time.monotonic()
        earlier = set(self._dumps())   # maps of an earlier measurement's failed requests

        def work(phase: Phase) -> tuple[list[float], dict[str, Any]]:
            times: list[float] = []
            if warmup is not None:
                phase.enter("warm-up", float("inf"))
                warmup()
            self.reset_peaks()
            for i in range(repeats):
                phase.enter(f"timed run {i + 1} of {repeats}", float("inf"))
                start = time.perf_counter()
                body()
                self.sync()
                times.append(time.perf_counter() - start)
            phase.enter("reading the peaks", float("inf"))
            return times, self.peaks()

        ending = watch(work, started=started, dumps=lambda: [d for d in self._dumps() if d not in earlier],
                       dead=self._died, stop=self._stop_servers)
        elapsed = time.monotonic() - started
        if ending.kind == "ran":
            times, peaks = ending.value
            return RunResult(oom=False, error=None, step_time_s=statistics.median(times), reached_s=elapsed,
                             elapsed_s=elapsed, **peaks)
        e = ending.error
        if ending.kind == "oom" or (isinstance(e, tf.errors.OpError) and is_oom(e)):
            said = one_line(e) if isinstance(e, tf.errors.OpError) and is_oom(e) else unserved(ending.dump)
            after = f" after {ending.after_s:.2f} s" if ending.kind == "oom" else ""
            device = oom_device(ending.dump, e, self.machines)
            return RunResult(oom=True, error=f"out of memory{naming(device, self.machines)} in the {ending.phase}"
                                             f"{after}: {said}",
                             device_peak_bytes=None, host_peak_bytes=None, step_time_s=None,
                             reached_s=ending.after_s, elapsed_s=elapsed, oom_device=device)
        if ending.kind == "crash" or isinstance(e, tf.errors.UnavailableError):
            self._stop_servers()
            raise TestbedCrashError(f"testbed: {self._ended} in the {ending.phase}"
                                    + (f" ({one_line(e)})" if isinstance(e, tf.errors.OpError) else ""),
                                    phase=ending.phase) from e
        if isinstance(e, tf.errors.OpError):
            raise TestbedError(f"testbed: the {ending.phase} failed with {one_line(e)}") from e
        assert e is not None
        raise e

    def _died(self) -> bool:
        return not all(p.alive() for p in self._procs.values())

    def _stop_servers(self) -> None:
        """Cut a measurement short (``watch``): the servers are killed, which ends the helper's TensorFlow call."""
        if self._ended is None:
            dead = [name for name, p in self._procs.items() if not p.alive()]
            self._ended = (f"the {' and '.join(dead)} server died" if dead
                           else "the servers were stopped at an out-of-memory")
            self._stop()


def connect(testbed_id: int, cluster: dict[str, list[str]], procs: dict[str, ServerProcess],
            dumps: Callable[[], list[Path]], stop: Callable[[], None]) -> Connected:
    """Join this process's eager runtime to ``cluster`` (see ``Testbed.connect``)."""
    if _CONNECTED:
        raise BadInputError("testbed: this process's eager runtime already joined a testbed's cluster, and "
                            "TensorFlow cannot leave one; connect each testbed in a process of its own")
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
    if onednn != COMMON_ENV["TF_ENABLE_ONEDNN_OPTS"]:
        said = "unset (oneDNN on)" if onednn is None else f"={onednn}"
        raise BadInputError(f"testbed: this process runs TensorFlow with TF_ENABLE_ONEDNN_OPTS {said}; the client "
                            "rewrites functions for the servers, which run with TF_ENABLE_ONEDNN_OPTS=0: set it in "
                            "the environment before TensorFlow is imported")
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster))
    _CONNECTED.append(testbed_id)
    return Connected(procs, dumps, stop)


def run_keras_steps_on(model: Any, device: str) -> None:
    """Make plain ``model.fit`` run each training step on ``device``, its batches read on this process.

    What Keras does on an accelerator without help (tf.data on the host CPU, the step on the GPU), which a
    remote CPU device does not get by itself: under ``tf.device(device)`` the whole input pipeline would move
    there, and a dataset cannot cross jobs. Call it after ``compile``; ``MemoryBudget`` replaces it when given.
    """
    step = tf.function(model.train_step)

    def train_function(iterator: Any) -> Any:
        data = iterator.get_next() if hasattr(iterator, "get_next") else next(iter(iterator))
        with tf.device(device):
            return step(data)

    model.train_function = train_function
