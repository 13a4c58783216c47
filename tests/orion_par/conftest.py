"""Fixtures shared by the Ray test modules of orion_par."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_session(request):
    """Ray for one test module: ``RAY_CPUS`` CPUs (the module's, default 2), shut down after the module if it
    started it.  The module's functions travel by value: Ray workers cannot import test modules."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install ray==2.60.0)")
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(num_cpus=getattr(request.module, "RAY_CPUS", 2), include_dashboard=False, log_to_driver=False)
        except Exception as e:
            pytest.skip(f"ray cannot start here: {e}")
    ray.cloudpickle.register_pickle_by_value(request.module)
    yield ray
    if started:
        ray.shutdown()
