"""Tests of the testbed: real TensorFlow servers, a real memory cap, real OOMs and cleanup on every exit path.

Sizes are MiB multiples of float32, so expected peaks are exact up to the BFC allocator's 256-byte chunks for
the small constants (shape, axis, scalar operands) that sit beside the big tensors.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tfmem.errors import BadInputError, TestbedCrashError, TestbedError, TestbedTimeoutError
from tfmem.testbed import DEVICE, HOST, RunResult, Testbed, initializer_names, place_on_device
from tfmem.testbed.proc import COMMON_ENV, listening_ports, process_gone

pytestmark = pytest.mark.testbed

MiB = 2**20
CAP = 256 * MiB  # large enough that BFC splits chunks exactly, except in test_bfc_uses_a_tail_chunk_whole
SMALL = 4096  # bound on the small constants' chunks (a handful of 256-byte BFC chunks)
REPO = Path(__file__).resolve().parents[1]


def build(fn: Callable[[], object]) -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        fn()
    return g


def reuse_chain(nbytes: int) -> tf.Graph:
    """x = uniform[n]; y = 2x; z = y + x; s = sum(z). Random, so Grappler cannot fold it away."""
    def body() -> None:
        x = tf.random.uniform([nbytes // 4], seed=1, name="x")
        y = tf.multiply(x, 2.0, name="y")
        z = tf.add(y, x, name="z")
        tf.reduce_sum(z, name="s")
    return build(body)


@pytest.fixture(scope="module")
def tb() -> Iterator[Testbed]:
    with Testbed(CAP) as testbed:
        yield testbed


@pytest.fixture(scope="module")
def oom_result(tb: Testbed, users: dict[str, subprocess.Popen[str]]) -> RunResult:
    # 2x the cap: x and y are 64 MiB each. Requested with the user processes of the cleanup tests, which start
    # TensorFlow meanwhile.
    return tb.run(reuse_chain(CAP), ["s:0"])


def test_place_on_device_keeps_job_placements() -> None:
    def body() -> None:
        a = tf.constant(1.0, name="a")
        with tf.device(HOST):
            b = tf.identity(a, name="b")
        with tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
            tf.identity(b, name="c")
    g = build(body)
    placed = {n.name: n.device for n in place_on_device(g).node}
    assert placed == {"a": DEVICE, "b": HOST, "c": DEVICE}
    assert {n.device for n in g.as_graph_def().node} != {DEVICE}  # input untouched


def test_peak_of_a_chain_is_exact(tb: Testbed) -> None:
    r = tb.run(reuse_chain(16 * MiB), ["s:0"])
    # x has two readers, so y = 2x needs its own 16 MiB; z = y + x is y's last use and reuses y's buffer
    # (in-place forwarding); s is a scalar. Live at the peak: x + y = 32 MiB.
    assert not r.oom and r.error is None
    assert 32 * MiB <= r.device_peak_bytes <= 32 * MiB + SMALL
    assert r.host_peak_bytes == 0 and r.step_time_s > 0


def test_feeds_count_and_buffers_are_forwarded(tb: Testbed) -> None:
    def body() -> None:
        x = tf.compat.v1.placeholder(tf.float32, [4 * MiB], name="x")
        tf.add(tf.multiply(x, 2.0, name="y"), 1.0, name="z")
    x = np.arange(4 * MiB, dtype=np.float32)
    r = tb.run(build(body), ["z:0"], {"x:0": x})
    # The fed x (16 MiB) lives in the device process and counts; the feed holds a reference, so y = 2x gets a
    # new 16 MiB; z = y + 1 is forwarded into y's buffer and is what gets fetched: 32 MiB, not 48.
    assert 32 * MiB <= r.device_peak_bytes <= 32 * MiB + SMALL
    np.testing.assert_array_equal(r.outputs["z:0"], x * 2 + 1)

    def held() -> None:
        x = tf.compat.v1.placeholder(tf.float32, [4 * MiB], name="x")
        y = tf.multiply(x, 2.0, name="y")
        with tf.control_dependencies([y]):
            w = tf.random.uniform([4 * MiB], seed=1, name="w")
        tf.reduce_sum(y + w, name="s")
    # x's last use is y, yet it is still live when w is made: a feed is held for the whole step. 48 MiB.
    r = tb.run(build(held).as_graph_def(), ["s:0"], {"x:0": x})
    assert 48 * MiB <= r.device_peak_bytes <= 48 * MiB + SMALL


def odd_sizes() -> tf.Graph:
    """x: 16 MiB, freed before y and w (10 MiB each) are made: 20 MiB live at the peak."""
    def body() -> None:
        x = tf.random.uniform([4 * MiB], seed=1, name="x")
        s1 = tf.reduce_sum(x, name="s1")
        with tf.control_dependencies([s1]):
            y = tf.random.uniform([10 * MiB // 4], seed=2, name="y")
            w = tf.random.uniform([10 * MiB // 4], seed=3, name="w")
        tf.add(s1, tf.reduce_sum(y + w), name="out")
    return build(body)


def test_peaks_do_not_depend_on_earlier_runs(tb: Testbed) -> None:
    # Each run leaves the BFC allocator as it found it (one free chunk per region), so a step whose 10 MiB
    # tensors could land in 16 MiB chunks left by another graph still measures 20 MiB, every time.
    first = tb.run(odd_sizes(), ["out:0"]).device_peak_bytes
    tb.run(reuse_chain(24 * MiB), ["s:0"])
    again = tb.run(odd_sizes(), ["out:0"]).device_peak_bytes
    assert first == again and 20 * MiB <= first <= 20 * MiB + SMALL


def test_bfc_uses_a_tail_chunk_whole(tb: Testbed) -> None:
    def body() -> None:
        a = tf.random.uniform([16 * MiB], seed=1, name="a")
        b = tf.random.uniform([16 * MiB], seed=2, name="b")
        with tf.control_dependencies([a, b]):
            c = tf.random.uniform([16 * MiB], seed=3, name="c")
        with tf.control_dependencies([c]):
            sums = [tf.reduce_sum(a), tf.reduce_sum(b)]
        tf.add_n([*sums, tf.reduce_sum(c)], name="out")
    r = tb.run(build(body), ["out:0"])
    # The device's memory is a 2 MiB region (small tensors) and one of CAP - 2 MiB = 254 MiB. BFC splits a free
    # chunk of c bytes for a request of r only if c >= 2r or c - r >= 128 MiB: a and b (64 MiB each) split
    # it, leaving 126 MiB, which c (64 MiB) then takes whole. 64 + 64 + 126 = 254 MiB, not 192.
    assert 254 * MiB <= r.device_peak_bytes <= 254 * MiB + SMALL


def test_over_the_cap_is_an_oom_result(oom_result: RunResult) -> None:
    assert oom_result.oom and oom_result.ending == "oom" and not oom_result.ran
    assert "out of memory in the warm-up step" in oom_result.error
    assert "could not serve a request" in oom_result.error    # the allocator's map at the failed request
    assert oom_result.device_peak_bytes is None and oom_result.outputs == {}
    # Seen at the failed request, not after TF's AllocatorRetry gives up 10 s later (the time is generous: a
    # loaded machine; experiments/results/reliability.md has the measured times)
    assert oom_result.reached_s is not None and oom_result.elapsed_s is not None
    assert oom_result.reached_s <= oom_result.elapsed_s < 8.0


def test_a_run_after_an_oom_works(tb: Testbed, oom_result: RunResult) -> None:
    assert oom_result.oom
    r = tb.run(reuse_chain(16 * MiB), ["s:0"])
    assert not r.oom and 32 * MiB <= r.device_peak_bytes <= 32 * MiB + SMALL


def counter_graph() -> tf.Graph:
    def body() -> None:
        v = tf.compat.v1.get_variable("v", [4 * MiB], initializer=tf.compat.v1.zeros_initializer())
        bump = tf.raw_ops.AssignAddVariableOp(resource=v.handle, value=tf.ones([4 * MiB]), name="bump")
        with tf.control_dependencies([bump]):
            tf.identity(tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=tf.float32)[:2], name="bumped")
        tf.reduce_sum(v[:2], name="head")
    return build(body)


def test_variables_count_and_do_not_survive_a_run(tb: Testbed) -> None:
    g = counter_graph()
    assert initializer_names(g.as_graph_def()) == ["v/Assign"]
    r = tb.run(g, ["head:0"], steps=2)
    # Only v (16 MiB) is big: it was initialised before the peak was reset and stays resident.
    assert 16 * MiB <= r.device_peak_bytes <= 16 * MiB + SMALL
    for _ in range(2):  # each run starts from the initial value: warm-up + 2 steps = 3 bumps
        r = tb.run(g, ["bump", "head:0"], steps=2)
        assert set(r.outputs) == {"head:0"}
    bumped = tb.run(g, ["bumped:0"], steps=2).outputs["bumped:0"]
    np.testing.assert_array_equal(bumped, [3.0, 3.0])


def test_host_placement_keeps_tensors_off_the_device(tb: Testbed) -> None:
    def body(reduce_on: str) -> Callable[[], None]:
        def inner() -> None:
            with tf.device(HOST):
                x = tf.random.uniform([4 * MiB], seed=1, name="x")
            with tf.device(reduce_on):
                s = tf.reduce_sum(x, name="s")
            tf.multiply(s, 2.0, name="y")
        return inner
    on_host = tb.run(build(body(HOST)), ["y:0"])
    on_device = tb.run(build(body(DEVICE)), ["y:0"])
    assert on_host.device_peak_bytes <= SMALL and on_host.host_peak_bytes >= 16 * MiB
    # Reading x on the device copies it over gRPC into the device's memory.
    assert 16 * MiB <= on_device.device_peak_bytes <= 16 * MiB + SMALL
    assert on_host.outputs["y:0"] == on_device.outputs["y:0"]


_REFERENCE = r"""
import sys, numpy as np, tensorflow as tf
graph_path, feeds_path, out_path, fetches, init, runs = sys.argv[1:]
gd = tf.compat.v1.GraphDef.FromString(open(graph_path, "rb").read())
g = tf.Graph()
with g.as_default():
    tf.graph_util.import_graph_def(gd, name="")
