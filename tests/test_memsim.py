"""Memory simulator: golden peaks with their derivation, explanations of the peak, regions, properties."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings

from tests.helpers import random_dags
from tfmem import examples
from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.loading import load
from tfmem.sim import costmodel
from tfmem.sim.bfc import BFCAllocator, rounded_bytes
from tfmem.sim.memsim import simulate
from tfmem.sim.opmemory import viewed_input
from tfmem.sim.replay import first_update_copies

v1 = tf.compat.v1
KIB4 = 4096  # 1024 float32


def _chain(n: int) -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        h = v1.placeholder(tf.float32, (1024,), name="x")
        for i in range(n):
            h = tf.math.sin(h, name=f"s{i}")
    return g


def test_chain_peak_uses_forwarding():
    # x is fed (never forwarded: TF holds a reference), s0 gets a new 4 KiB buffer, every later sin is the
    # last reader of its input and reuses it; the fetched s7 is that same buffer: 2 x 4 KiB.
    prof = simulate(_chain(8), ["s7:0"])
    assert prof.peak_bytes == 2 * KIB4


def test_fan_out_keeps_inputs_alive():
    # x (fed) and a = 2x are read by 4 consumers each producing 4 KiB; the sum is fetched.
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, (1024,), name="x")
        a = tf.math.sin(x, name="a")
        outs = [tf.math.cos(a * float(i + 2), name=f"c{i}") for i in range(4)]
        tf.add_n(outs, name="y")
    prof = simulate(g, ["y:0"])
    assert prof.peak_bytes >= 3 * KIB4          # at least x, a and one product are live together
    assert prof.peak_bytes <= 7 * KIB4          # never more than everything at once
    assert sum(t.nbytes for t in prof.live_at_peak) == prof.peak_bytes


def test_variables_are_persistent_and_reads_alias_them():
    built = examples.mlp(batch=4, dims=(64, 128, 4))
    prof = simulate(built.graph, built.fetches)
    weights = (64 * 128 + 128 + 128 * 4 + 4) * 4
    assert prof.persistent_bytes >= weights
    assert prof.persistent_bytes < weights + 64 * 1024   # plus small constants only
    kinds = {t.kind for t in prof.live_at_peak}
    assert "persistent" in kinds
    assert prof.transient_peak_bytes == prof.peak_bytes - prof.persistent_bytes


def _graph_with_an_idle_variable() -> tuple[tf.Graph, list[str]]:
    g = tf.Graph()
    with g.as_default():
        used = tf.compat.v1.get_variable("used", (1024, 1024), initializer=tf.compat.v1.ones_initializer())
        tf.compat.v1.get_variable("idle", (2048, 1024), initializer=tf.compat.v1.ones_initializer())  # 8 MiB
        tf.reduce_sum(used * 2.0, name="y")
    return g, ["y:0"]


def test_variables_the_step_does_not_run_still_take_device_memory():
    g, fetches = _graph_with_an_idle_variable()
    for capacity in (None, 64 << 20):
        prof = simulate(g, fetches, device_memory=capacity)
        assert prof.persistent_bytes >= (4 + 8) << 20, capacity   # "used" (4 MiB) and "idle" (8 MiB)
        assert "idle variable" in {t.producer for t in prof.live_at_peak}


@pytest.mark.testbed
def test_idle_variable_is_measured_as_simulated():
    from tfmem.testbed import Testbed

    g, fetches = _graph_with_an_idle_variable()
    with Testbed("64MiB") as tb:
        measured = tb.run(g, fetches, steps=1).device_peak_bytes
    simulated = simulate(g, fetches, device_memory=64 << 20).peak_bytes
    assert abs(simulated - measured) <= 0.05 * measured, (simulated, measured)


def test_live_at_peak_names_producers_and_consumers():
    prof = simulate(_chain(3), ["s2:0"])
    names = {t.tensor for t in prof.live_at_peak}
    assert "x:0" in names
    s0 = next(t for t in prof.live_at_peak if t.tensor.startswith("s"))
    assert s0.producer in ("Sin", "_UnaryOpsComposition")  # Grappler may fuse the chain of sines
    assert prof.timeline[0][3] == "<start>" and len(prof.timeline) > 3


def test_host_placed_ops_count_toward_host_peak():
    g = tf.Graph()
    with g.as_default():
        with tf.device("/job:host/replica:0/task:0/device:CPU:0"):
            big = tf.math.sin(tf.ones((1 << 18,)), name="big")   # 1 MiB on the host
        with tf.device("/job:worker/replica:0/task:0/device:CPU:0"):
            tf.reduce_sum(big, name="small")
    prof = simulate(g, ["small:0"], device="/job:worker/replica:0/task:0/device:CPU:0",
                    host="/job:host/replica:0/task:0/device:CPU:0", grappler=False)
    assert prof.host_peak_bytes >= 1 << 20
    assert prof.peak_bytes >= 1 << 20   # the device receives a copy to reduce it
    assert prof.peak_bytes < (2 << 20) + 4096   # plus the handful of 256-byte constant chunks


def test_v1_loop_and_function_do_not_crash():
    g = tf.Graph()
    with g.as_default():
        v1.disable_control_flow_v2()
        try:
            x = v1.placeholder(tf.float32, (256,), name="x")
            _, y = v1.while_loop(lambda i, a: i < 4, lambda i, a: (i + 1, tf.sin(a)), [tf.constant(0), x])
            tf.identity(y, name="out")
        finally:
            v1.enable_control_flow_v2()
    prof = simulate(g, ["out:0"])
    assert prof.peak_bytes >= 2 * 1024


def test_feed_shapes_reach_the_simulator():
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, (None, 256), name="x")
        tf.math.sin(x, name="y")
    small = simulate(g, ["y:0"], feed_shapes={"x:0": (1, 256)}).peak_bytes
    big = simulate(g, ["y:0"], feed_shapes={"x:0": (64, 256)}).peak_bytes
    assert big == 64 * small


def test_bfc_model_rounding_and_reuse():
    bfc = BFCAllocator()
    assert rounded_bytes(1) == 256 and rounded_bytes(257) == 512
    a = bfc.allocate(1 << 20)
    b = bfc.allocate(1 << 20)
    bfc.free(a)
    c = bfc.allocate(600_000)          # 600 kB > half of the free 1 MiB chunk: takes it whole
    assert bfc.in_use_bytes == 2 << 20
    bfc.free(b)
    bfc.free(c)
    assert bfc.in_use_bytes == 0 and bfc.peak_bytes == 2 << 20


def _elementwise_dag(preds, sizes) -> tuple[tf.Graph, list[str]]:
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, (max(sizes),), name="x")
        nodes = []
        for i, (ps, size) in enumerate(zip(preds, sizes, strict=True)):
            if not ps:
                nodes.append(tf.math.sin(x[:size], name=f"n{i}"))
                continue
            terms = [tf.reduce_sum(nodes[p]) for p in ps]
            nodes.append(tf.math.cos(tf.fill((size,), tf.add_n(terms)), name=f"n{i}"))
        consumed = {p for ps in preds for p in ps}
        sinks = [f"n{i}:0" for i in range(len(preds)) if i not in consumed]
    return g, sinks


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_dags(max_nodes=14, min_nodes=2, preds=(1, 3), sizes=(64, 256, 1024, 4096)))
def test_peak_bounds_on_random_dags(dag):
    g, sinks = _elementwise_dag(*dag)
    prof = simulate(g, sinks)
    largest = max(dag[1]) * 4
    assert prof.peak_bytes >= largest                      # the largest tensor exists at some point
    total = sum(rounded_bytes(s * 4) for s in dag[1]) * 3 + 64 * 1024
    assert prof.peak_bytes <= total                        # never more than everything at once (+ slack)
    assert prof.peak_bytes == max(d for _, d, _, _ in prof.timeline)
    assert np.all(np.diff(prof.schedule.start_s) >= 0)


@pytest.mark.parametrize("threads", [1, 4])
def test_more_threads_never_lower_the_wide_peak_much(threads):
    built = examples.wide_branches(branches=8, elems=1 << 14)
    prof = simulate(built.graph, built.fetches, inter_op_threads=threads)
    assert prof.peak_bytes > 0 and prof.schedule.makespan_s > 0


def test_dim0_slices_are_views_and_feeds_live_all_step():
    # x (4 rows of 64 KiB) is fed and sliced row by row. TF's StridedSlice returns whole aligned rows as
    # views into x (no allocation), and the step's feed table holds x to the end. Grappler turns x[i] * x[i]
    # into Square, which gets a new 64 KiB buffer (TF never writes into a view); AddN reuses one of them for
    # y, and the fetched concat w (320 KiB) is made while y is live. Peak: x + y + w, plus the small Consts.
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, (4, 16, 1024), name="x")
        y = tf.add_n([tf.math.multiply(x[i], x[i]) for i in range(4)], name="y")
        tf.concat([y] * 5, 0, name="w")
    prof = simulate(g, ["w:0"])
    assert prof.peak_bytes - prof.persistent_bytes == 256 * 1024 + 64 * 1024 + 320 * 1024
    assert {t.tensor: t.kind for t in prof.live_at_peak}["x:0"] == "fed"
    assert not any(t.producer == "StridedSlice" for t in prof.live_at_peak)


def test_unaligned_or_strided_slices_are_copies():
    # Rows of 3 floats (12 bytes) are not on Eigen's alignment, and a stride of 2 is not contiguous: TF copies.
    # Rows of 16 floats (64 bytes) sliced with stride 1 are a view of input 0.
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, (8, 3), name="x")
        z = v1.placeholder(tf.float32, (8, 16), name="z")
        unaligned, strided, aligned = x[1:5], z[::2], z[2:6]
    ir = load(g)
    assert viewed_input(ir[unaligned.op.name], ir, 0) is None
    assert viewed_input(ir[strided.op.name], ir, 0) is None
    assert viewed_input(ir[aligned.op.name], ir, 0) == 0


def test_successors_past_eight_out_edges_come_in_hashed_order():
    # TF's EdgeSet keeps up to 8 out-edges in the order they were added and hashes the rest: a node read by
    # 4 ops activates them in graph order in every draw; one read by 12 ops gets a different order per draw.
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, (16,), name="x")
        a = tf.math.sin(x, name="a")
        b = tf.math.cos(x, name="b")
        few = [tf.math.exp(a, name=f"few{i}") for i in range(4)]
        many = [tf.math.exp(b, name=f"many{i}") for i in range(12)]
        tf.add_n(few + many, name="y")
    eg = ExecutionGraph.build(load(g), ["y:0"])
    draws = [eg.activation_order(seed) for seed in range(5)]
    assert all(d["a"] == tuple(f"few{i}" for i in range(4)) for d in draws)
    assert all(sorted(d["b"]) == sorted(f"many{i}" for i in range(12)) for d in draws)
    assert len({d["b"] for d in draws}) > 1


def test_small_kernels_still_go_to_the_pool():
    # TF starts every kernel's cost estimate at 1e8 cycles, so for the first ~90 steps only kernels that declare
    # themselves cheap (Const, Identity, shape ops...) run inline; a 16-float Sin is as "expensive" as a MatMul.
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, (16,), name="x")
        tf.identity(tf.math.sin(x, name="s"), name="y")
    ir = load(g)
    assert costmodel.is_expensive(ir["s"], ir)
    assert not costmodel.is_expensive(ir["y"], ir)


def _replayed(built: examples.Built, device_memory: int):
    from tfmem.ir.devices import Placement
    from tfmem.sim import memsim
    from tfmem.sim.analysis import analyse
    from tfmem.sim.replay import Replay

    ir = load(built.graph)
    analysis = analyse(ir, list(built.fetches), [], costmodel.DEFAULT_DEVICE)
    replay = Replay(analysis.eg, Placement(None, None), device_memory, analysis.views)
    replay.run(memsim._typical_schedule(analysis, analysis.expensive.__getitem__, 1))
    return replay


def test_first_step_adam_update_copies_a_shared_slot_mid_region():
    # Measured on the testbed: Adam's two slots of a variable share one buffer after initialisation, and the
    # first step's ResourceApplyAdam copies one into a new chunk, kept for the session (later steps allocate
    # nothing). With a capacity the simulator replays that warm-up step, so the copy sits after the
    # first step's transients, not packed with the other variables; the bytes stay those of the variables.
    adam = examples.mlp(batch=64, dims=(256, 512, 10), optimizer="adam")
    replay = _replayed(adam, 64 << 20)
    copies = first_update_copies(replay.eg, replay.sharing)
    assert copies and all(replay.graph[op].op == "ResourceApplyAdam" for op in copies)
    chunks = replay.allocators["device"]._handles
    ptr = {name: chunks[buf.handle].ptr for name, buf in replay.var_storage.items()}
    moved = set().union(*copies.values())
    assert min(ptr[v] for v in moved) > max(p for name, p in ptr.items() if name not in moved)
    assert (simulate(adam.graph, adam.fetches, device_memory=64 << 20).persistent_bytes
            == simulate(adam.graph, adam.fetches).persistent_bytes)


@pytest.mark.parametrize("optimizer, copies", [
    # The testbed's first step (RunMetadata allocation records): each update op's bytes kept for the session.
    # Adam: a weight's two zero slots share (one copy); a bias starts at zeros too, so it and its slots share
    # one buffer (two copies). Momentum: a bias shares with its zero accumulator (one copy, of the bias).
    ("adam", {"dense0/w": 1, "dense0/b": 2, "dense1/w": 1, "dense1/b": 2}),
    ("momentum", {"dense0/b": 1, "dense1/b": 1}),
])
def test_first_step_copies_every_variable_that_shares_its_initial_constant(optimizer, copies):
    built = examples.mlp(batch=64, dims=(256, 512, 10), optimizer=optimizer)
    replay = _replayed(built, 64 << 20)
    predicted = {op: len(vs) for op, vs in first_update_copies(replay.eg, replay.sharing).items()}
    assert predicted == {f"train_op/update_{v}/ResourceApply{optimizer.capitalize()}": n for v, n in copies.items()}


def test_executor_folds_gated_constants_into_persistent_memory():
    # A Fill gated by a control edge survives Grappler, but the executor's own constant folding turns it into a
    # Const kernel that holds its 1 MiB for the session (measured: 7 such constants in a planned RNN's partition).
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (512, 512), name="x")
        with tf.control_dependencies([x.op]):
            ones = tf.fill((512, 512), 2.0, name="ones")
        tf.multiply(x, ones, name="y")
    assert simulate(g, ["y:0"], grappler=False).persistent_bytes < 4096
    assert simulate(g, ["y:0"], grappler=True).persistent_bytes >= 512 * 512 * 4


def test_a_capacity_replays_the_feeds_in_their_worst_order():
    # BFC splits a free chunk only when it is twice the request. Under a 31 MiB cap (a 2 MiB region, then 29 MiB),
    # "big" (12 MiB) allocated first leaves room for small * 2; allocated after "small" (6 MiB), it takes the
    # 23 MiB left whole and small * 2 fails. Sessions allocate feeds in the caller's order, which the graph lacks.
    g = tf.Graph()
    with g.as_default():
        small = tf.compat.v1.placeholder(tf.float32, (6 * 2**18,), name="small")
        big = tf.compat.v1.placeholder(tf.float32, (12 * 2**18,), name="big")
        tf.add(tf.reduce_sum(small * 2.0), tf.reduce_sum(big), name="y")
    assert simulate(g, ["y:0"], grappler=False).peak_bytes < 25 * 2**20
    assert simulate(g, ["y:0"], grappler=False, device_memory=31 * 2**20).allocation_failures > 0
    assert simulate(g, ["y:0"], grappler=False, device_memory=40 * 2**20).allocation_failures == 0


def _update_while_read(held: bool) -> tuple[tf.Graph, list[str]]:
    """A 16 MiB resource variable read, then updated in place, then read again: through the first read (still
    held by a reader when the update runs) or through a fresh read."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (1, 2048), name="x")
        w = tf.compat.v1.get_variable("w", shape=(2048, 2048), initializer=tf.compat.v1.constant_initializer(0.5),
                                      use_resource=True)
        first = w.read_value()
        y = tf.matmul(x, first, name="y")
        with tf.control_dependencies([y]):
            update = w.assign_add(tf.fill((2048, 2048), 1.0), read_value=False)
        with tf.control_dependencies([update]):
            z = tf.matmul(x, first if held else w.read_value(), name="z")
        tf.identity(z + y, name="out")
    return g, ["out:0"]


