"""The pass protocol and the pipeline that runs passes in order, one report each, verifying between them.

A pass is a frozen dataclass with a ``name`` and ``run(graph, ctx) -> PassResult``: a pure function of the
graph. "Nothing to do" is ``changed=False``, not an exception. The pipeline wraps unexpected failures in
``PassError`` naming the pass and those before it; ``TfmemError``s (e.g. an infeasible budget) pass through.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from tensorflow.core.protobuf import config_pb2

from tfmem.errors import PassError, TfmemError
from tfmem.ir.graph import GraphIR
from tfmem.ir.verify import verify
from tfmem.sim.profile import MemoryProfile


@dataclass(frozen=True)
class PassReport:
    """What one pass did: counts, bytes, and free-form notes people can read."""

    name: str
    changed: bool = False
    nodes_added: int = 0
    nodes_removed: int = 0
    control_edges_added: int = 0
    bytes_moved: int = 0
    notes: tuple[str, ...] = ()
    details: dict[str, object] = field(default_factory=dict)

    @classmethod
    def empty(cls, name: str, note: str = "nothing to do") -> PassReport:
        return cls(name, notes=(note,))


@dataclass(frozen=True)
class PassResult:
    graph: GraphIR
    changed: bool
    report: PassReport


@dataclass(frozen=True)
class PassContext:
    """What every pass shares: the target peak, devices, fetches, feeds and the simulator to score graphs with."""

    fetches: tuple[str, ...]
    # The simulated device peak a plan aims for: the user's budget_bytes less optimize's safety margin, or lower
    # on a replan (tfmem.optimizer); None when there is no budget.
    target_bytes: int | None = None
    device: str | None = None
    host: str | None = None
    feed_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    simulator: Callable[..., MemoryProfile] | None = None
    check: bool = True
    seed: int = 0
    inter_op_threads: int | None = None   # the session's inter-op pool; None = TF's default (one per core)
    grappler: bool = True                 # simulate after Grappler's rewrites (what the session really runs)
    session_config: config_pb2.ConfigProto | None = None  # the config the session runs with (None: TF's default)

    @property
    def threads(self) -> int:
        """Inter-op threads the session will use (TF's default is the number of cores)."""
        return self.inter_op_threads or os.cpu_count() or 1

    def simulate(self, graph: GraphIR, **kwargs: Any) -> MemoryProfile:
        """Simulate ``graph`` for this context's fetches, devices and feeds."""
        from tfmem.sim.memsim import simulate

        sim = self.simulator or simulate
        kwargs.setdefault("inter_op_threads", self.threads)
        kwargs.setdefault("grappler", self.grappler)
        if self.session_config is not None:
            kwargs.setdefault("config", self.session_config)
        return sim(graph, list(self.fetches), feed_shapes=self.feed_shapes or None, device=self.device,
                   host=self.host, **kwargs)


class Pass(Protocol):
    """A graph rewrite. ``budget_independent`` passes do the same whatever ``ctx.target_bytes`` is: ``optimize``
    runs them once, before any planning."""

    name: ClassVar[str]
    budget_independent: ClassVar[bool]
    peak_non_increasing: ClassVar[bool]
    """True when the output never simulates (``ctx.simulate``) a higher device peak than the input graph."""

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult: ...


def run_pipeline(graph: GraphIR, passes: Sequence[Pass], ctx: PassContext) -> tuple[GraphIR, list[PassReport]]:
    """Run ``passes`` in order; ``verify`` the graph after each when ``ctx.check``."""
    reports = []
    for i, p in enumerate(passes):
        try:
            result = p.run(graph, ctx)
        except TfmemError:
            raise
        except Exception as e:
            raise PassError(p.name, after=[q.name for q in passes[:i]], detail=f"{type(e).__name__}: {e}") from e
        if ctx.check and result.changed:
            verify(result.graph)
        graph = result.graph
        reports.append(result.report)
    return graph, reports
