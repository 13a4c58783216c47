"""Real execution on an emulated accelerator: a memory-capped TensorFlow server plus an uncapped host server.

``Testbed`` (``runner.py``) starts the two servers (``proc.py`` runs each ``server.py`` child) and runs a graph
placed with ``graph.py``'s helpers, or joins this process's eager runtime to them (``eager.py``, for TF2); every
out-of-memory it reports is TensorFlow's own. Layer: imports only ``tfmem.ir`` and the base modules
(``tests/test_layers.py``).
"""

from tfmem.testbed.eager import Connected, run_keras_steps_on
from tfmem.testbed.graph import DEVICE, HOST, initializer_names, place_on_device
from tfmem.testbed.runner import RunResult, Testbed

__all__ = ["DEVICE", "HOST", "Connected", "RunResult", "Testbed", "initializer_names", "place_on_device",
           "run_keras_steps_on"]
