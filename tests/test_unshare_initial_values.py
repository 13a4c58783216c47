"""unshare_initial_values: variables initialised to a constant start with their own buffer, so TF's first training
step copies none of them (measured in real sessions, from RunMetadata), and every value stays bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensorflow.core.protobuf import config_pb2

from passes.unshare_initial_values import UnshareInitialValues
from tfmem import examples
from tfmem.ir.devices import Placement
from tfmem.ir.loading import load
from tfmem.ir.shared_init import sharing_groups
from tfmem.pipeline import PassContext
from tfmem.sim.analysis import analyse
from tfmem.sim.costmodel import DEFAULT_DEVICE
from tfmem.sim.replay import Replay, first_update_copies
from tfmem.testbed.graph import initializer_names

v1 = tf.compat.v1


def _unshared(built: examples.Built):
    return UnshareInitialValues().run(load(built.graph), PassContext(tuple(built.fetches)))


def _train(graph_def, built: examples.Built, steps: int):
    """Initialise, then run ``steps`` training steps in one session (the usual TF1 workflow): each step's
    fetched values, the bytes each update op allocated in each step, and every variable's final value."""
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    fetched, allocated = [], []
    with v1.Session(graph=g) as sess:
        sess.run(initializer_names(graph_def))
        for _ in range(steps):
            meta = config_pb2.RunMetadata()
            fetched.append(sess.run(built.fetches, built.feeds, run_metadata=meta,
                                    options=config_pb2.RunOptions(trace_level=config_pb2.RunOptions.FULL_TRACE)))
            allocated.append({ns.node_name: sum(m.total_bytes for m in ns.memory)
                              for dev in meta.step_stats.dev_stats for ns in dev.node_stats
                              if "ResourceApply" in ns.node_name and any(m.total_bytes for m in ns.memory)})
        handles = [n.name for n in graph_def.node if n.op == "VarHandleOp"]
        final = sess.run([g.get_operation_by_name(f"{h}/Read/ReadVariableOp").outputs[0] for h in handles])
    return fetched, allocated, dict(zip(handles, final, strict=True))


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_first_step_no_longer_copies_variables_and_values_stay_identical(optimizer):
    built = examples.mlp(batch=32, dims=(64, 128, 10), optimizer=optimizer)
    result = _unshared(built)
    assert result.changed
    before = _train(built.graph.as_graph_def(), built, steps=3)
    after = _train(result.graph.to_graph_def(), built, steps=3)
    # Without the pass the first step's updates allocate copies of the variables (later steps nothing);
    # with it, no update allocates in any step.
    assert before[1][0] and not any(before[1][1:])
    assert not any(after[1])
    for a, b in zip(before[0], after[0], strict=True):
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x, y)
    assert before[2].keys() == after[2].keys()
    for name, value in before[2].items():
        assert np.array_equal(value, after[2][name]), name


def test_the_simulator_sees_no_first_step_copies_after_the_pass():
    built = examples.mlp(batch=32, dims=(64, 128, 10), optimizer="adam")
    graph = _unshared(built).graph
    assert sharing_groups(load(built.graph)) and not sharing_groups(graph)
    analysis = analyse(graph, list(built.fetches), [], DEFAULT_DEVICE)
    replay = Replay(analysis.eg, Placement(None, None), 64 << 20, analysis.views)
    assert first_update_copies(replay.eg, replay.sharing) == {}


def test_only_initializers_of_updated_float_variables_are_copied():
    g = tf.Graph()
    with g.as_default():
        counter = v1.get_variable("counter", initializer=tf.zeros([], tf.int64), use_resource=True)
        bias = v1.get_variable("bias", initializer=tf.zeros([16]), use_resource=True)
        frozen = v1.get_variable("frozen", initializer=tf.zeros([16]), use_resource=True)
        reset = v1.get_variable("reset", initializer=tf.ones([16]), use_resource=True)
        tf.group(counter.assign_add(1), bias.assign_add(frozen.read_value()),
                 reset.assign(tf.zeros([16])), reset.assign_sub(tf.ones([16])), name="step")
    result = UnshareInitialValues().run(load(g), PassContext(("step",)))
    # counter is an integer; frozen is never updated in place; reset's step-time assign is not an initializer
    assert result.report.details["copied"] == ["bias", "reset"]
    assigns = [n for n in result.graph.nodes if n.op == "AssignVariableOp"]
    copied = {n.name for n in assigns if result.graph[n.inputs[1].node].op == "DeepCopy"}
    assert copied == {"bias/Assign", "reset/Assign"}


def test_graphs_without_constant_initializers_are_left_alone():
    built = examples.mlp(batch=8, dims=(16, 8), optimizer="sgd")   # glorot weights; the bias starts at zeros
    g = tf.Graph()
    with g.as_default():
        w = v1.get_variable("w", (4, 4), initializer=v1.glorot_uniform_initializer(seed=1), use_resource=True)
        tf.group(w.assign_add(tf.ones([4, 4])), name="step")
    assert not UnshareInitialValues().run(load(g), PassContext(("step",))).changed
    assert _unshared(built).report.details["copied"] == ["dense0/b"]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hidden=st.lists(st.integers(4, 48), min_size=1, max_size=3),
       optimizer=st.sampled_from(["adam", "momentum", "sgd"]))
def test_random_mlps_train_to_the_same_values(hidden, optimizer):
    built = examples.mlp(batch=8, dims=(12, *hidden, 5), optimizer=optimizer)
    before = _train(built.graph.as_graph_def(), built, steps=2)
    after = _train(_unshared(built).graph.to_graph_def(), built, steps=2)
    assert not any(after[1])
    for name, value in before[2].items():
        assert np.array_equal(value, after[2][name]), name
