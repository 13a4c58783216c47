"""orion_par: parallelise serial ML loops over keyed data with one decorator (after Orion, EuroSys'19).

>>> import numpy as np
>>> from orion_par import DistArray, parallel_for
>>> W = DistArray(np.zeros((3, 2)))
>>> data = DistArray.from_coo([[0, 1], [2, 0]], [1.0, 2.0])
>>> @parallel_for(data)
... def body(key, value):
...     u, i = key
...     W[u, i] += value
>>> str(body.plan.scheme)                                   # doctest: +SKIP
'1d'
"""

from orion_par.distarray import Buffer, DistArray
from orion_par.errors import (
    BadBodyError,
    CompileFallbackWarning,
    DataOrderError,
    NotParallelizableError,
    OrionParError,
)
from orion_par.parallel_for import ParallelFor, RunStats, parallel_for
from orion_par.plan import Plan
from orion_par.scheme import ParallelScheme

__all__ = [
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
]
