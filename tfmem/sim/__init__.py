"""The simulator layer: replay a step as TensorFlow's executor would, and score it.

``memsim.py`` is the entry point (``tfmem.simulate``); around it: executor emulation (``schedule.py``,
``executor_folding.py``), the kernels' memory (``opmemory.py``), the BFC allocator model (``bfc.py``), lower
bounds (``bounds.py``), the step-time cost model (``costmodel.py``) and TensorFlow's own Grappler
(``grappler.py``). Layer: imports ``tfmem.ir`` and the base modules only (``tests/test_layers.py``).
"""
