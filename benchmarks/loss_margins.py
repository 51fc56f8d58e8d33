"""How far each "loss falls" test case is from its threshold, across seeds.

    python benchmarks/loss_margins.py                 # every case, seeds 42 (the tests'), 1, 2, 3
    python benchmarks/loss_margins.py sgd ia3 --seeds 42 7

A test's verdict must not depend on the CPU that runs it. Another CPU changes the
rounding of every reduction, which a chaotic run amplifies as much as a new seed
would; so a case whose ratio stays far below its threshold for several seeds
passes anywhere. Each row prints the ratio the test compares (later losses over
earlier ones) for each seed and the worst one's margin: the threshold over the
ratio (1.5 means 50 % of room).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import first_lines  # noqa: E402
from helpers import losses, quick_config  # noqa: E402
from studio.core.presets import DEMO_DATASETS  # noqa: E402
from test_peft_methods import METHODS  # noqa: E402
from test_train import TECHNIQUES, TECHNIQUE_THRESHOLD  # noqa: E402
from test_peft_methods import METHOD_THRESHOLD  # noqa: E402


def cases():
    """name -> (config sections, threshold, ratio of a loss curve), as the tests define them."""
    for name, sections in TECHNIQUES.items():
        yield name, sections, TECHNIQUE_THRESHOLD, lambda c: (sum(c[-4:]) / 4) / (sum(c[:4]) / 4)
    for method, rate in METHODS.items():
        yield method, {"method": method, "training": {"learning_rate": rate}}, METHOD_THRESHOLD, \
            lambda c: (sum(c[-4:]) / 4) / c[0]


def curve_of(sections: dict, seed: int, data: Path, folder: Path) -> list[float]:
    from studio.train.worker import run

    config = quick_config(data, **sections).replace(data={"format": "text"})
    _, run_dir = run(config.replace(training={"seed": seed}), folder, watch_stdin=False)
    return losses(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="cases to run (default: all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2, 3])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = first_lines(DEMO_DATASETS / "facts.txt", 8, Path(tmp) / "facts.txt")
        print(f"{'case':<28}{'threshold':>10}  ratios by seed {args.seeds}   worst margin")
        for name, sections, threshold, ratio_of in cases():
            if args.names and name not in args.names:
                continue
            ratios = [ratio_of(curve_of(sections, seed, data, Path(tmp) / f"{name}-{seed}")) for seed in args.seeds]
            print(f"{name:<28}{threshold:>10.2f}  " + " ".join(f"{r:.3f}" for r in ratios)
                  + f"   {threshold / max(ratios):.2f}x", flush=True)


if __name__ == "__main__":
    main()
