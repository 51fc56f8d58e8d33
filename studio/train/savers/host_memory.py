"""Tensors that savers make for CPU RAM beside the device, marked for the memory tracker.

On the CPU, device and host are the same RAM: a saver makes its host tensors under ``on_host()`` so that
``studio.train.measure.memtrack`` counts them apart, as host memory, and a CPU run measures the device and
the host as a GPU run would see them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_host_allocations = 0  # > 0 while tensors meant for host RAM are being made (on_host)


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Tensors made inside are host memory, even on a CPU device."""
    global _host_allocations
    _host_allocations += 1
    try:
        yield
    finally:
        _host_allocations -= 1


def making_host_tensors() -> bool:
    """Whether the tensors made now are meant for host RAM (inside ``on_host``)."""
    return _host_allocations > 0
