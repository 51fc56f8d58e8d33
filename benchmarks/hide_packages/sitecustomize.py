"""Python as if some installed packages were not: to rehearse here a machine that lacks them (the borrowed GPU
machine has no bitsandbytes, datasets, deepspeed, platformdirs or torchao).

    PYTHONPATH=benchmarks/hide_packages STUDIO_HIDE_PACKAGES=datasets,deepspeed python -m studio.train RUN.yaml

Python imports ``sitecustomize`` at start from its path. Here it swaps the finder of installed modules for one
that finds none of the named packages (an import raises ModuleNotFoundError, ``importlib.util.find_spec`` says
None) and lists none of their distributions (``importlib.metadata.version`` raises PackageNotFoundError), as on
a machine without them: transformers, for one, asks both before it imports deepspeed.
"""

import importlib.machinery
import os
import re
import sys


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


HIDDEN = {_canonical(name) for name in os.environ.get("STUDIO_HIDE_PACKAGES", "").split(",") if name.strip()}


def _hidden(name: str) -> bool:
    return _canonical(name.partition(".")[0]) in HIDDEN


class HidingPathFinder:
    """importlib's PathFinder, blind to the hidden packages."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if _hidden(name) else importlib.machinery.PathFinder.find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        found = importlib.machinery.PathFinder.find_distributions(*args, **kwargs)
        return (dist for dist in found if not _hidden(dist.metadata["Name"] or ""))

    @classmethod
    def invalidate_caches(cls):
        importlib.machinery.PathFinder.invalidate_caches()


if HIDDEN:
    sys.meta_path[:] = [HidingPathFinder if finder is importlib.machinery.PathFinder else finder
                        for finder in sys.meta_path]
