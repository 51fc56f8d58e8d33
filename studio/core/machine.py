"""What this machine has for a run beside its GPUs: its CPU RAM, read with psutil."""

from __future__ import annotations


def available_ram() -> int:
    """The CPU RAM free for a run now (psutil's available: free memory and what the system can reclaim)."""
    import psutil

    return int(psutil.virtual_memory().available)
