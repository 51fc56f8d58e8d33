"""How far each "loss falls" test case is from its threshold, across seeds.

    python benchmarks/loss_margins.py                 # every case, seeds 42 (the tests'), 1, 2, 3
    python benchmarks/loss_margins.py sgd ia3 --seeds 42 7

A test's verdict must not depend on the CPU that runs it. Another CPU rounds
reductions differently (and may draw its random initialization through other
vector code), which a fragile run amplifies as much as a new seed would; so a
case whose ratio stays well below its threshold for several seeds passes
anywhere. The cases are the tests' own configs. Each row prints the ratio the
test compares (later losses over earlier ones) for each seed, and the worst
seed's room: the threshold over its ratio (1.5x: 50 % to spare).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import first_lines  # noqa: E402
from helpers import losses, quick_config  # noqa: E402
from studio.core.config import RunConfig  # noqa: E402
from studio.core.presets import DEMO_DATASETS, DEMO_TRAIN  # noqa: E402
from test_layer_split import SPLIT_THRESHOLD, split_config  # noqa: E402
from test_packing_loss import packing_config  # noqa: E402
from test_peft_methods import METHOD_THRESHOLD, METHODS  # noqa: E402
from test_qat import FULL_INT8  # noqa: E402
from test_train import TECHNIQUE_THRESHOLD, TECHNIQUES  # noqa: E402

Ratio = Callable[[list[float]], float]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def cases(story: Path, demo_rows: Path) -> Iterator[tuple[str, RunConfig, float, Ratio]]:
    """(name, config, threshold, the ratio its test compares with the threshold), for every case."""
    for name, sections in TECHNIQUES.items():
        yield (name, quick_config(story, **sections).replace(data={"format": "text"}), TECHNIQUE_THRESHOLD,
               lambda c: mean(c[-4:]) / mean(c[:4]))
    for method, sections in METHODS.items():
        yield (method, quick_config(story, method=method, data={"format": "text"}, **sections), METHOD_THRESHOLD,
               lambda c: mean(c[-4:]) / c[0])
    yield "layer_split", split_config(story), SPLIT_THRESHOLD, lambda c: c[-1] / c[0]
    yield "qat_full_int8_export", FULL_INT8, 1.0, lambda c: sum(c[-2:]) / sum(c[:2])
    yield "packing_length_grouped", packing_config(demo_rows, "length_grouped", True), 1.0, lambda c: c[-1] / c[0]


def curve_of(config: RunConfig, seed: int, folder: Path) -> list[float]:
    from studio.train.worker import run

    _, run_dir = run(config.replace(training={"seed": seed}), folder, watch_stdin=False)
    return losses(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="cases to run (default: all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2, 3])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        story = first_lines(DEMO_DATASETS / "facts.txt", 8, Path(tmp) / "facts.txt")  # the tests' fixtures
        demo_rows = first_lines(DEMO_TRAIN, 32, Path(tmp) / "train.jsonl")
        print(f"{'case':<28}{'threshold':>10}  ratios by seed {args.seeds}   worst room")
        for name, config, threshold, ratio_of in cases(story, demo_rows):
            if args.names and name not in args.names:
                continue
            ratios = [ratio_of(curve_of(config, seed, Path(tmp) / f"{name}-{seed}")) for seed in args.seeds]
            print(f"{name:<28}{threshold:>10.2f}  " + " ".join(f"{r:.3f}" for r in ratios)
                  + f"   {threshold / max(ratios):.2f}x", flush=True)


if __name__ == "__main__":
    main()