@pytest.mark.slow
@pytest.mark.testbed
@pytest.mark.parametrize("held", [True, False])
def test_an_update_while_a_read_is_held_copies_the_variable(held):
    """TF's PrepareToUpdateVariable copies a variable whose buffer a reader still holds; the copy is the
    variable's from then on, and the old buffer is freed after its last reader."""
    from tfmem.testbed import Testbed

    g, fetches = _update_while_read(held)
    simulated = simulate(g, fetches, inter_op_threads=1).peak_bytes
    with Testbed("256MiB") as tb:
        measured = tb.run(g, fetches, {"x:0": np.ones((1, 2048), np.float32)}, steps=1,
                          inter_op_threads=1).device_peak_bytes
    assert abs(simulated - measured) <= 0.02 * measured, (simulated, measured)
    assert simulated >= (48 if held else 32) << 20   # variable, the filled update (and the copy)


@pytest.mark.slow
@pytest.mark.testbed
@pytest.mark.parametrize(("channels", "groups", "kernel", "size"), [(256, 256, 3, 8), (768, 96, 3, 16)])
def test_xla_grouped_gradient(channels, groups, kernel, size):
    """tf_keras runs a grouped convolution as an XLA-compiled function call; its gradient holds two dense
    ``k x k x C x C`` filters while it runs when depthwise (ConvNeXt: 0.61x of the measured peak without them),
    else a copy of the input and of the filter."""
    tf_keras = pytest.importorskip("tf_keras", reason="make installs tf-keras (requirements-zoo.lock)")
    from tfmem.testbed import Testbed

    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (4, size, size, channels), name="x")
        layer = tf_keras.layers.Conv2D(channels, kernel, padding="same", groups=groups, use_bias=False)
        loss = tf.reduce_sum(tf.square(layer(x)))
        grads = tf.gradients(loss, [x, *layer.trainable_weights])
        tf.add_n([tf.reduce_sum(t) for t in grads], name="out")
    assert any(n.op == "PartitionedCall" for n in g.as_graph_def().node)
    simulated = simulate(g, ["out:0"], inter_op_threads=1).peak_bytes
    with Testbed("512MiB") as tb:
        measured = tb.run(g, ["out:0"], {"x:0": np.ones((4, size, size, channels), np.float32)}, steps=1,
                          inter_op_threads=1).device_peak_bytes
    assert abs(simulated - measured) <= 0.02 * measured, (simulated, measured)


