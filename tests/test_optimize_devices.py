"""Tests of ``optimize(..., devices={device: host, ...})``: a graph over several machines planned device by
device, each against the budget with its own host, and the ops a graph leaves unplaced given the device
TensorFlow's placer runs them on (tfmem.ir.colocation)."""

from __future__ import annotations

import os
from functools import cache

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.errors import BadInputError, InfeasibleBudgetError
from tfmem.ir.colocation import placed_as_tensorflow_would
from tfmem.ir.loading import load
from tfmem.testbed import Testbed
from tfmem.testbed.graph import device_name

MiB = 2**20
MACHINES = 2
LAYERS = 6   # per machine
DEVICES = {device_name(m): device_name(m, "host") for m in range(MACHINES)}
BUDGET = 12 * MiB
FETCHES = ["loss:0", "train"]
THREADS = os.cpu_count() or 1
v1 = tf.compat.v1


@cache
def two_machine_graph() -> tf.Graph:
    """An MLP whose first six layers live on machine 0 and last six on machine 1, trained with Adam: each
    machine holds 18 MiB of weights and slots, more than the budget; the reads and updates are left unplaced
    (TensorFlow colocates them with their variables)."""
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(0)
        with tf.device(device_name(0)):
            x = v1.placeholder(tf.float32, (64, 512), name="x")
        h = x
        for m in range(MACHINES):
            for i in range(LAYERS):
                with tf.device(device_name(m)):
                    w = v1.get_variable(f"w{m}_{i}", (512, 512), initializer=v1.glorot_uniform_initializer(),
                                        use_resource=True)
                    h = tf.nn.relu(h @ w) if i < LAYERS - 1 or m < MACHINES - 1 else h @ w
        with tf.device(device_name(MACHINES - 1)):
            loss = tf.reduce_mean(tf.square(h), name="loss")
        v1.train.AdamOptimizer(1e-3).minimize(loss, name="train", colocate_gradients_with_ops=True)
    return g


VARIABLES = [f"w{m}_{i}" for m in range(MACHINES) for i in range(LAYERS)]


def feeds() -> dict[str, np.ndarray]:
    return {"x:0": np.random.default_rng(0).standard_normal((64, 512)).astype(np.float32)}


@cache
def planned() -> tfmem.Optimized:
    return tfmem.optimize(two_machine_graph(), FETCHES, budget=BUDGET, devices=DEVICES)


def machine_of(device: str) -> int:
    return tf.DeviceSpec.from_string(device).task or 0


def test_unplaced_ops_follow_what_they_are_colocated_with() -> None:
    ir = placed_as_tensorflow_would(load(two_machine_graph()), device_name(0))
    assert all(n.device for n in ir.nodes)
    tied = [n for n in ir.nodes if n.op in ("ReadVariableOp", "ResourceApplyAdam") and n.inputs[0].node in VARIABLES]
    assert len(tied) > len(VARIABLES)
    for node in tied:   # a variable's reads and updates run where it lives
        assert node.device == device_name(int(node.inputs[0].node[1])), node.name
    unplaced = [n.name for n in two_machine_graph().as_graph_def().node if not n.device]
    reads = [n for n in unplaced if n.endswith("ReadVariableOp")]
    assert reads and {ir[n].device for n in reads} == {device_name(0), device_name(1)}
    assert ir["train"].device == ir["train/beta1"].device == device_name(0)   # nothing ties them: the first device


def test_each_device_is_planned_against_the_budget() -> None:
    opt = planned()
    before = {d: tfmem.simulate(two_machine_graph(), FETCHES, device=d, host=h).peak_bytes for d, h in DEVICES.items()}
    assert all(peak > BUDGET for peak in before.values()), before   # neither fits as written
    assert sorted(opt.report.devices) == sorted(DEVICES)
    for device, host in DEVICES.items():
        after = tfmem.simulate(opt.graph, FETCHES, device=device, host=host, inter_op_threads=THREADS,
                               config=opt.config)   # as optimize simulates the session
        assert after.peak_bytes <= BUDGET, (device, after.peak_bytes)
        assert opt.report.devices[device].after.peak_bytes == after.peak_bytes
    assert opt.report.after.peak_bytes == max(r.after.peak_bytes for r in opt.report.devices.values())
    assert "**Per device**" in opt.report.to_markdown()


