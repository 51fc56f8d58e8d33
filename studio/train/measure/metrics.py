"""Memory readings per device, for step events and the run header.

On CUDA: torch's allocated / reserved / peak for each device plus nvml's used and
total (which includes other processes and the display). Without CUDA the process's
resident memory stands in, labelled so that no chart mistakes it for GPU memory.
"""

from __future__ import annotations

import functools
import platform
import threading

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


def _nvml_handle(nvml, index: int):
    """NVML's handle of the GPU torch calls ``cuda:index``, found by its UUID (else its PCI bus id): NVML numbers
    the GPUs its own way, which CUDA_VISIBLE_DEVICES and CUDA's device order do not follow. None if not found."""
    properties = torch.cuda.get_device_properties(index)
    uuid = getattr(properties, "uuid", None)
    if uuid is not None:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except nvml.NVMLError:
            pass
    bus = getattr(properties, "pci_bus_id", None)
    if bus is not None:
        address = f"{properties.pci_domain_id:08X}:{bus:02X}:{properties.pci_device_id:02X}.0"
        try:
            return nvml.nvmlDeviceGetHandleByPciBusId(address)
        except nvml.NVMLError:
            pass
    return None


def _nvml_usage(index: int) -> dict:
    nvml = _nvml()
    if nvml is None:
        return {}
    try:
        handle = _nvml_handle(nvml, index)
        if handle is None:
            return {}
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        return {"nvml_used_bytes": int(info.used), "nvml_total_bytes": int(info.total)}
    except nvml.NVMLError:
        return {}


def device_readings(device: torch.device, tracker) -> dict:
    """A measured step's other readings on CUDA: the allocator's peak reserved bytes and NVML's used bytes now
    (the CUDA context and other processes too); none elsewhere."""
    if device.type != "cuda":
        return {}
    readings = {"peak_reserved_bytes": tracker.peak_reserved_bytes}
    used = _nvml_usage(device.index or 0).get("nvml_used_bytes")
    return readings if used is None else {**readings, "nvml_used_bytes": used}


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


class LoadingMemory:
    """Around loading the model: the process's resident memory before, at its peak (sampled every 20 ms from a
    thread) and after, and on CUDA the device's peak allocation; ``figures`` for the run_started event.
    Entered again, it goes on measuring the same load (FSDP's sharded load ends in the engine's prepare)."""

    def __init__(self, device: torch.device):
        import psutil

        self.device, self._process = device, psutil.Process()
        self.before = None

    def __enter__(self) -> "LoadingMemory":
        if self.before is None:
            self.before = self.peak = self._process.memory_info().rss
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="loading-memory")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.after = self._process.memory_info().rss
        self.peak = max(self.peak, self.after)

    def _sample(self) -> None:
        while not self._done.wait(0.02):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def figures(self, rank: int, sharded: bool) -> dict:
        gpu = {"gpu_peak_bytes": torch.cuda.max_memory_allocated(self.device)} if self.device.type == "cuda" else {}
        return {"rank": rank, "sharded": sharded, "rss_before_bytes": self.before, "rss_peak_bytes": self.peak,
                "rss_after_bytes": self.after, **gpu}