feeds = dict(np.load(feeds_path))
with tf.compat.v1.Session(graph=g) as sess:
    sess.run(init.split(","))
    for _ in range(int(runs)):
        values = sess.run(fetches.split(","), feeds)
np.savez(out_path, *[v for v in values if v is not None])
"""


def regression_graph() -> tf.Graph:
    def body() -> None:
        x = tf.compat.v1.placeholder(tf.float32, [512, 256], name="x")
        w = tf.compat.v1.get_variable("w", [256, 64], initializer=tf.random_normal_initializer(seed=3))
        noise = tf.random.normal([512, 64], seed=4, name="noise")
        pred = tf.nn.relu(tf.matmul(x, w) + noise, name="pred")
        loss = tf.reduce_mean(tf.square(pred - 1.0), name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(loss, name="train")
    return build(body)


def test_outputs_match_a_local_session_bit_for_bit(tb: Testbed, tmp_path: Path) -> None:
    g, steps = regression_graph(), 3
    feeds = {"x:0": np.random.default_rng(0).standard_normal((512, 256)).astype(np.float32)}
    fetches = ["train", "loss:0", "pred:0"]
    r = tb.run(g, fetches, feeds, steps=steps)
    # The reference is a plain local Session in a fresh process with the testbed's TF settings (oneDNN off,
    # deterministic ops): oneDNN's kernels round differently, and this process may have it on.
    (tmp_path / "g.pb").write_bytes(g.as_graph_def().SerializeToString())
    np.savez(tmp_path / "feeds.npz", **feeds)
    args = [str(tmp_path / n) for n in ("g.pb", "feeds.npz", "out.npz")]
    args += [",".join(fetches), ",".join(initializer_names(g.as_graph_def())), str(steps + 1)]
    subprocess.run([sys.executable, "-c", _REFERENCE, *args], check=True, env={**os.environ, **COMMON_ENV},
                   capture_output=True, timeout=120)
    ref = np.load(tmp_path / "out.npz")
    assert set(r.outputs) == {"loss:0", "pred:0"}
    assert r.outputs["loss:0"].tobytes() == ref["arr_0"].tobytes()
    assert r.outputs["pred:0"].tobytes() == ref["arr_1"].tobytes()


def test_tf_errors_raise_testbed_error_and_keep_it_usable(tb: Testbed) -> None:
    g = reuse_chain(MiB)
    with pytest.raises(BadInputError, match="no_such_tensor"):
        tb.run(g, ["no_such_tensor:0"])
    with pytest.raises(TestbedError, match="uninitialized|not initialized|init_ops"):
        tb.run(counter_graph(), ["head:0"], init_ops=[])
    assert not tb.run(g, ["s:0"]).oom


def test_a_step_over_the_timeout_raises_instead_of_hanging(tb: Testbed) -> None:
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (512, 512), name="x")
        y = x
        for _ in range(40):
            y = tf.matmul(y, x)
        tf.identity(y, name="y")
    before = tb.step_timeout_s
    tb.step_timeout_s = 0.001
    try:
        with pytest.raises(TestbedTimeoutError, match="did not finish within") as caught:
            tb.run(g, ["y:0"], {"x:0": np.ones((512, 512), np.float32)})
    finally:
        tb.step_timeout_s = before
    assert caught.value.limit_s == 0.001 and caught.value.phase
    assert tb.run(reuse_chain(MiB), ["s:0"]).ran


def test_a_hung_step_is_a_timeout_naming_its_phase(tb: Testbed) -> None:
    def body() -> None:
        q = tf.queue.FIFOQueue(1, tf.float32, shapes=[()])
        tf.identity(q.dequeue(), name="y")   # nothing is ever enqueued: TF waits forever
    before = tb.step_timeout_s
    tb.step_timeout_s = 3.0
    try:
        with pytest.raises(TestbedTimeoutError, match="the warm-up step did not finish within 3 s"):
            tb.run(build(body), ["y:0"])
    finally:
        tb.step_timeout_s = before
    assert tb.run(reuse_chain(MiB), ["s:0"]).ran


def test_a_graph_that_ran_gets_a_phase_limit_from_its_run(tb: Testbed) -> None:
    from tfmem.testbed.runner import MIN_PHASE_TIMEOUT_S

    g = reuse_chain(2 * MiB)
    assert tb.run(g, ["s:0"]).ran
    digest = tb._prepare(g, ["s:0"], None, 1, None, None)[2]
    assert MIN_PHASE_TIMEOUT_S <= tb._phase_limit(digest) < tb.step_timeout_s


def test_a_worker_killed_mid_step_is_a_crash_and_the_testbed_stays_usable(tb: Testbed) -> None:
    def body() -> None:
        x = tf.random.uniform((512, 512), seed=1)
        y = x
        for _ in range(100):
            y = tf.matmul(y, x) / 512.0
        tf.reduce_sum(y, name="y")

    earlier = {t.ident for t in threading.enumerate()}   # a cut-short run's helper may still be about

    def kill_mid_run() -> None:   # once this run's helper thread is in its TF calls, not while run() prepares
        while not any(t.name == "tfmem-testbed-run" and t.ident not in earlier for t in threading.enumerate()):
            time.sleep(0.01)
        time.sleep(0.3)
        # the pid read now: a run replaces servers a run before it cut short, so one read earlier may be gone
        os.kill(tb.pids["worker:0"], signal.SIGKILL)

    killer = threading.Thread(target=kill_mid_run, daemon=True)
    killer.start()
    with pytest.raises(TestbedCrashError, match="worker:0 server .* died"):
        tb.run(build(body), ["y:0"], steps=20)
    killer.join()
    assert tb.run(reuse_chain(MiB), ["s:0"]).ran


def test_constants_larger_than_the_cap_are_an_oom_while_initialising() -> None:
    # Variables initialised from constants: the worker builds each constant with the capped allocator (TF said
    # "Cannot parse tensor from proto" 10 s later, then failed formatting its own error).
    rng = np.random.default_rng(0)

    def body() -> None:
        h = tf.ones((8, 1024))
        for i in range(4):
            w = tf.Variable(tf.constant(rng.standard_normal((1024, 1024)).astype(np.float32)), name=f"w{i}")
            h = tf.matmul(h, w)
        tf.reduce_sum(h, name="out")
    with Testbed(12 * MiB) as small:
        r = small.run(build(body), ["out:0"])
    assert r.oom and "out of memory in the initialisation" in r.error


def test_repeated_ooms_leave_nothing_behind(tb: Testbed) -> None:
    too_big = reuse_chain(CAP)
    fds = len(os.listdir("/proc/self/fd"))
    ports = []
    for _ in range(3):
        ports += [int(a.rsplit(":", 1)[1]) for addrs in tb.cluster.values() for a in addrs]
        assert tb.run(too_big, ["s:0"]).ending == "oom"
    assert tb.run(reuse_chain(MiB), ["s:0"]).ran
    current = {int(a.rsplit(":", 1)[1]) for addrs in tb.cluster.values() for a in addrs}
    _assert_cleaned_up({"pids": [], "ports": sorted(set(ports) - current)})   # the cut-short servers' ports
    assert len(os.listdir("/proc/self/fd")) <= fds
    left = sorted(p.name for p in tb._workdir.iterdir())
    assert not [n for n in left if n.startswith("bfc")], left                     # the allocator maps
    assert len([n for n in left if n.startswith("worker-0.")]) <= 2, left           # stderr of the last two starts


def test_two_testbeds_at_once_are_independent(tb: Testbed) -> None:
    with Testbed(64 * MiB) as other:
        assert not set(other.pids.values()) & set(tb.pids.values()) and other.target != tb.target
        assert other.run(reuse_chain(64 * MiB), ["s:0"]).oom     # over the small one's cap only
        r = tb.run(reuse_chain(16 * MiB), ["s:0"])
        assert r.ran and 32 * MiB <= r.device_peak_bytes <= 32 * MiB + SMALL


def _assert_cleaned_up(info: dict, timeout_s: float = 15.0) -> None:
    # A killed multi-threaded process shows as a zombie before its last thread has closed its sockets: poll both.
    def clean() -> bool:
        return all(process_gone(pid) for pid in info["pids"]) and not set(info["ports"]) & listening_ports()
    deadline = time.monotonic() + timeout_s
    while not clean() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(process_gone(pid) for pid in info["pids"]), f"testbed servers survived: {info['pids']}"
    assert not set(info["ports"]) & listening_ports(), f"ports still listened on: {info['ports']}"


_USER = r"""
import faulthandler, json, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for a stack dump when a process hangs
# As in a terminal: a suite started in the background (`make test &`) passes SIGINT down ignored, and Python
# then installs no KeyboardInterrupt handler (every full-suite hang of this test before 2026-11-28).
signal.signal(signal.SIGINT, signal.default_int_handler)
import tensorflow as tf
from tfmem.testbed import Testbed
machines = int(sys.argv[2])
g = tf.Graph()
with g.as_default():
    x = tf.random.uniform([1 << 20], seed=1)
    with tf.device(f"/job:worker/task:{machines - 1}"):  # a step that crosses machines when there are two
        tf.reduce_sum(x * 2.0, name="s")
