"""Child processes of the testbed: start a TensorFlow server, talk to it, and make sure it dies.

``ServerProcess`` wraps one ``server.py`` child. Every child is killed by ``kill()``, by the parent's
atexit hook, by its own watchdog when the parent dies, or by ``PR_SET_PDEATHSIG`` when the parent is SIGKILLed.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tfmem.errors import TestbedError

SERVER_SCRIPT = Path(__file__).with_name("server.py")

# Set in both children. oneDNN's allocator would bypass the BFC cap; deterministic ops make outputs
# bit-reproducible; level 2 hides TF's INFO/WARNING chatter (including the BFC allocator's OOM dump).
COMMON_ENV = {
    "TF_ENABLE_ONEDNN_OPTS": "0",
    "TF_DETERMINISTIC_OPS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "CUDA_VISIBLE_DEVICES": "",  # a GPU build must not give the emulated device a real GPU
    "PYTHONUNBUFFERED": "1",
}


def free_ports(n: int) -> list[int]:
    """Return ``n`` distinct TCP ports that are free on loopback right now (held open together to differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def listening_ports() -> set[int]:
    """TCP ports some process on this machine listens on (Linux ``/proc/net``): what a closed testbed must not
    leave behind (tests/test_testbed.py, experiments/reliability.py)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                if state == "0A":  # TCP_LISTEN
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited: no such process, or a zombie (which holds no memory or sockets)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


class ServerProcess:
    """One child running a TF server for task ``task`` of ``job``, driven through a line protocol on its stdio;
    ``name`` is ``"job:task"``."""

    def __init__(self, job: str, task: int, cluster: dict[str, list[str]], env: dict[str, str], workdir: Path,
                 inter_op_threads: int = 0, intra_op_threads: int = 0, reserve_bytes: int = 0) -> None:
        self.job, self.task = job, task
        self.name = f"{job}:{task}"
        # One file per start, so a restarted server does not overwrite its predecessor's last words.
        stem = f"{job}-{task}"
        starts = sorted(int(n) for n in (f.name.split(".")[1] for f in workdir.glob(f"{stem}.*.stderr"))
                        if n.isdigit())
        for old in starts[:-1]:   # the previous start's last words stay beside this one's; older ones go
            (workdir / f"{stem}.{old}.stderr").unlink(missing_ok=True)
        self.stderr_path = workdir / f"{stem}.{starts[-1] + 1 if starts else 0}.stderr"
        self._buf = b""
        cmd = [
            sys.executable, "-u", str(SERVER_SCRIPT), "--job", job, "--task", str(task),
            "--cluster", json.dumps(cluster),
            "--parent-pid", str(os.getpid()),
            "--inter-op-threads", str(inter_op_threads), "--intra-op-threads", str(intra_op_threads),
            "--reserve-bytes", str(reserve_bytes), "--workdir", str(workdir),
        ]
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env={**os.environ, **env},
                close_fds=True, bufsize=0,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr_tail(self, nbytes: int = 1500) -> str:
        try:
            data = self.stderr_path.read_bytes()[-nbytes:]
        except OSError:
            return "<no stderr>"
        return data.decode(errors="replace").strip() or "<empty stderr>"

    def _fail(self, what: str) -> TestbedError:
        code = self.proc.poll()
        state = "still running" if code is None else f"exited with code {code}"
        return TestbedError(
            f"testbed {self.name} server (pid {self.pid}, {state}): {what}. Its stderr ends with:\n"
            f"{self.stderr_tail()}\nCheck that TensorFlow imports in {sys.executable} and that loopback "
            f"TCP ports can be bound; raise start_timeout_s on a slow machine."
        )

    def readline(self, timeout_s: float) -> str:
        """Read one protocol line, raising ``TestbedError`` when the child dies or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"no answer within {timeout_s:.0f} s")
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise self._fail("closed its protocol stream (it died)")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def wait_ready(self, timeout_s: float) -> None:
        line = self.readline(timeout_s)
        if not line.startswith("READY"):
            raise self._fail(f"unexpected first line {line!r}")

    def call(self, cmd: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """Send one command and return its JSON answer."""
        try:
            self.proc.stdin.write(cmd.encode() + b"\n")  # type: ignore[union-attr]
        except (BrokenPipeError, OSError) as e:
            raise self._fail(f"cannot send {cmd!r} ({e})") from e
        reply: dict[str, Any] = json.loads(self.readline(timeout_s))
        if not reply.get("ok"):
            raise self._fail(f"command {cmd!r} failed: {reply.get('error')}")
        return reply

    def signal_kill(self) -> None:
        """Send SIGKILL without waiting (``kill`` reaps): the server holds nothing worth flushing."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """Kill the child and reap it; safe to call twice."""
        self.signal_kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
