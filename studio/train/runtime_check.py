"""Check the Python this runs in as a training runtime; print one JSON line (studio.core.runtime.report reads it).

    python -m studio.train.runtime_check

Reports the Python and PyTorch versions, the CUDA build, whether CUDA sees a GPU (and which), whether
bitsandbytes quantizes and restores a tensor on it (what QLoRA and the 8-bit optimizers need), and any
package of the ML stack that fails to import. Exits 0 whenever it could report, 1 when torch is missing.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback

STACK = ("transformers", "peft", "accelerate", "datasets", "safetensors", "torchao")


def first_line(exc: BaseException) -> str:
    return (traceback.format_exception_only(type(exc), exc)[-1]).strip()


def bitsandbytes_roundtrip(torch) -> str:
    """"" when a 4-bit quantize and dequantize of a small matrix on the GPU comes back close, else the error."""
    try:
        from bitsandbytes.functional import dequantize_4bit, quantize_4bit

        weight = torch.randn(128, 128, device="cuda", dtype=torch.float16)
        packed, state = quantize_4bit(weight, quant_type="nf4")
        error = (dequantize_4bit(packed, state) - weight).abs().mean().item()
        return "" if error < 0.2 else f"4-bit round trip is off by {error:.3f} on average"
    except Exception as exc:  # an unsupported GPU, a missing binary, a CUDA mismatch: report, do not crash
        return first_line(exc)


def check() -> dict:
    report: dict = {"python": sys.version.split()[0], "executable": sys.executable}
    try:
        import torch
    except Exception as exc:
        report["torch_error"] = first_line(exc)
        return report
    report.update(torch=torch.__version__, cuda_build=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if report["cuda_available"]:
        report["devices"] = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
        report["bitsandbytes_error"] = bitsandbytes_roundtrip(torch)
    else:
        mps = getattr(torch.backends, "mps", None)
        report["mps_available"] = bool(mps and mps.is_available())
    report["import_errors"] = {}
    for name in STACK:
        try:
            importlib.import_module(name)
        except Exception as exc:
            report["import_errors"][name] = first_line(exc)
    return report


def main() -> int:
    report = check()
    print(json.dumps(report))
    return 1 if "torch_error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
