"""The budget search (tfmem.search): its rule across candidates and targets, and the same plan under any load."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from tfmem.search import Candidate, Search

MiB = 2**20


def candidate(label: str, target: int, peak: int, step_s: float) -> Candidate:
    profile = SimpleNamespace(peak_bytes=peak, estimated_step_s=step_s)
    return Candidate(label, target, None, (), profile, None)  # type: ignore[arg-type]


@dataclass
class ScriptedSearch(Search):
    """A search whose attempts at each target are given by ``attempts(target)``: the rule alone is under test."""

    attempts: object = None
    tried: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prefix, self.planner, self.suffix = [], None, []

    def plan_at(self, target_bytes):
        self.tried.append(target_bytes)
        return self.attempts(target_bytes)


def scripted(attempts, fits_layout=None, step=0):
    search = ScriptedSearch(None, [], None, None, attempts=attempts)
    search.fits_layout = fits_layout
    search.layout_step = lambda c: (step, "")
    return search


def test_the_quickest_candidate_the_layout_takes_is_accepted():
    """Candidates within the target are replayed on the layout quickest first; one that misses never is."""
    quick_but_refused = candidate("quick", 60 * MiB, 50 * MiB, 1.0)
    slow = candidate("slow", 60 * MiB, 55 * MiB, 2.0)
    quickest_misses = candidate("misses", 60 * MiB, 70 * MiB, 0.5)
    replayed = []

    def fits_layout(c):
        replayed.append(c.label)
        return c is not quick_but_refused

    search = scripted(lambda t: [quickest_misses, slow, quick_but_refused], fits_layout)
    chosen, accepted = search.run(60 * MiB, 60 * MiB)
    assert accepted and chosen is slow and replayed == ["quick", "slow"] and search.tried == [60 * MiB]
    outcomes = [a.outcome for a in search.log.attempts]
    assert outcomes == ["refused by the allocator layout", "fits"]


def test_a_plan_that_misses_in_total_is_refused_without_planning_again():
    search = scripted(lambda t: [candidate("solve", t, 70 * MiB, 1.0)], lambda c: True)
    chosen, accepted = search.run(60 * MiB, 60 * MiB)
    assert not accepted and chosen.label == "solve" and search.tried == [60 * MiB]


def test_after_a_layout_refusal_targets_in_between_are_tried():
    """A plan for 60 MiB failed the layout replay and one for 42 MiB (60 less what the layout needed) fit: bisect
    between them (here plans fit the layout up to 52 MiB, and a plan for more is quicker), not only halfway once."""
    search = scripted(lambda t: [candidate("solve", t, t, 1.0 / t)], lambda c: c.target_bytes <= 52 * MiB,
                      step=18 * MiB)
    chosen, accepted = search.run(60 * MiB, 60 * MiB)
    assert search.tried == [60 * MiB, 42 * MiB, 51 * MiB, int(55.5 * MiB), int(53.25 * MiB)]
    assert accepted and chosen.target_bytes == 51 * MiB
    assert search.log.replans == 4 and any("planned again for 42.00 MiB" in n for n in search.notes)


def test_replans_after_layout_refusals_are_bounded_by_a_count():
    from tfmem.search import CAPACITY_RETRIES

    search = scripted(lambda t: [candidate("solve", t, t, 1.0)], lambda c: False, step=MiB)
    chosen, accepted = search.run(60 * MiB, 60 * MiB)
    assert not accepted and len(search.tried) == CAPACITY_RETRIES + 1


# One optimize call, printing a digest of the GraphDef it returns: run in fresh interpreters so Python's string
# hashing (PYTHONHASHSEED) differs between the two runs, as it does between two users' runs.
PLAN_DIGEST = textwrap.dedent("""
    import hashlib, os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tfmem
    from tfmem import examples
    built = examples.mlp(batch=1024, dims=(512, 2048, 2048, 2048, 10), optimizer="momentum")
    peak = tfmem.simulate(built.graph, built.fetches, device="/CPU:0").peak_bytes
    opt = tfmem.optimize(built.graph, built.fetches, budget=int(peak * 0.55), device="/CPU:0", host="/CPU:1",
                         inter_op_threads=2)
    assert opt.report.search.solver_calls >= 1 and len(opt.report.search.attempts) > 2
    print(hashlib.sha256(opt.graph_def.SerializeToString(deterministic=True)).hexdigest())
""")

BUSY = "import time\nend = time.time() + 600\nwhile time.time() < end:\n    pass\n"


def _digest(seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", PLAN_DIGEST], env=env, capture_output=True, text=True, timeout=600,
                         check=True)
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_same_graph_and_budget_give_the_same_graph_def_under_cpu_load():
    """Byte-identical plans from two runs: one on a quiet machine, one with every core kept busy by other
    processes (a time limit anywhere in the search would let the second run stop earlier and plan otherwise)."""
    quiet = _digest("1")
    burners = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(os.cpu_count() or 2)]
    try:
        loaded = _digest("2")
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert len(quiet) == len(hashlib.sha256().hexdigest())
    assert quiet == loaded
