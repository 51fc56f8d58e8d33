"""A golden grid of what the pure-Python core answers: validations, estimates, fits and trace keys.

    python benchmarks/golden_grid.py --write before.json    # on the code before a refactor
    python benchmarks/golden_grid.py --compare before.json  # after it: exit 1 and the first differences if any

A refactor that must not change behaviour (issue 23) is checked against it: the same
seeded sample of run configs (every choice field, the memory savers, the methods,
sharding and layer split) over the published model configs of tests/test_estimate.py
and two families no table describes, answered by ``validate``, ``estimate``
(its whole JSON, or the error it raises), ``fit`` at 8, 24 and 80 GiB, and the derived
estimate's trace key. Takes about a minute on one core.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
# the same answers on every machine: no calibration of this one's GPU (studio doctor's) in the CUDA estimates
os.environ["STUDIO_RUNS_DIR"] = os.path.join(tempfile.mkdtemp(prefix="golden-grid-"), "runs")

from studio.core.config import RunConfig, choice_values, to_dict  # noqa: E402
from studio.core.errors import StudioError  # noqa: E402
from studio.core.memory.derived import trace_key  # noqa: E402
from studio.core.memory.estimate import ScaleOut, estimate  # noqa: E402
from studio.core.memory.fit import fit  # noqa: E402
from studio.core.validation import validate  # noqa: E402

GIB = 2**30
CONFIGS_PER_MODEL = 120
FITS_PER_MODEL = 8
GPU_SIZES = (8 * GIB, 24 * GIB, 80 * GIB)
CHOICES = ("method", "training.precision", "training.optimizer", "quantization.load_in", "quantization.quant_type",
           "model.dtype", "model.attn_implementation", "data.packing", "distributed.sharding",
           "distributed.offload_optimizer", "qat.weights")
FLAGS = ("training.gradient_checkpointing", "training.activation_offload", "training.tiled_mlp",
         "training.embedding_on_cpu", "training.output_layer_on_cpu", "training.lean_weights", "training.chunked_loss",
         "training.torch_compile", "distributed.layer_split", "lora.use_dora", "lora.use_rslora",
         "quantization.double_quant")
NUMBERS = {"training.micro_batch_size": (1, 2, 4, 8), "training.gradient_accumulation_steps": (1, 4),
           "data.max_length": (256, 2048, 16384), "lora.r": (8, 64), "lora.dropout": (0.0, 0.05),
           "distributed.num_processes": (1, 2, 4), "peft.num_virtual_tokens": (20, 64)}
TARGETS = (("all-linear",), ("q_proj", "v_proj"), ("all-linear", "lm_head"))


def models() -> dict[str, dict]:
    import test_estimate
    from model_factory import UNDESCRIBED, tiny_config

    published = {name: value for name, value in vars(test_estimate).items()
                 if name.isupper() and isinstance(value, dict) and "model_type" in value}
    return {**published, **{family: tiny_config(family) for family in UNDESCRIBED}}


def sampled_config(rng: random.Random, wild: bool) -> RunConfig:
    """Wild: every field drawn (mostly invalid combinations); else a default run with one to three fields drawn."""
    picks = {path: rng.choice(choice_values(path)) for path in CHOICES}
    picks.update({path: rng.random() < 0.35 for path in FLAGS})
    picks.update({path: rng.choice(values) for path, values in NUMBERS.items()})
    picks["lora.target_modules"] = rng.choice(TARGETS)
    if not wild:
        picks = dict(rng.sample(sorted(picks.items()), rng.randint(1, 3)))
    top, changes = {}, {}
    for path, value in picks.items():
        section, _, name = path.rpartition(".")
        if section:
            changes.setdefault(section, {})[name] = value
        else:
            top[name] = value
    base = RunConfig().replace(model={"name_or_path": "org/model"}, data={"train_files": ("train.jsonl",)})
    return base.replace(**top, **changes)


def answer(call):
    try:
        return call()
    except StudioError as exc:
        return {"error": type(exc).__name__, "message": exc.message, "hint": exc.hint}


def grid() -> dict:
    rng = random.Random(23)
    out = {}
    for model_name, model_config in sorted(models().items()):
        rows = []
        for index in range(CONFIGS_PER_MODEL):
            config = sampled_config(rng, wild=index % 2 == 1)
            row = {"config": to_dict(config),
                   "problems": [str(problem) for problem in validate(config, check_files=False)],
                   "trace_key": trace_key(model_config, config)}
            row["estimate"] = answer(lambda: estimate(model_config, config, "cuda", ScaleOut.from_config(
                config, (24 * GIB,) * 2)).to_json(24 * GIB))
            if index < FITS_PER_MODEL:
                row["fits"] = [answer(lambda: fit(model_config, config, size).to_json()) for size in GPU_SIZES]
            rows.append(row)
        out[model_name] = rows
    return out


def first_differences(before, after, path: str = "", limit: int = 10) -> list[str]:
    if type(before) is not type(after):
        return [f"{path}: {before!r} -> {after!r}"]
    if isinstance(before, dict):
        found = []
        for key in sorted(set(before) | set(after)):
            found += first_differences(before.get(key), after.get(key), f"{path}.{key}", limit - len(found))
            if len(found) >= limit:
                break
        return found
    if isinstance(before, list) and len(before) == len(after):
        found = []
        for index, (b, a) in enumerate(zip(before, after)):
            found += first_differences(b, a, f"{path}[{index}]", limit - len(found))
            if len(found) >= limit:
                break
        return found
    return [] if before == after else [f"{path}: {before!r} -> {after!r}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", type=Path, help="write the grid to this JSON file")
    action.add_argument("--compare", type=Path, help="compare the grid with this JSON file")
    args = parser.parse_args()
    now = json.loads(json.dumps(grid()))  # tuples as lists, as the file holds them
    digest = hashlib.sha256(json.dumps(now, sort_keys=True).encode()).hexdigest()[:16]
    rows = sum(len(rows) for rows in now.values())
    if args.write:
        args.write.write_text(json.dumps(now, sort_keys=True), encoding="utf-8")
        print(f"wrote {rows} rows over {len(now)} models to {args.write} (sha256 {digest})")
        return 0
    before = json.loads(args.compare.read_text(encoding="utf-8"))
    differences = first_differences(before, now)
    print(f"{rows} rows over {len(now)} models (sha256 {digest}): "
          + ("identical" if not differences else "DIFFERENT"))
    for line in differences:
        print("  " + line)
    return 1 if differences else 0


if __name__ == "__main__":
    raise SystemExit(main())