def test_a_fused_batch_norm_with_odd_channels_simulates_after_grappler() -> None:
    """Grappler's remapper fuses a training batch norm and its ReLU into ``_FusedBatchNormEx``, whose shape function
    refuses a channel count not divisible by 4 while the session runs it (tf_keras NASNetMobile has 11 channels)."""
    from tfmem.ir.devices import DEFAULT_DEVICE, with_default_device
    from tfmem.sim.grappler import runtime_graph_def

    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, (4, 8, 8, 11), name="x")
        w = tf.Variable(tf.ones((3, 3, 11, 11)), name="w")
        y = tf.nn.conv2d(x, w, 1, "SAME")
        bn = v1.nn.fused_batch_norm(y, tf.ones((11,)), tf.zeros((11,)), is_training=True)[0]
        loss = tf.reduce_sum(tf.nn.relu(bn), name="loss")
        tf.identity(tf.gradients(loss, [w])[0], name="grad")
    runtime = runtime_graph_def(with_default_device(g.as_graph_def(), DEFAULT_DEVICE), ["grad:0"])
    assert any(n.op == "_FusedBatchNormEx" for n in runtime.node)   # the case this test is about
    assert simulate(g, ["grad:0"], grappler=True).peak_bytes > 0


def test_identity_n_passes_its_inputs_through() -> None:
    """Keras 3's optimizers pass every gradient through one IdentityN: its outputs are its inputs, not copies."""
    g = tf.Graph()
    with g.as_default():
        a = v1.placeholder(tf.float32, (1024, 1024), name="a")   # 4 MiB each
        b = v1.placeholder(tf.float32, (1024, 1024), name="b")
        x, y = tf.identity_n([a * 2.0, b * 3.0])
        tf.add(x, y, name="out")
    profile = simulate(g, ["out:0"])
    # a, b (fed) + the two products + their sum, never two more copies
    assert profile.peak_bytes <= 5 * 4 * 2**20 + 2**20
    from tfmem.sim.bounds import op_working_set_bytes

    ir = load(g)
    assert op_working_set_bytes(ir, next(n.name for n in ir.nodes if n.op == "IdentityN")) == 8 * 2**20