def test_no_device_copies_through_another_machines_host() -> None:
    """Data crosses machines only where the user's graph sent it across: every copy a plan adds stays on the
    machine of the tensor it copies (its device and its own host)."""
    opt = planned()
    original = placed_as_tensorflow_would(load(two_machine_graph()), device_name(0))
    ir = opt.ir
    assert any("/job:host/replica:0/task:1" in n.device for n in ir.nodes)
    assert any("/job:host/replica:0/task:0" in n.device for n in ir.nodes)
    crossing = 0
    for node in ir.nodes:
        for k, ref in enumerate(node.inputs):
            there = machine_of(ir[ref.node].device)
            if there == machine_of(node.device):
                continue
            crossing += 1
            assert node.name in original, (node.name, ref)   # no added op reads across machines
            was = original[node.name].inputs[k]
            assert machine_of(original[was.node].device) == there, (node.name, ref, was)
    assert crossing > 0


def test_a_device_that_cannot_fit_is_named() -> None:
    g = two_machine_graph()
    with pytest.raises(InfeasibleBudgetError) as caught:
        tfmem.optimize(g, FETCHES, budget="1MiB", devices=DEVICES)
    assert caught.value.device in DEVICES
    assert str(caught.value).startswith(f"device {caught.value.device}: budget 1.00 MiB unreachable")


def test_a_graph_grappler_rejects_is_planned_without_grappler_on_every_device(monkeypatch) -> None:
    """Where Grappler rejects the user's graph, the session runs the plan without it (Optimized.config), so every
    device's plan is simulated without it, also where Grappler would accept the graph an earlier plan left (the
    160-expert MoE of experiments/distributed_moe: Grappler rejects the model and accepted the graph machines 0
    and 1's plans left, so machine 2 was planned with rewrites its session would not run)."""
    from tfmem import optimizer
    from tfmem.sim.grappler import WORK

    asked: list[int] = []

    def rejects_only_the_users_graph(graph_def: object, fetches: object, config: object = None) -> bool:
        asked.append(1)
        return len(asked) == 1   # the first question is about the user's graph

    monkeypatch.setattr(optimizer, "grappler_rejects", rejects_only_the_users_graph)
    rewrites = WORK["rewrites"]
    opt = tfmem.optimize(two_machine_graph(), FETCHES, budget=BUDGET, devices=DEVICES)
    assert opt.config.graph_options.rewrite_options.disable_meta_optimizer
    for device, report in opt.report.devices.items():
        assert any("Grappler) fails on this graph" in n for n in report.notes), device
    assert WORK["rewrites"] == rewrites   # no simulation ran Grappler's rewrites


@pytest.mark.parametrize("kwargs, message", [
    ({"devices": DEVICES, "device": device_name(0)}, "not both"),
    ({"devices": {}}, "non-empty dict"),
    ({"devices": [device_name(0)]}, "non-empty dict"),
    ({"devices": {device_name(0): device_name(0, "host"), device_name(1): device_name(0)}},
     "can name a device being planned"),
    ({"devices": {device_name(0): None, "/job:worker/replica:0/task:0": None}}, "can name the same device"),
    ({"devices": {device_name(0): "@@"}}, "is not a device string"),
])
def test_bad_devices_are_bad_input(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(BadInputError, match=message):
        tfmem.optimize(two_machine_graph(), FETCHES, budget=BUDGET, **kwargs)


@pytest.mark.testbed
@pytest.mark.slow
def test_planned_machines_train_identically_under_the_budget() -> None:
    g, opt = two_machine_graph(), planned()
    with Testbed(64 * MiB, machines=MACHINES) as tb:
        vanilla = tb.run(g, FETCHES, feeds(), steps=2, trace=True)
    assert vanilla.ran and all(p > BUDGET for p in vanilla.device_peaks.values()), vanilla.device_peaks
    # The testbed names machine 0 for every unplaced op; TF's placer still runs each where
    # placed_as_tensorflow_would says (a machine-1 variable's reads and updates on machine 1).
    assert vanilla.run_metadata is not None
    ran_on = {ns.node_name: dev.device for dev in vanilla.run_metadata.step_stats.dev_stats for ns in dev.node_stats}
    placed = placed_as_tensorflow_would(load(g), device_name(0))
    unplaced = [n.name for n in g.as_graph_def().node if not n.device and n.name in ran_on]
    assert any(placed[n].device == device_name(1) for n in unplaced)
    assert {n: ran_on[n] for n in unplaced} == {n: placed[n].device for n in unplaced}
    with Testbed(BUDGET, machines=MACHINES) as tb:
        assert tb.run(g, FETCHES, feeds(), steps=2).oom   # vanilla does not fit
        r = tb.run(opt.graph, FETCHES, feeds(), steps=2, config=opt.config)
    assert r.ran, r.error
    assert all(p <= BUDGET for p in r.device_peaks.values()), r.device_peaks
    assert np.array_equal(r.outputs["loss:0"], vanilla.outputs["loss:0"])