tb = Testbed("64MiB", machines=machines)
ports = [int(a.rsplit(":", 1)[1]) for addrs in tb.cluster.values() for a in addrs]
print(json.dumps({"pids": list(tb.pids.values()), "ports": ports, "workdir": str(tb._workdir)}), flush=True)
if sys.argv[1] == "exit":
    sys.exit(0)  # never closed: the atexit hook must do it
sys.stdin.readline()  # idle until the test says go
with tb:
    while True:
        tb.run(g, ["s:0"], steps=20)
"""


@pytest.fixture(scope="module")
def users(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Three user processes, started together because TF start-up dominates: two loop (on two machines), one
    exits at once (one machine)."""
    # Own sessions, so that a group SIGINT reaches a user and its servers as a Ctrl-C in a terminal would.
    logdir = tmp_path_factory.mktemp("users")
    procs = {}
    for name, mode, machines in (("sigkill", "loop", "2"), ("ctrl_c", "loop", "2"), ("exit", "exit", "1")):
        log = logdir / f"{name}.stderr"
        with log.open("w") as stderr:  # the child keeps its own descriptor
            procs[name] = subprocess.Popen([sys.executable, "-c", _USER, mode, machines], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO,
                                           start_new_session=True)
        procs[name].stderr_log = log  # type: ignore[attr-defined]
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _wait_or_dump(proc: subprocess.Popen[str], timeout_s: float, info: dict) -> int:
    """``proc.wait(timeout_s)``; on a hang, fail with ``_hang_report`` (also written beside the user's stderr:
    under xfail, pytest shows the marker's reason, not the failure message)."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        report = f"the user process did not exit within {timeout_s:.0f} s; " + _hang_report(proc, info)
        proc.stderr_log.with_suffix(".hang.txt").write_text(report)  # type: ignore[attr-defined]
        pytest.fail(report)


def _hang_report(proc: subprocess.Popen[str], info: dict) -> str:
    """Python stacks of the user and its servers (faulthandler on SIGUSR1), the servers' stderr, and native
    stacks where py-spy (two samples: progress or stall?) and gdb (every thread) are installed."""
    pids = [proc.pid, *info["pids"]]
    for pid in pids:
        if not process_gone(pid):
            os.kill(pid, signal.SIGUSR1)
    time.sleep(2.0)
    user_log: Path = proc.stderr_log  # type: ignore[attr-defined]
    server_logs = sorted(Path(info["workdir"]).glob("*.stderr"))
    parts = [
        "its children:\n" + _run(["ps", "-o", "pid,stat,etime,args", "--ppid", str(proc.pid)]),
        "its stderr (stacks at the end):\n" + user_log.read_text(errors="replace")[-6000:],
        *(f"{p.name}:\n{p.read_text(errors='replace')[-4000:]}" for p in server_logs),
    ]
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy:
        parts += [f"py-spy dump --native --pid {pid}:\n" + _run([spy, "dump", "--native", "--pid", str(pid)])[-6000:]
                  for pid in pids * 2]
    if shutil.which("gdb"):  # threads print from high to low: keep the whole output
        parts += [f"gdb, pid {pid}:\n" + _run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 12"])
                  for pid in info["pids"]]
    return "\n--- ".join(parts)


def _run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return out.stdout + out.stderr


def _info(proc: subprocess.Popen[str], go: bool = True) -> dict:
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        pytest.fail(f"the user process died before its testbed started (rc={proc.wait()})")
    if go:
        proc.stdin.write("go\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        time.sleep(1.0)  # midway through its run loop
    return json.loads(line)


def test_sigkill_of_the_user_process_kills_the_servers(users: dict[str, subprocess.Popen[str]]) -> None:
    proc = users["sigkill"]
    info = _info(proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    _assert_cleaned_up(info)  # PR_SET_PDEATHSIG / the watchdog; nothing could run in the parent
    # and the servers remove the work folder as they go (the next testbed would remove an orphaned one)
    deadline = time.monotonic() + 15
    while Path(info["workdir"]).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(info["workdir"]).exists()


def test_the_next_testbed_removes_an_orphaned_work_folder() -> None:
    from tfmem.testbed import runner as testbed

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = Path(tempfile.mkdtemp(prefix=f"{testbed.WORKDIR_PREFIX}{int(dead.stdout)}-"))
    ours = Path(tempfile.mkdtemp(prefix=f"{testbed.WORKDIR_PREFIX}{os.getpid()}-"))
    try:
        testbed._remove_orphaned_workdirs()
        assert not orphan.exists() and ours.exists()   # a live owner's folder is kept
    finally:
        ours.rmdir()
        shutil.rmtree(orphan, ignore_errors=True)


def test_ctrl_c_of_the_user_process_cleans_up(users: dict[str, subprocess.Popen[str]]) -> None:
    proc = users["ctrl_c"]
    info = _info(proc)
    os.killpg(proc.pid, signal.SIGINT)  # the servers ignore it; the user's `with` closes the testbed
    # The run's TF calls are in a helper thread; the interrupt reaches the user's thread, which kills the servers
    # (tfmem.testbed.watch), so no TF call is left waiting on a step. Generous for a loaded machine.
    assert _wait_or_dump(proc, 60, info) != 0
    _assert_cleaned_up(info)
    assert not Path(info["workdir"]).exists()


def test_exit_without_close_cleans_up(users: dict[str, subprocess.Popen[str]]) -> None:
    proc = users["exit"]
    info = _info(proc, go=False)
    assert proc.wait(timeout=30) == 0
    _assert_cleaned_up(info)
    assert not Path(info["workdir"]).exists()


def test_exception_in_with_block_cleans_up() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with Testbed("16MiB", machines=2) as tb:
            ports = [int(a.rsplit(":", 1)[1]) for addrs in tb.cluster.values() for a in addrs]
            info = {"pids": list(tb.pids.values()), "ports": ports}
            workdir = tb._workdir
            assert len(info["pids"]) == len(set(ports)) == 4   # a device and a host server per machine
            raise RuntimeError("boom")
    _assert_cleaned_up(info)
    assert not workdir.exists()
    tb.close()  # idempotent
    with pytest.raises(TestbedError, match="closed"):
        tb.run(reuse_chain(MiB), ["s:0"])


def test_a_dead_device_is_restarted(tb: Testbed) -> None:
    dead = tb.pids["worker:0"]
    os.kill(dead, signal.SIGKILL)
    r = tb.run(reuse_chain(MiB), ["s:0"])
    assert not r.oom and tb.pids["worker:0"] != dead


def _compute_threads(tb: Testbed) -> int:
    # Counted right after the server started, before the eager context (for get_memory_info) adds its own pool.
    return tb._procs["worker:0"].call("threads")["at_start"].get("tf_Compute", 0)


def test_inter_op_threads_restart_the_device(tb: Testbed) -> None:
    g = reuse_chain(MiB)
    before = tb.pids["worker:0"]
    r = tb.run(g, ["s:0"], inter_op_threads=3)
    assert not r.oom and tb.pids["worker:0"] != before
    assert _compute_threads(tb) == 3  # the worker executor's pool (GrpcServer's ComputePool)
    after = tb.pids["worker:0"]
    tb.run(g, ["s:0"], inter_op_threads=3)
    assert tb.pids["worker:0"] == after  # same setting: no restart


def test_a_feed_larger_than_the_cap_is_an_oom_result(tb: Testbed) -> None:
    # The worker builds fed tensors with the capped allocator (TF reports that failure, 10 s later, as an invalid
    # feed): the watch sees the failed request.
    def body() -> None:
        x = tf.compat.v1.placeholder(tf.float32, [CAP // 2], name="x")
        tf.reduce_sum(x, name="s")
    r = tb.run(build(body), ["s:0"], {"x:0": np.ones(CAP // 2, np.float32)})
    assert r.oom and "out of memory in the warm-up step" in r.error
