"""The GPUs of this machine (NVML), and the common cards to plan for when there is none. No Qt."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024**2
# What a desktop's display keeps on its GeForce card (0.2-0.5 GiB seen): held back from a card planned for
DISPLAY_BYTES = 512 * MIB


@dataclass(frozen=True)
class Gpu:
    name: str
    total_bytes: int  # as the card reports it (nvidia-smi's MiB): an "8 GB" card has 8,188 MiB
    index: int | None = None  # the CUDA index of a detected card; None for a card picked from the list
    # what others hold on it: a detected card's NVML used memory when it was detected (the display, other
    # processes), or a planned desktop card's display
    held_bytes: int = 0

    @property
    def title(self) -> str:
        where = f"GPU {self.index}: " if self.index is not None else ""
        kept = "in use" if self.index is not None else "for the display"
        held = f", {self.held_bytes // MIB:,} MiB {kept}" if self.held_bytes else ""
        return f"{where}{self.name} ({self.total_bytes // MIB:,} MiB{held})"

    @property
    def usable_bytes(self) -> int:
        """What a run may take: the card's memory less what others hold on it."""
        return self.total_bytes - self.held_bytes


def _card(name: str, mib: int) -> Gpu:
    return Gpu(name, mib * MIB, held_bytes=DISPLAY_BYTES if name.startswith("GeForce") else 0)


# As nvidia-smi reports their memory (MiB).
COMMON_CARDS: tuple[Gpu, ...] = tuple(_card(name, mib) for name, mib in (
    ("GeForce RTX 4060 8 GB", 8188), ("GeForce RTX 3070", 8192), ("GeForce RTX 3060", 12288),
    ("GeForce RTX 4070", 12282), ("GeForce RTX 4060 Ti 16 GB", 16380), ("GeForce RTX 4080", 16376),
    ("Tesla T4", 15360), ("GeForce RTX 3090", 24576), ("GeForce RTX 4090", 24564), ("NVIDIA L4", 23034),
    ("NVIDIA A10G", 23028), ("GeForce RTX 5090", 32607), ("NVIDIA A100 40 GB", 40960), ("NVIDIA L40S", 46068),
    ("NVIDIA RTX A6000", 49140),
    ("NVIDIA A100 80 GB", 81920), ("NVIDIA H100 80 GB", 81559), ("NVIDIA H200", 143771),
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
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(Gpu(name, int(memory.total), index, held_bytes=int(memory.used)))
        return gpus
    except pynvml.NVMLError:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass

