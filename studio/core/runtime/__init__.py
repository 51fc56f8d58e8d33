"""The desktop download's training runtime (docs/packaging.md): a Python environment of its own.

* ``environment``: which PyTorch build fits the machine, the pinned requirements and their hash, the uv steps
  that make the environment, and its state on disk (absent, half made, broken, outdated, ready);
* ``report``: what its check (``studio.train.runtime_check``) found, in plain words with the fix;
* ``progress``: how far a setup has come: bytes in uv's cache, packages ready, and the time left;
* ``self_test``: the GPU self-test (``studio doctor``): the techniques it trains, how their losses are judged,
  what it found in plain words with the fix, and its report.

The window runs the steps (``studio.gui.runtime``).
"""
