"""Elastic runs: resize a running ``parallel_for`` or parameter-server job on Ray, and replace stragglers.

See ``policy`` for windows, policies and the log; ``orion_par.elastic.loop`` runs ``parallel_for`` on
Ray elastically (``run(..., backend="ray", elastic=Elastic(...))``); ``RayPS.run(..., elastic=...)``
resizes the parameter server at clock boundaries.
"""

from orion_par.elastic.emulate import Emulation
from orion_par.elastic.policy import (
    Controller,
    Decision,
    Elastic,
    ElasticError,
    ElasticLog,
    Event,
    FixedSchedule,
    Policy,
    ScalingEfficiency,
    Stragglers,
    UtilityCost,
    Window,
)

__all__ = [
    "Controller",
    "Decision",
    "Elastic",
    "ElasticError",
    "ElasticLog",
    "Emulation",
    "Event",
    "FixedSchedule",
    "Policy",
    "ScalingEfficiency",
    "Stragglers",
    "UtilityCost",
    "Window",
]
