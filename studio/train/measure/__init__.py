"""Memory, measured and predicted by running the worker's own step.

* ``memtrack``: the peak of live tensor bytes of a real (or fake) step, and CUDA's own statistics;
* ``metrics``: memory readings per device for step events, and the run header's versions and devices;
* ``simulate``: the worker's step on fake tensors (``studio estimate --simulate``);
* ``trace``: the traced step of a model no family describes, for ``studio.core.memory.derived``;
* ``oom``: when memory runs out: which part overflowed, what is kept, the cheapest fix.
"""
