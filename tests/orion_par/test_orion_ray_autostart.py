"""backend="ray" starts a local Ray when none runs, and shuts down what it started."""

from __future__ import annotations

import os

import numpy as np
import pytest

from orion_par import DistArray, parallel_for

ray = pytest.importorskip("ray", reason="ray is not installed (pip install ray==2.60.0)")


def _ray_daemons() -> set[int]:
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")[0]
        except OSError:
            continue
        if cmd.endswith((b"raylet", b"gcs_server")):
            pids.add(int(pid))
    return pids


def test_ray_backend_starts_and_stops_its_own_ray():
    if ray.is_initialized():
        pytest.skip("a Ray session is already running in this process")
    before = _ray_daemons()
    data = DistArray.from_coo(np.arange(200) % 17, np.ones(200))
    out = DistArray(np.zeros(17))

    @parallel_for(data)
    def body(key, value):
        out[key[0]] += value

    stats = body.run(workers=2, backend="ray")
    assert stats.backend == "ray" and stats.compiled
    assert np.array_equal(out, np.bincount(np.arange(200) % 17).astype(float))
    assert not ray.is_initialized()
    assert _ray_daemons() <= before  # nothing of ours left running
