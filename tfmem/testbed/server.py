"""Child-process entry point of the testbed: one TensorFlow gRPC server plus a line protocol on stdio.

Run by ``tfmem.testbed`` as ``python tfmem/testbed/server.py --job worker --task 0 --cluster '{...}'
--parent-pid N`` (by file path, so that importing it does not import the ``tfmem`` package). The parent sets the allocator
environment variables (``TF_CPU_ALLOCATOR_USE_BFC`` ...) before this process starts, which is the only way to
cap TensorFlow's CPU allocator: it reads them once, when the allocator is first created.

Protocol: after the server listens, this process writes ``READY <pid>`` on its protocol stream; then it
answers one JSON line per command line read on stdin:

- ``ping``  -> ``{"ok": true}``
- ``reset`` -> resets the allocator's peak to its current use; ``{"ok": true}``
- ``stats`` -> ``{"ok": true, "current": <bytes in use>, "peak": <peak bytes since reset>}``
- ``threads`` -> ``{"ok": true, "names": {<thread name>: <count>}, "at_start": {...}}``: threads now, and
  right after the server started. The server's executor pool is the ``tf_Compute`` threads in ``at_start``;
  the eager context created for the stats adds a second ``tf_Compute`` pool of TF's default size.

The stats come from ``tf.config.experimental.get_memory_info('CPU:0')``. It reads the allocator of this
process's eager CPU device, which is the same process-wide allocator the server's kernels use
(``ProcessState::GetCPUAllocator``); the testbed's tests check that the figures move with the served graph.

It exits on stdin EOF, and when its parent dies (``PR_SET_PDEATHSIG`` plus a watchdog thread polling the
parent pid), then removing the testbed's work folder; it ignores SIGINT so that a Ctrl-C in the terminal leaves
cleanup to the parent.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import faulthandler
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int, workdir: str | None) -> Callable[..., None]:
    """Exit when the parent dies, removing the testbed's work folder (the parent, SIGKILLed, could not).

    ``PR_SET_PDEATHSIG`` sends SIGTERM when the parent *thread* that spawned us exits; its handler runs when
    the main thread next runs Python (it waits on stdin: at once). The watchdog thread covers the rest.
    """
    def orphaned(*_: object) -> None:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        os._exit(1)

    signal.signal(signal.SIGTERM, orphaned)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the watchdog and stdin EOF still end us
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        orphaned()

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                orphaned()
            time.sleep(0.5)

    threading.Thread(target=watch, name="tfmem-parent-watchdog", daemon=True).start()
    return orphaned


def _reserve_budget(tf: ModuleType, limit_bytes: int) -> None:
    """Make the BFC allocator hold its whole budget in two regions now, so its state after a run is its state
    at start.

    With ``allow_growth`` (always on for the CPU BFC allocator) regions are added as needed, sized by
    doubling, and never returned; later runs then find free chunks shaped by earlier ones, and the BFC uses a
    free chunk whole unless it is twice the request (or leaves 128 MiB), so peaks would depend on earlier runs
    (``tests/test_testbed.py::test_peaks_do_not_depend_on_earlier_runs``). The first region is 2 MiB; reserving
    the rest in one second region makes the allocator behave like a GPU's BFC (one region of the whole
    memory): when every tensor is freed, each region is one free chunk again.
    """
    first_region = 2 << 20
    if limit_bytes <= first_region:
        return
    rest = limit_bytes - first_region
    try:
        tiny = tf.raw_ops.Empty(shape=[1], dtype=tf.uint8, init=False)  # makes the first region if none yet
        big = tf.raw_ops.Empty(shape=[rest // 2**20, 2**20], dtype=tf.uint8, init=False)  # untouched pages
        del big, tiny
    except Exception as e:  # still a capped device, only history-dependent: say so, don't die
        print(f"tfmem testbed: could not reserve {rest} bytes up front ({e}); peaks may depend on earlier runs",
              file=sys.stderr, flush=True)


def _thread_names() -> dict[str, int]:
    names: collections.Counter[str] = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[f.read().strip()] += 1
        except OSError:
            continue
    return dict(names)


def _serve(proto: int, tf: ModuleType, at_start: dict[str, int]) -> None:
    cfg = tf.config.experimental
    for line in sys.stdin:
        cmd = line.strip()
        try:
            if cmd == "stats":
                info = cfg.get_memory_info("CPU:0")
                reply: dict[str, object] = {"ok": True, "current": int(info["current"]), "peak": int(info["peak"])}
            elif cmd == "reset":
                cfg.reset_memory_stats("CPU:0")
                reply = {"ok": True}
            elif cmd == "threads":
                reply = {"ok": True, "names": _thread_names(), "at_start": at_start}
            elif cmd == "ping":
                reply = {"ok": True}
            else:
                reply = {"ok": False, "error": f"unknown command {cmd!r}"}
        except Exception as e:  # report, never die: the parent decides what to do
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        os.write(proto, (json.dumps(reply) + "\n").encode())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True)
    parser.add_argument("--task", type=int, default=0)
    parser.add_argument("--cluster", required=True, help="JSON {job: [host:port]}")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--inter-op-threads", type=int, default=0)
    parser.add_argument("--intra-op-threads", type=int, default=0)
    parser.add_argument("--reserve-bytes", type=int, default=0, help="the allocator's budget, to reserve now")
    parser.add_argument("--workdir", help="the testbed's work folder, removed if the parent dies")
    args = parser.parse_args(argv)
    orphaned = _die_with_parent(args.parent_pid, args.workdir)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: Python stacks to stderr
    # Keep the protocol stream clean: whatever TensorFlow prints on stdout goes to stderr instead.
    proto = os.dup(1)
    os.dup2(2, 1)

    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(
        inter_op_parallelism_threads=args.inter_op_threads,
        intra_op_parallelism_threads=args.intra_op_threads,
    )
    server = tf.distribute.Server(
        tf.train.ClusterSpec(json.loads(args.cluster)), job_name=args.job, task_index=args.task,
        config=config, start=True,
    )
    at_start = _thread_names()
    tf.config.experimental.get_memory_info("CPU:0")  # initialise the eager context now, not on first stats
    _reserve_budget(tf, args.reserve_bytes)
    os.write(proto, f"READY {os.getpid()}\n".encode())
    _serve(proto, tf, at_start)
    # stdin closes when the parent dies (its files close before it is reaped and we are reparented): the
    # parent never closes it otherwise, so wait for the reparenting, then clean up for it.
    for _ in range(20):
        if os.getppid() != args.parent_pid:
            orphaned()
        time.sleep(0.1)
    del server
    os._exit(0)  # the gRPC server's destructor can block; nothing here needs flushing


if __name__ == "__main__":
    main()
