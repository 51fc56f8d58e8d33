"""The training runtime's check (studio.train.runtime_check) in plain words, each problem with its fix.

What is expected follows the machine: with an NVIDIA GPU seen by NVML, CUDA must see it too and
bitsandbytes must work on it; without one, the CPU build is right and bitsandbytes is not needed.
"""

from __future__ import annotations

from dataclasses import dataclass

from studio.core.runtime.environment import Machine

REPAIR = "Use Runtime ▸ Training runtime… and press Repair: the environment is made again from the kept downloads."


@dataclass(frozen=True)
class Finding:
    text: str
    fix: str = ""


@dataclass(frozen=True)
class RuntimeReport:
    healthy: bool  # the runtime can be used (warnings may remain)
    summary: str  # one line for the status bar
    problems: tuple[Finding, ...] = ()  # what stops training, or limits it, with the fix

    def as_text(self) -> str:
        lines = [self.summary]
        for finding in self.problems:
            lines.append(f"• {finding.text}" + (f" Fix: {finding.fix}" if finding.fix else ""))
        return "\n".join(lines)


def diagnose(check: dict | None, machine: Machine) -> RuntimeReport:
    if not check:
        return RuntimeReport(False, "The training runtime did not answer its check.",
                             (Finding("Its Python did not start or printed no report.", REPAIR),))
    if "torch_error" in check:
        return RuntimeReport(False, "PyTorch does not import in the training runtime.",
                             (Finding(f"Importing torch failed: {check['torch_error']}.", REPAIR),))
    blocking = [Finding(f"{name} does not import: {error}.", REPAIR) for name, error in check.get("import_errors", {}).items()]
    blocking += _cuda_findings(check, machine)
    limiting = _bitsandbytes_findings(check)
    cuda = f", CUDA {check['cuda_build']}" if check.get("cuda_build") else ""
    words = "not usable" if blocking else "ready"
    summary = f"Training runtime {words}: PyTorch {check.get('torch')}{cuda}, {_device_words(check, machine)}."
    return RuntimeReport(not blocking, summary, tuple(blocking + limiting))


def _device_words(check: dict, machine: Machine) -> str:
    if check.get("cuda_available"):
        names = ", ".join(check.get("devices") or []) or "a GPU"
        bnb = "bitsandbytes works" if not check.get("bitsandbytes_error") else "bitsandbytes does not work"
        return f"training on {names}; {bnb}"
    if check.get("mps_available"):
        return "training on the Apple GPU (MPS)"
    if machine.gpus:
        return "CUDA does not see the GPU"
    return "training on the CPU (no NVIDIA GPU: slow, and QLoRA needs a GPU)"


def _cuda_findings(check: dict, machine: Machine) -> list[Finding]:
    """A GPU that NVML sees must be seen by PyTorch too."""
    if not machine.gpus or check.get("cuda_available"):
        return []
    gpu = machine.gpus[0]
    if not check.get("cuda_build"):
        return [Finding(f"The runtime has the CPU-only build of PyTorch, but this machine has an NVIDIA GPU ({gpu}).",
                        REPAIR + " The CUDA build for your driver is chosen this time.")]
    return [Finding(f"PyTorch is built for CUDA {check['cuda_build']} but does not see the {gpu}.",
                    f"Update the NVIDIA driver to one for CUDA {check['cuda_build']} or newer (nvidia.com/drivers), "
                    "restart the computer, then open the app again.")]


def _bitsandbytes_findings(check: dict) -> list[Finding]:
    """bitsandbytes failing limits the choices (QLoRA, 8-bit optimizers) but does not stop training."""
    if not (check.get("cuda_available") and check.get("bitsandbytes_error")):
        return []
    return [Finding(f"bitsandbytes does not work on this GPU ({check['bitsandbytes_error']}): QLoRA and the 8-bit "
                    "optimizers will fail; LoRA and full fine-tuning work.",
                    REPAIR + " If it still fails, choose LoRA instead of QLoRA and the AdamW optimizer.")]
