"""tfmem.function: TF2 steps planned on their traced graph, run on the same variables (issue 33)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from passes import LEADING_REWRITES
from tfmem.pipeline import PassContext, run_pipeline
from tfmem.placement_check import call_collecting, misplaced
from tfmem.sim.grappler import runtime_nodes
from tfmem.traced import rebuild, trace

ROOT = Path(__file__).resolve().parents[1]


def _case(name: str, *args: float) -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.tf2_cases", name, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_keras_step_planned_under_its_peak_keeps_every_value() -> None:
    r = _case("keras_step", 0.75)
    assert r["after"] <= r["budget"] < r["before"]   # the plan had work to do, and did it
    assert r["swapped"] > 0                          # activations went to the host device
    (checked, wrong), = r["placement"]               # and ran there: every placed op did, at the first call
    assert checked > r["swapped"] and wrong == 0
    assert r["same_outputs"] and r["same_state"]     # loss, a gradient, weights and Adam's slots, bit for bit
    # a partial batch runs the original step, with one warning that says how to plan it
    assert r["partial_same"]
    assert len(r["warnings"]) == 1 and ".plan(" in r["warnings"][0]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_experts_created_on_the_host_visit_the_device_per_use_and_train_identically() -> None:
    r = _case("moe_fit", 0.7)
    assert r["experts_on_host"] == [True]            # tfmem.on_host created them there (and Adam's slots)
    assert r["after"] <= r["budget"] < r["before"]
    assert r["prefetched_experts"] == r["experts"] == 16   # each read comes to the device by a timed prefetch
    assert r["update_on_host"] == [True]             # and Adam updates them on the host
    assert r["same_history"] and r["same_state"]     # losses, weights and Adam's slots, bit for bit


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_recurrent_step_swaps_the_lists_one_loop_hands_to_another_and_trains_identically() -> None:
    r = _case("lstm_fit", 0.85)
    assert r["after"] <= r["budget"] < r["before"]
    # the first layer's activations, kept in lists from its forward loop to its gradient loop, went to the host
    assert any("lstm" in t and "/while/exit/" in t for t in r["swapped"]), r["swapped"]
    (checked, wrong), = r["placement"]
    assert checked > 0 and wrong == 0
    assert r["same_history"] and r["same_state"]     # losses, weights and Adam's slots, bit for bit


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_attention_step_keeps_the_sums_the_runtime_folds_and_trains_identically() -> None:
    r = _case("attention_fit", 0.7)
    assert r["after"] <= r["budget"] < r["before"] and r["decisions"] > 0   # recomputations here
    # (before split_addn wrote the folded order in, this plan's weights differed in the last bits: measured)
    # each layer norm's broadcast add tree, written in the order the runtime folds it into (four layer norms)
    assert sum("layer_normalization" in s for s in r["sums"]) == 4, r["sums"]
    assert r["same_history"] and r["same_state"]     # losses, weights and Adam's slots, bit for bit


def _nested_step(v: tf.Variable):
    @tf.function
    def inner(x):
        return tf.nn.relu(tf.matmul(x, v))

    @tf.function
    def step(x, n):
        h = inner(x)
        h = tf.cond(tf.reduce_sum(h) > 0, lambda: h * 2.0, lambda: h - 1.0)
        total = tf.while_loop(lambda i, t: i < n, lambda i, t: (i + 1, t + tf.reduce_sum(h)), (0, 0.0))[1]
        v.assign_sub(0.01 * tf.matmul(x, h, transpose_a=True))
        return total

    return step


def test_nested_functions_and_control_flow_are_flattened_and_rebuilt_on_the_same_variable() -> None:
    rng = np.random.default_rng(1)
    init = rng.standard_normal((64, 64)).astype(np.float32)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    mine, theirs = tf.Variable(init), tf.Variable(init)
    step, reference = _nested_step(mine), _nested_step(theirs)
    traced = trace(step.get_concrete_function(x, tf.constant(3)))
    ops = {n.op for n in traced.graph_def.node}
    assert not ops & {"PartitionedCall", "StatefulPartitionedCall", "While", "StatelessWhile", "If", "StatelessIf"}
    assert {"Enter", "Merge", "Switch"} <= ops                     # v1 frames, which the IR handles
    rebuilt = rebuild(traced, traced.graph_def)
    for _ in range(2):
        got = rebuilt(tf.constant(x), tf.constant(3))[0]
        assert np.array_equal(got.numpy(), reference(x, tf.constant(3)).numpy())
    assert np.array_equal(mine.numpy(), theirs.numpy())           # the rebuilt step updated the user's variable


def test_a_plain_python_step_with_a_python_argument_is_planned_per_value() -> None:
    v = tf.Variable(tf.ones((128, 128)))

    def step(x, scale):
        v.assign(v * scale)
        return tf.reduce_sum(tf.matmul(x, v))

    planned = tfmem.function(step, budget="64MiB")
    x = tf.ones((128, 128))
    assert float(planned(x, 2.0)) == 128 * 128 * 128 * 2.0
    planned.plan(x, 0.5)
    assert len(planned.plans) == 2
    assert float(planned(x, 0.5)) == 128 * 128 * 128.0
    assert planned.report.after.peak_bytes <= 64 * 2**20


def test_an_xla_step_is_refused_with_the_fix() -> None:
    @tf.function(jit_compile=True)
    def step(x):
        return tf.reduce_sum(x * x)

    with pytest.raises(tfmem.BadInputError, match="jit_compile=False"):
        tfmem.function(step, budget="1GiB")(tf.ones((4,)))


def test_a_budget_below_the_steps_bound_is_refused_with_it() -> None:
    v = tf.Variable(tf.ones((1024, 1024)))

    @tf.function
    def step(x):
        return tf.reduce_sum(tf.matmul(x, v))

    with pytest.raises(tfmem.InfeasibleBudgetError) as caught:
        tfmem.function(step, budget="1MiB")(tf.ones((1024, 1024)))
    assert caught.value.lower_bound_bytes > 2**20


def test_arguments_the_step_does_not_take_are_a_clear_error() -> None:
    planned = tfmem.function(lambda x: x * 2.0, budget="1GiB")
    with pytest.raises(tfmem.BadInputError, match="argument"):
        planned(tf.ones(2), tf.ones(2))


def test_captured_variables_stay_where_they_were_created() -> None:
    """A TF2 variable cannot move: a budget only moving it would meet is refused (without the pin it is met)."""
    from tfmem.ir.tags import PINNED_TAG

    layers = [tf.Variable(tf.ones((1024, 1024)) / 1024, name=f"w{i}") for i in range(4)]   # 4 MiB each

    @tf.function
    def step(x):
        for w in layers:
            x = tf.matmul(x, w)
        return tf.reduce_sum(x)

    traced = trace(step.get_concrete_function(tf.TensorSpec((16, 1024), tf.float32)))
    device, host = "/job:localhost/replica:0/task:0/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:1"
    with pytest.raises(tfmem.InfeasibleBudgetError):
        tfmem.optimize(traced.graph_def, traced.fetches, budget="16MiB", device=device, host=host)
    unpinned = type(traced.graph_def)()
    unpinned.CopyFrom(traced.graph_def)
    for node in unpinned.node:
        node.attr.pop(PINNED_TAG, None)
    moved = tfmem.optimize(unpinned, traced.fetches, budget="16MiB", device=device, host=host)
    assert any(n.op == "VarHandleOp" and n.device == host for n in moved.graph_def.node)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_keras_fit_with_a_memory_budget_trains_as_plain_fit() -> None:
    r = _case("keras_fit", 38)
    assert r["after"] <= r["budget"] < r["before"]
    assert r["same_history"] and r["same_state"]     # losses, weights and Adam's slots, bit for bit
    assert r["plan_kept"]                            # a second fit() of the same model is not planned again
    # the partial last batch, once over two epochs, with a fix that works (tf_keras_fit below)
    assert len(r["unplanned_warnings"]) == 1 and "drop_remainder=True" in r["unplanned_warnings"][0]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("tf_keras", [0, 1], ids=["keras3", "tf_keras"])
def test_memory_budget_plans_evaluate_and_predict_when_asked_with_the_same_results(tf_keras: int) -> None:
    if tf_keras:
        pytest.importorskip("tf_keras", reason="make installs tf-keras (requirements-zoo.lock)")
    r = _case("keras_evaluate_predict", 38, tf_keras)
    assert r["planned_by_fit"] == ["test", "train"]   # fit's validation ran the planned test step
    assert r["planned"] == ["predict", "test", "train"]
    assert r["train_after"] <= r["budget"]
    # fit's validation (val_loss) and evaluate ran the planned test step, predict the planned predict step
    assert r["same_history"] and len(r["val_loss"]) == 2 and r["same_evaluate"] and r["same_predict"]
    assert r["same_state"]
    assert all(checked > 0 and wrong == 0 for kind in r["placement"].values() for checked, wrong in kind)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tf_keras_fit_with_a_memory_budget_plans_every_step_the_batch_size_divides() -> None:
    pytest.importorskip("tf_keras", reason="make installs tf-keras (requirements-zoo.lock)")
    r = _case("tf_keras_fit", 38)
    assert r["after"] <= r["budget"] < r["before"]
    assert r["same_history"] and r["same_state"]
    assert r["unplanned_warnings"] == []


@pytest.mark.slow
def test_a_testbed_connection_refuses_what_would_measure_wrong_with_the_fix() -> None:
    said = _case("testbed_refusals")
    assert "TF_ENABLE_ONEDNN_OPTS=0" in said["onednn"] and said["fixed"] == 8.0
    assert "process of its own" in said["second"]
    assert "another process for sessions" in said["session"]


@pytest.mark.slow
def test_a_connected_measurement_ends_promptly_in_an_out_of_memory_or_a_crash() -> None:
    oom, crash = _case("testbed_oom"), _case("testbed_crash")
    assert oom["oom"] and "out of memory" in oom["error"] and oom["seconds"] < 8   # TF's own retry takes 10 s
    assert "worker:0 server died" in crash["crash"] and crash["seconds"] < 30
    assert "new process" in oom["after"] and "new process" in crash["after"]   # the connection is over


def test_attention_gradients_get_their_shapes() -> None:
    import keras

    from tfmem.ir.shapes import annotate

    keras.utils.set_random_seed(0)
    tokens = keras.Input((16,), dtype="int32")
    h = keras.layers.Embedding(50, 8)(tokens)
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(h, h)
    model = keras.Model(tokens, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    step = tf.function(lambda data: model.train_step(data))
    traced = trace(step.get_concrete_function((tf.zeros((4, 16), tf.int32), tf.zeros((4,), tf.int32))))
    ir = annotate(traced.graph_def)
    # the einsum gradients' BroadcastGradientArgs read folded shapes: their outputs are sized, as is all else
    unknown = [f"{n.name}:{i}" for n in ir.nodes for i, s in enumerate(n.outputs) if s.nbytes is None]
    assert unknown == []


def test_a_misplaced_op_is_named_with_where_it_ran() -> None:
    v = tf.Variable(tf.ones((8,)))

    @tf.function
    def step(x):
        return tf.reduce_sum(v * x)

    concrete = step.get_concrete_function(tf.TensorSpec((8,), tf.float32))
    planned = concrete.graph.as_graph_def()   # as a plan that put the product on a device it did not run on
    devices = {"Mul": "/job:localhost/replica:0/task:0/device:CPU:7", "Sum": "/job:localhost/replica:0/task:0/device:CPU:0"}
    for node in planned.node:
        node.device = devices.get(node.op, node.device)
    result, metadata = call_collecting(lambda: concrete(tf.ones((8,))))
    checked, wrong = misplaced(planned, metadata)
    assert float(result) == 8.0 and checked == 2
    assert [(w.op, w.planned[-5:], w.ran_on[-5:]) for w in wrong] == [("mul", "CPU:7", "CPU:0")]


def test_keras_fit_refuses_several_steps_per_execution_with_the_fix() -> None:
    import keras

    import tfmem.keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    with pytest.raises(tfmem.BadInputError, match="steps_per_execution=1"):
        model.fit(np.ones((8, 4), np.float32), np.ones((8, 2), np.float32), verbose=0,
                  callbacks=[tfmem.keras.MemoryBudget("1GiB")])


def test_a_host_tensorflow_does_not_have_is_refused_with_the_devices_it_has() -> None:
    """Functions soft-place: copies to a missing host would silently stay on the device."""
    with pytest.raises(tfmem.BadInputError, match=r"host='/GPU:7'.*CPU:0"):
        tfmem.function(lambda x: x * 2.0, budget="1GiB", host="/GPU:7")
    assert tfmem.function(lambda x: x * 2.0, budget="1GiB", host="/CPU:0", device="/CPU:0") is not None


def test_numpy_scalars_are_arguments_and_python_scalars_are_part_of_the_signature() -> None:
    planned = tfmem.function(lambda x, s, k: tf.reduce_sum(x * s) + k, budget="1GiB")
    x = tf.ones(2)
    assert float(planned(x, np.float32(2.0), 1.0)) == 5.0
    assert float(planned(x, np.float32(3.0), 1.0)) == 7.0   # the same plan: s is a tensor argument
    assert len(planned.plans) == 1


def test_ops_on_a_variable_run_where_it_lives() -> None:
    """TensorFlow's placer puts a resource op with its resource: the traced graph says so, so that a variable in
    host memory is simulated as read and updated there."""
    v = tf.Variable(tf.ones((8, 8)))

    @tf.function
    def step(x):
        v.assign_add(x)
        return tf.reduce_sum(v.read_value() * x)

    traced = trace(step.get_concrete_function(tf.TensorSpec((8, 8), tf.float32)))
    (handle,) = traced.variables
    users = [n for n in traced.graph_def.node if any(i.split(":")[0] == handle for i in n.input)]
    assert {n.op for n in users} >= {"AssignAddVariableOp", "ReadVariableOp"}
    assert all(n.device == v.device for n in users)


def test_a_function_arguments_shape_is_known_to_grapplers_rewrite() -> None:
    # The TF2 runtime knows a function's argument shapes, so Grappler folds this tree of adds into one AddN (a
    # session's Grappler, not knowing a feed's shape, does not); the plan must reproduce the function's sum.
    rng = np.random.default_rng(3)
    ws = [tf.Variable(rng.standard_normal((64, 64)).astype(np.float32)) for _ in range(8)]

    @tf.function
    def step(x):
        out = None
        for w in ws:
            y = tf.tanh(tf.matmul(x, w))
            out = y if out is None else out + y
        return out * 1.5

    traced = trace(step.get_concrete_function(tf.TensorSpec((32, 64), tf.float32)))
    ir = tfmem.load(traced.graph_def)
    assert any("AddOpsRewrite" in n.name for n in runtime_nodes(ir, traced.fetches))
    planned = run_pipeline(ir, LEADING_REWRITES, PassContext(tuple(traced.fetches)))[0]
    rebuilt = rebuild(traced, planned.to_graph_def())
    x = tf.constant(rng.standard_normal((32, 64)).astype(np.float32))
    assert np.array_equal(rebuilt(x)[0].numpy(), step(x).numpy())


def test_on_host_creates_variables_on_a_host_that_exists_and_only_eagerly() -> None:
    from tfmem.errors import BadInputError
    from tfmem.ir.devices import same_device

    with tfmem.on_host() as host:
        v = tf.Variable(tf.zeros((4,)))
    assert same_device(v.device, host)
    with pytest.raises(BadInputError, match="not a device TensorFlow has here"):
        with tfmem.on_host("/device:GPU:7"):
            pass

    @tf.function
    def builds_inside():
        with tfmem.on_host():
            return tf.constant(1.0)

    with pytest.raises(Exception, match="outside any tf.function"):   # autograph wraps it in a StagingError
        builds_inside()
