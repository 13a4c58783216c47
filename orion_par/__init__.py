"""orion_par: parallelise serial ML loops over keyed data with one decorator (after Orion, EuroSys'19).

>>> import numpy as np
>>> from orion_par import DistArray, parallel_for
>>> W = DistArray(np.ones((3, 2)))
>>> H = DistArray(np.ones((4, 2)))
>>> ratings = DistArray.from_coo([[0, 1], [2, 0], [1, 3]], [1.0, 2.0, 0.5])
>>> @parallel_for(ratings)
... def sgd(key, value):
...     u, i = key
...     err = value - (W[u, 0] * H[i, 0] + W[u, 1] * H[i, 1])
...     for r in range(2):
...         w = W[u, r]
...         W[u, r] += 0.1 * err * H[i, r]
...         H[i, r] += 0.1 * err * w
>>> str(sgd.plan.scheme)
'2d'
>>> stats = sgd.run(workers=2, epochs=50)
>>> round(float(W[2] @ H[0]), 2)
2.0
"""

from orion_par.distarray import Accumulator, Buffer, DistArray
from orion_par.errors import (
    BadBodyError,
    CompileFallbackWarning,
    DataOrderError,
    NotParallelizableError,
    OrionParError,
)
from orion_par.parallel_for import ParallelFor, RunStats, parallel_for
from orion_par.plan import Plan
from orion_par.purity import pure
from orion_par.scheme import ParallelScheme

__all__ = [
    "Accumulator",
    "BadBodyError",
    "Buffer",
    "CompileFallbackWarning",
    "DataOrderError",
    "DistArray",
    "NotParallelizableError",
    "OrionParError",
    "ParallelFor",
    "ParallelScheme",
    "Plan",
    "RunStats",
    "parallel_for",
    "pure",
]