@functools.cache
def _two_machine_moe():
    """A small MoE over two machines (experts and their Adam slots on each), placed as TensorFlow places it."""
    from models import distributed_moe
    from tfmem.ir.colocation import placed_as_tensorflow_would

    devices = [f"/job:w/task:{m}/device:GPU:0" for m in range(2)]
    built = distributed_moe.build(machines=2, experts=4, layers=1, d_model=16, d_ff=32, heads=2, seq=4, batch=4,
                                  vocab=16, dispatch="sparse", devices=devices)
    return placed_as_tensorflow_would(load(built.graph), devices[0]), tuple(built.fetches)


def _replays_with_and_without_bystanders(ir, fetches, placement, device_memory):
    from tfmem.sim import memsim
    from tfmem.sim.analysis import analyse
    from tfmem.sim.replay import Replay, bystanders

    analysis = analyse(ir, list(fetches), [], costmodel.DEFAULT_DEVICE)
    schedules = memsim._drawn_schedules(analysis, analysis.expensive.__getitem__, 2)
    skipped = bystanders(analysis.eg, placement)
    fast = [Replay(analysis.eg, placement, device_memory, analysis.views, bystanders=skipped).run(s)
            for s in schedules]
    full = [Replay(analysis.eg, placement, device_memory, analysis.views, bystanders=frozenset()).run(s)
            for s in schedules]
    return fast, full, skipped


