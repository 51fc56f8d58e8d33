"""Memory readings per device, for step events and the run header.

On CUDA: torch's allocated / reserved / peak for each device plus nvml's used and
total (which includes other processes and the display). Without CUDA the process's
resident memory stands in, labelled so that no chart mistakes it for GPU memory.
"""

from __future__ import annotations

import functools
import platform

import torch


@functools.lru_cache(maxsize=1)
def _nvml():
    """The pynvml module once initialized, or None when there is no NVIDIA driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # ImportError, pynvml.NVMLError_LibraryNotFound, driver errors
        return None


def _nvml_usage(index: int) -> dict:
    nvml = _nvml()
    if nvml is None:
        return {}
    try:
        info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index))
        return {"nvml_used_bytes": int(info.used), "nvml_total_bytes": int(info.total)}
    except nvml.NVMLError:
        return {}


def _process_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def memory_snapshot(device: torch.device | None = None, rank: int | None = None) -> list[dict]:
    """One entry per device; see the module docstring.

    With ``rank`` (one of several training processes) only this process's own device:
    its GPU, or on the CPU its process memory, keyed "cpu rank N" so that each rank
    draws its own curve.
    """
    if not torch.cuda.is_available():
        if rank is not None:
            return [{"device": f"cpu rank {rank}", "kind": "process", "label": f"rank {rank} process memory (CPU, no GPU)",
                     "rss_bytes": _process_rss()}]
        return [{"device": "cpu", "kind": "process", "label": "process memory (CPU, no GPU)", "rss_bytes": _process_rss()}]
    entries = []
    indices = [device.index or 0] if rank is not None and device is not None else range(torch.cuda.device_count())
    for index in indices:
        entries.append({
            "device": f"cuda:{index}",
            "kind": "cuda",
            "label": torch.cuda.get_device_name(index),
            "allocated_bytes": torch.cuda.memory_allocated(index),
            "reserved_bytes": torch.cuda.memory_reserved(index),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(index),
            **_nvml_usage(index),
        })
    return entries


def describe_devices() -> list[dict]:
    if not torch.cuda.is_available():
        return [{"device": "cpu", "name": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}]
    return [
        {"device": f"cuda:{i}", "name": torch.cuda.get_device_name(i),
         "total_bytes": torch.cuda.get_device_properties(i).total_memory}
        for i in range(torch.cuda.device_count())
    ]


def library_versions() -> dict[str, str]:
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "datasets", "finetune-studio"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions
