"""Did a planned TF2 step run where it was planned? Checked once, at its first call.

A function's ops are soft-placed: an op whose planned device cannot run it (no kernel there, a device the
process lacks) runs elsewhere without a word, and a swap that stays on the device frees nothing. The first call
of each plan is run with TensorFlow's graph collection on (``context.enable_graph_collection``), which hands
back each function's graph after placement and Grappler; every op the plan gave a device is compared with the
device it got (tests/test_function.py::test_a_misplaced_op_is_named_with_where_it_ran).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context

from tfmem.ir.devices import same_device


@dataclass(frozen=True)
class Misplaced:
    """An op that ran on ``ran_on`` where the plan put it on ``planned``."""

    op: str
    planned: str
    ran_on: str


def call_collecting(call: Callable[[], Any]) -> tuple[Any, config_pb2.RunMetadata]:
    """``call()``'s result and the run metadata of the functions it ran (their placed, optimised graphs)."""
    ctx = context.context()
    context.enable_graph_collection()
    ctx.enable_run_metadata()
    try:
        result = call()
        context.async_wait()
        return result, context.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
        context.disable_graph_collection()


def misplaced(planned: graph_pb2.GraphDef, metadata: config_pb2.RunMetadata) -> tuple[int, list[Misplaced]]:
    """How many of ``planned``'s placed ops ran (and were checked), and those that ran elsewhere.

    An op Grappler removed or renamed is not checked (the plan's own ops carry ``_grappler_do_not_remove``).
    """
    wanted = {n.name: n.device for n in planned.node if n.device}
    ran: dict[str, str] = {}
    for function in metadata.function_graphs:   # the planned one: the graph with most of its names
        here = {n.name: n.device for n in function.post_optimization_graph.node if n.name in wanted and n.device}
        if len(here) > len(ran):
            ran = here
    wrong = [Misplaced(name, wanted[name], device) for name, device in sorted(ran.items())
             if not same_device(wanted[name], device)]
    return len(ran), wrong