@pytest.mark.parametrize("device_memory", [None, 100 << 10, 64 << 20])
def test_other_devices_are_replayed_only_through_their_copies(device_memory):
    # A graph over two machines, as optimize(devices=...) simulates it for each: skipping the other machine's
    # units (all but the copies of their outputs into this device or its host) gives the very same profile,
    # timeline, failures and live tensors, in every drawn order, and does skip them.
    from tfmem.ir.devices import Placement

    ir, fetches = _two_machine_moe()
    for m in range(2):
        placement = Placement(f"/job:w/task:{m}/device:GPU:0", f"/job:w/task:{m}/device:CPU:0")
        fast, full, skipped = _replays_with_and_without_bystanders(ir, fetches, placement, device_memory)
        assert skipped and fast == full
        assert fast[0].peak_bytes > 0 and (device_memory != 100 << 10 or fast[0].allocation_failures > 0)


def test_a_variable_read_across_devices_replays_every_unit():
    # A read on this device of another device's resource variable returns that variable's buffer: the other
    # device's updates decide it, so nothing is skipped.
    from tfmem.ir.devices import Placement

    g = tf.Graph()
    with g.as_default():
        with tf.device("/job:w/task:1/device:GPU:0"):
            w = tf.Variable(tf.ones((256, 256)), name="w")
        with tf.device("/job:w/task:0/device:GPU:0"):
            y = tf.reduce_sum(tf.matmul(w.read_value(), w.read_value()), name="y")
        with tf.device("/job:w/task:1/device:GPU:0"):
            step = w.assign_add(tf.ones((256, 256)), read_value=False)
    placement = Placement("/job:w/task:0/device:GPU:0", "/job:w/task:0/device:CPU:0")
    fast, full, skipped = _replays_with_and_without_bystanders(load(g), [y.name, step.name], placement, None)
    assert not skipped and fast == full


