"""The GPUs of this machine (NVML), and the common cards to plan for when there is none. No Qt."""

from __future__ import annotations

from dataclasses import dataclass

from studio.core.sizes import GIB


@dataclass(frozen=True)
class Gpu:
    name: str
    total_bytes: int
    index: int | None = None  # the CUDA index of a detected card; None for a card picked from the list

    @property
    def title(self) -> str:
        where = f"GPU {self.index}: " if self.index is not None else ""
        return f"{where}{self.name} ({self.total_bytes / GIB:.0f} GiB)"


# Nominal memory sizes; what a run can use is a little less (the driver and display keep some).
COMMON_CARDS: tuple[Gpu, ...] = tuple(Gpu(name, int(gb * GIB)) for name, gb in (
    ("GeForce RTX 3060", 12), ("GeForce RTX 4070", 12), ("GeForce RTX 4060 Ti 16 GB", 16),
    ("GeForce RTX 4080", 16), ("Tesla T4", 16), ("GeForce RTX 3090", 24), ("GeForce RTX 4090", 24),
    ("NVIDIA L4", 24), ("NVIDIA A10G", 24), ("GeForce RTX 5090", 32), ("NVIDIA A100 40 GB", 40),
    ("NVIDIA A100 80 GB", 80), ("NVIDIA H100 80 GB", 80), ("NVIDIA H200", 141),
))
DEFAULT_CARD = "GeForce RTX 4090"


def detect_gpus() -> list[Gpu]:
    """NVIDIA GPUs seen by NVML; an empty list without a GPU or driver (never raises)."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else str(name)
            gpus.append(Gpu(name, int(pynvml.nvmlDeviceGetMemoryInfo(handle).total), index))
        return gpus
    except pynvml.NVMLError:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass

