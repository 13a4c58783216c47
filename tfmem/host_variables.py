"""``tfmem.on_host``: create TF2 variables in host memory, so that a plan brings them to the device only while used.

A TF2 variable lives where it was created and no plan can move it afterwards. Weights that idle most of a step
(a mixture of experts' experts, a large embedding) are better created on the host: each step then reads them
there, and ``tfmem.function`` / ``tfmem.keras.MemoryBudget`` time each read's copy to the device just before
its use (``passes.place_persistent``), instead of TensorFlow copying every one as the step starts. Keras
creates an optimizer's slots beside their variable, so the slots of host weights live on the host too, and
their updates run there.

    with tfmem.on_host("/CPU:0"):
        experts = MyExperts(64)(hidden)        # Keras creates the layer's variables as it is called
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import tensorflow as tf

from tfmem.errors import BadInputError


@contextlib.contextmanager
def on_host(host: str | None = None) -> Iterator[str]:
    """Create the variables made inside on ``host`` (default: this process's first CPU); yields its full name.

    Give a plan the same ``host`` (``tfmem.function(..., host=)``, ``MemoryBudget(..., host=)``): the variables
    on it are read there and prefetched to the device per use. Outside eager execution (inside a
    ``tf.function`` being traced) variables are made once, by the first trace: enter the scope where the
    model is built.
    """
    if not tf.executing_eagerly():
        raise BadInputError("tfmem.on_host creates variables in eager mode: enter it where the model is built, "
                            "outside any tf.function")
    name = host or "/job:localhost/replica:0/task:0/device:CPU:0"
    from tfmem.planned_function import check_exists

    check_exists(name, "host")
    with tf.device(name):
        yield name
