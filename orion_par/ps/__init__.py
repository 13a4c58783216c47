"""orion_par.ps: a Bösen-like parameter server with bounded staleness and managed communication.

Tables of dense or sparse rows; each worker ``get``s rows, ``inc``s them and calls ``clock()`` at the end of
every clock.  Stale Synchronous Parallel: with staleness ``s`` a worker at clock ``c`` reads values that
include every update made before clock ``c - s`` (``s=0`` is BSP, ``s=None`` is ASP); see
``orion_par.ps.param_server`` for the exact invariant.  Managed communication spends a bandwidth budget
between clocks on the rows that matter most (``policy="magnitude"``, ``"absolute"`` or ``"consumption"``;
``"random"`` is the unprioritised baseline; rows not yet sent in the clock before resends, and the
clock-boundary flush in the same order, in pieces).  The same logic runs on two transports: ``LocalPS`` (threads in this process,
the default) and ``RayPS`` (actors).

>>> import numpy as np
>>> from orion_par.ps import LocalPS, TableSpec
>>> ps = LocalPS([TableSpec("counts", num_rows=3, width=2, staleness=1)], num_workers=2)
>>> def program(client, worker, clock):
...     client.inc("counts", [worker], np.ones((1, 2)))
>>> stats = ps.run(program, clocks=4).stats
>>> ps.table("counts").tolist()
[[4.0, 4.0], [4.0, 4.0], [0.0, 0.0]]
>>> stats[0].bytes_sent > 0
True
"""

from orion_par.ps.bandwidth import TokenBucket
from orion_par.ps.client import ClientOptions, PSClient
from orion_par.ps.local import Checkpoint, LocalPS, RunResult
from orion_par.ps.param_server import BoundedStalenessServer, ClockTable, ssp_admits
from orion_par.ps.stats import WorkerStats
from orion_par.ps.tables import BadTableError, PSError, RolledBack, TableSpec

__all__ = [
    "BadTableError",
    "BoundedStalenessServer",
    "Checkpoint",
    "ClientOptions",
    "ClockTable",
    "LocalPS",
    "PSClient",
    "PSError",
    "RolledBack",
    "RunResult",
    "TableSpec",
    "TokenBucket",
    "WorkerStats",
    "make_ps",
    "ssp_admits",
]


def make_ps(tables: object, num_workers: int, *, transport: str = "local", **kwargs: object) -> object:
    """A ``LocalPS`` (``transport="local"``) or ``RayPS`` (``transport="ray"``) with the same arguments."""
    if transport == "local":
        return LocalPS(tables, num_workers, **kwargs)  # type: ignore[arg-type]
    if transport == "ray":
        from orion_par.ps.ray_transport import RayPS

        return RayPS(tables, num_workers, **kwargs)  # type: ignore[arg-type]
    raise PSError(f"make_ps(transport={transport!r}): use 'local' or 'ray'.")
