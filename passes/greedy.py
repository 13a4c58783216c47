"""The greedy descent that ``swap_activations`` and ``recompute`` share: move a batch of candidates, re-simulate,
keep the move only if the peak falls, until the target is met or no candidate lowers the peak.

Each sweep tries every candidate once, best first; when a sweep has kept a move, the next sweep tries them all
again (the graph, and with it the peak, has changed). So unless its count of simulations runs out first, the
descent stops at a fixed point, a sweep that keeps nothing: run again on its own output, it finds the same
candidates, none of which lowers the peak, and changes nothing (tests/test_pass_contract.py).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol, TypeVar

from tfmem.ir.graph import GraphIR
from tfmem.sim.profile import MemoryProfile


class Candidate(Protocol):
    @property
    def tensor(self) -> Hashable: ...

    @property
    def nbytes(self) -> int: ...


C = TypeVar("C", bound=Candidate)


def descend(graph: GraphIR, profile: MemoryProfile, target_bytes: int,
            pick: Callable[[GraphIR, MemoryProfile, int, set[Hashable]], Sequence[C]],
            apply: Callable[[GraphIR, Sequence[C]], GraphIR], simulate: Callable[[GraphIR], MemoryProfile],
            max_simulations: int) -> tuple[GraphIR, MemoryProfile, list[C]]:
    """Lower ``graph``'s simulated peak towards ``target_bytes``; returns the graph, its profile and the moves kept.

    ``pick(graph, profile, excess, tried)`` chooses the next batch among candidates not in ``tried``; each batch
    costs one simulation, at most ``max_simulations`` in all (a count, so the result is the same on any machine).
    """
    kept: list[C] = []
    tried: set[Hashable] = set()
    kept_since_sweep = False   # whether this sweep over the candidates has kept a move
    for _ in range(max_simulations):
        batch = pick(graph, profile, profile.peak_bytes - target_bytes, tried)
        if not batch:
            if not kept_since_sweep:
                break   # a whole sweep kept nothing: a fixed point
            # Every candidate was tried once; the graph has changed since some were, so sweep again.
            tried.clear()
            kept_since_sweep = False
            continue
        tried.update(c.tensor for c in batch)
        trial = apply(graph, batch)
        trial_profile = simulate(trial)
        if trial_profile.peak_bytes >= profile.peak_bytes:
            continue  # this batch does not lower the peak: keep the graph as it was, try others
        graph, profile = trial, trial_profile
        kept.extend(batch)
        kept_since_sweep = True
        if profile.peak_bytes <= target_bytes:
            break
    return graph, profile, kept


def take_batch(candidates: Sequence[C], excess: int, overshoot: float) -> list[C]:
    """The first of ``candidates`` (best first) whose bytes together cover ``overshoot`` times ``excess``: the peak
    moves as tensors leave, so a batch frees somewhat more than the excess it was picked for."""
    batch: list[C] = []
    covered = 0
    for c in candidates:
        if covered >= excess * overshoot:
            break
        batch.append(c)
        covered += c.nbytes
    return batch
