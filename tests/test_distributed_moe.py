"""Tests of models.distributed_moe: experts live on their owners, the sparse dispatch makes no tokens x slots
tensor, and the two dispatches, and the placed and unplaced graphs, compute bit-identical steps."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from models import distributed_moe
from models.moe_transformer import expert_capacity
from tfmem.errors import BadInputError
from tfmem.examples import Built
from tfmem.testbed import Testbed, initializer_names
from tfmem.testbed.graph import device_name

SMALL: dict[str, Any] = {"machines": 2, "experts": 4, "layers": 2, "d_model": 16, "d_ff": 32, "heads": 2,
                         "seq": 12, "batch": 4, "vocab": 16}   # 24 tokens a group: no other size is 24


def local_steps(built: Built, steps: int = 3) -> tuple[list[float], dict[str, np.ndarray]]:
    """Losses of ``steps`` training steps in a local session, and every variable afterwards."""
    with built.graph.as_default(), tf.compat.v1.Session(graph=built.graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        losses = [sess.run(built.fetches, built.feeds)[0] for _ in range(steps)]
        values = {v.op.name: sess.run(v) for v in tf.compat.v1.global_variables()}
    return losses, values


def test_experts_and_their_slots_live_on_their_owner() -> None:
    assert [distributed_moe.machine_device(m) for m in range(3)] == [device_name(m) for m in range(3)]
    built = distributed_moe.build(**SMALL)
    variables = [op for op in built.graph.get_operations() if op.type == "VarHandleOp"]
    experts = [op for op in variables if "/expert" in op.name]
    assert len(experts) >= 2 * 4 * 4 * 3    # 2 layers x 4 experts x (w, b) x 2 + Adam's two slots each
    for op in experts:
        e = int(op.name.split("/expert")[1].split("/")[0])
        assert op.device == device_name(distributed_moe.expert_owner(e, 4, 2)), (op.name, op.device)
    others = [op for op in variables if op not in experts]
    assert others and all(op.device == device_name(0) for op in others), [(o.name, o.device) for o in others]


def _tensor_shapes(built: Built) -> set[tuple[int, ...]]:
    return {tuple(t.shape.as_list()) for op in built.graph.get_operations() for t in op.outputs
            if t.shape.rank is not None and None not in t.shape.as_list()}


def test_the_sparse_dispatch_makes_no_tokens_by_slots_tensor() -> None:
    tokens = SMALL["batch"] // SMALL["machines"] * SMALL["seq"]
    capacity = expert_capacity(tokens, SMALL["experts"], 2, 1.25)
    slots = SMALL["experts"] * capacity
    dense = _tensor_shapes(distributed_moe.build(**SMALL, dispatch="dense"))
    sparse = _tensor_shapes(distributed_moe.build(**SMALL, dispatch="sparse"))
    assert (slots, tokens) in dense                 # the selection matrix: what the sparse one avoids
    assert not any(slots in s and tokens in s for s in sparse), sorted(s for s in sparse if slots in s)


@pytest.mark.slow
def test_dense_and_sparse_dispatch_train_identically() -> None:
    unplaced = [None] * SMALL["machines"]
    dense = local_steps(distributed_moe.build(**SMALL, dispatch="dense", devices=unplaced))
    sparse = local_steps(distributed_moe.build(**SMALL, dispatch="sparse", devices=unplaced))
    assert np.array(dense[0]).tobytes() == np.array(sparse[0]).tobytes(), (dense[0], sparse[0])
    assert dense[0][-1] < dense[0][0]   # it learns
    assert dense[1].keys() == sparse[1].keys()
    for name, value in dense[1].items():
        assert value.tobytes() == sparse[1][name].tobytes(), name


@pytest.mark.testbed
@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["dense", "sparse"])
def test_placed_on_two_machines_computes_what_one_device_does(dispatch: str) -> None:
    placed = distributed_moe.build(**SMALL, dispatch=dispatch)
    alone = distributed_moe.build(**SMALL, dispatch=dispatch, devices=[None, None])
    with Testbed("64MiB", machines=2) as tb:
        r_placed = tb.run(placed.graph, placed.fetches, placed.feeds, steps=2)
        r_alone = tb.run(alone.graph, alone.fetches, alone.feeds, steps=2)
    assert r_placed.ran and r_alone.ran
    assert r_placed.outputs["loss:0"].tobytes() == r_alone.outputs["loss:0"].tobytes()
    # spread: each device holds its own experts; alone: machine 1's device holds nothing
    assert min(r_placed.device_peaks.values()) > 0.2 * max(r_placed.device_peaks.values()), r_placed.device_peaks
    assert r_alone.device_peaks[tb.devices[1]] < 0.05 * r_alone.device_peaks[tb.devices[0]], r_alone.device_peaks
    assert initializer_names(placed.graph.as_graph_def())


@pytest.mark.parametrize("kwargs, message", [
    ({"machines": 3, "experts": 4}, "machines .3. must divide batch .8. and experts .4."),
    ({"dispatch": "scatter"}, "dispatch must be one of"),
    ({"machines": 2, "devices": ["/cpu:0"]}, "devices has 1 entries for 2 machines"),
    ({"top_k": 3}, "top_k must be 1 or 2"),
])
def test_bad_arguments_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(BadInputError, match=message):
        distributed_moe.build(**kwargs)
