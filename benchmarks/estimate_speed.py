"""How long does one memory estimate take? The GUI recomputes it on every toggle: the budget is 5 ms.

    python benchmarks/estimate_speed.py

Times ``studio.core.memory.estimate.estimate`` on real model configs (8B Llama,
GPT-2, Pythia, Gemma) across methods and settings, and ``studio.core.memory.fit.fit``,
which runs a few dozen estimates. Pure Python: no torch is imported.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

BUDGET_MS = 5.0


def _time_ms(function, repeats: int, clock=time.perf_counter) -> list[float]:
    times = []
    for _ in range(repeats):
        started = clock()
        function()
        times.append((clock() - started) * 1000)
    return times


def main() -> int:
    from studio.core.config import RunConfig
    from studio.core.memory.estimate import ScaleOut, estimate
    from studio.core.memory.fit import fit
    from test_estimate import GEMMA_2B, GPT2_SMALL, LLAMA_31_8B, PYTHIA_160M

    models = {"Llama-3.1-8B": LLAMA_31_8B, "GPT-2": GPT2_SMALL, "Pythia-160M": PYTHIA_160M, "Gemma-2B": GEMMA_2B}
    settings = {
        "lora": RunConfig(),
        "qlora+ckpt": RunConfig(method="qlora").replace(training={"gradient_checkpointing": True}),
        "full+adamw8bit": RunConfig(method="full").replace(training={"optimizer": "adamw_8bit"}),
        "full zero3 x8": RunConfig(method="full"),
    }
    worst = 0.0
    # p95 in CPU time: on a shared machine wall-clock percentiles mostly measure the scheduler
    print(f"{'model':<14}{'settings':<16}{'median ms':>10}{'p95 CPU ms':>12}")
    for model_name, model_config in models.items():
        for name, config in settings.items():
            scale_out = ScaleOut(8, 3) if "zero3" in name else ScaleOut()
            run = lambda: estimate(model_config, config, scale_out=scale_out)  # noqa: E731
            run()  # warm up
            wall = _time_ms(run, 200)
            cpu = sorted(_time_ms(run, 200, time.process_time))
            p95 = cpu[int(0.95 * len(cpu))]
            worst = max(worst, p95)
            print(f"{model_name:<14}{name:<16}{statistics.median(wall):>10.3f}{p95:>12.3f}")
    fit_times = _time_ms(lambda: fit(LLAMA_31_8B, RunConfig().replace(training={"micro_batch_size": 8}), 24 * 1024**3), 5)
    print(f"fit (Llama-3.1-8B, 24 GiB): median {statistics.median(fit_times):.1f} ms")
    print(f"worst p95 estimate: {worst:.3f} ms (budget {BUDGET_MS} ms): {'ok' if worst < BUDGET_MS else 'TOO SLOW'}")
    return 0 if worst < BUDGET_MS else 1


if __name__ == "__main__":
    sys.exit(main())
