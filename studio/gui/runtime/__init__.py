"""The training runtime from the window (``studio.core.runtime``).

* ``dialog``: what the runtime is, what it will be on this machine, and the button that makes it;
* ``setup``: making, resuming, repairing, updating or checking it, step by step in QProcesses;
* ``self_test``: the GPU self-test (``studio doctor``) in a subprocess, and what it found per technique.
"""