def test_every_order_replays_each_distinct_layout_once_and_reports_the_worst():
    # simulate(every_order=True) replays another device's feed orders and the copy orders that relocate only
    # another device's variables once: its answer is still the worst of every combination, replayed in full.
    from tfmem.ir.devices import Placement
    from tfmem.ir.shared_init import sharing_groups
    from tfmem.sim import memsim
    from tfmem.sim.analysis import analyse
    from tfmem.sim.replay import Replay

    devices = [f"/job:w/task:{m}/device:GPU:0" for m in range(2)]
    ir, fetches = _two_machine_moe()
    analysis = analyse(ir, list(fetches), [], costmodel.DEFAULT_DEVICE)
    sharing = sharing_groups(ir)
    assert sharing
    # (capacities where the worst replay has one copy order and where it has the other, and a roomy one)
    for m, capacity in ((0, 100 << 10), (0, 120 << 10), (1, 64 << 20)):
        placement = Placement(devices[m], f"/job:w/task:{m}/device:CPU:0")
        got = simulate(ir, fetches, device=placement.device, host=placement.host, device_memory=capacity,
                       every_order=True, inter_op_threads=2, grappler=False)
        schedules = memsim._drawn_schedules(analysis, lambda u: False, 2)   # TF's GPU kernels all run inline
        every = [Replay(analysis.eg, placement, capacity, analysis.views, feed_order=o, sharing=sharing,
                        copy_order=c, bystanders=frozenset(),
                        idle_variables=memsim.idle_variables(ir, analysis.eg)).run(s)
                 for s in schedules for o in memsim.feed_orders(analysis.eg) for c in ("schedule", "graph")]
        worst = max(every, key=lambda p: (p.allocation_failures, p.peak_bytes))
        assert (got.allocation_failures, got.peak_bytes) == (worst.allocation_failures, worst.peak_bytes)
        assert got.timeline == worst.timeline
    # the fed tokens and targets are machine 0's: machine 1 replays one of their orders
    one = Placement(devices[1], "/job:w/task:1/device:CPU:0")
    assert len(memsim.feed_orders(analysis.eg, one)) == 1 < len(memsim.feed_orders(analysis.eg))
