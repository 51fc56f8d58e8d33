"""Throughput and memory of our trainer beside the Hugging Face Trainer, on identical data.

    python benchmarks/throughput.py                 # 56M Llama, LoRA r8, batch 8, lengths 16-256 (minutes)
    python benchmarks/throughput.py --lengths uniform   # the same with uniformly spread lengths
    python benchmarks/throughput.py --quick         # tiny sizes, a few steps (the test runs this)
    python benchmarks/throughput.py --json out.json

The data is a synthetic instruction set: random token ids, lengths in
[min_length, max_length] drawn log-uniformly (the default, ``--lengths skewed``:
many short examples and few long ones, as in real instruction sets) or uniformly
(``--lengths uniform``: less of a padded batch is padding), the prompt (a uniform
25-75 % of each example) masked from the loss. A word-level tokenizer built here (word ``t123`` is id 123) lets
the worker read it from a prompt_completion file, and the rows it tokenizes are
the very rows handed to the baselines, in the very order of the worker's batch
plan (a sequential sampler), so all sides see identical micro-batches and their
losses must agree. Sides, each starting from the same seed and weights:

    hf_padded    transformers Trainer, DataCollatorForSeq2Seq (pads to the longest of each batch)
    hf_flat      transformers Trainer, DataCollatorWithFlattening (padding-free, one row per batch)
    ours         the studio worker's optimizer step as configured by default (packing + chunked loss)
    ours_plain   the studio worker with packing none and chunked_loss off (its own overhead vs hf_padded)

Throughput counts real (non-padding) tokens per second of process CPU time (the
machine may be shared: CPU time is what a side itself spent; wall time is shown
too) over the steps after the warm-up ones. Sides run interleaved, in a rotating
order, ``--repeats`` times; the table gives the median and the spread. Memory is
the peak of live tensor bytes over one step (studio.train.measure.memtrack's
LiveTensorTracker on every side; on CUDA the allocator's peak), and the peak of
the live tensors as wide as the vocabulary (the logits and their fp32 copies).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from studio.train.measure.memtrack import LiveTensorTracker  # noqa: E402

SIDES = ("hf_padded", "hf_flat", "ours", "ours_plain")
MIB = 1024**2
FULL = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 8, "vocab_size": 32000}
QUICK = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 2000}


@dataclass
class Result:
    side: str
    tokens: int = 0  # real tokens over the timed steps
    cpu_seconds: float = 0.0
    wall_seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    peak_bytes: int = 0
    vocab_peak_bytes: int = 0

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens / self.cpu_seconds

    @property
    def tokens_per_wall_s(self) -> float:
        return self.tokens / self.wall_seconds


class VocabTracker(LiveTensorTracker):
    """Also keeps the peak of live storages of tensors whose last dimension is the vocabulary."""

    def __init__(self, vocab: int, device_type: str):
        super().__init__(device_type)
        self.vocab, self.vocab_live, self.vocab_peak = vocab, 0, 0
        self._vocab_keys: set[int] = set()
        self._wide = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in torch.utils._pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._wide = leaf.dim() > 0 and leaf.shape[-1] == self.vocab and leaf.dim() > 1 and leaf.shape[0] != self.vocab
                self._register(leaf)
        self._wide = False
        self.report.note(self._phase, self.live_bytes)
        return out

    def _register(self, tensor, host=False):
        known = len(self._storages)
        super()._register(tensor, host)
        if self._wide and len(self._storages) > known:
            key = tensor.untyped_storage()._cdata
            self._vocab_keys.add(key)
            self.vocab_live += tensor.untyped_storage().nbytes()
            self.vocab_peak = max(self.vocab_peak, self.vocab_live)

    def _release(self, key, nbytes, host=False):
        if key in self._vocab_keys:
            self._vocab_keys.discard(key)
            self.vocab_live -= nbytes
        super()._release(key, nbytes, host)


# ---------------------------------------------------------------- assets


def build_assets(folder: Path, sizes: dict, rows: int, args) -> Path:
    """A random-weight Llama with a word-level tokenizer, and a prompt_completion data file."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = sizes["vocab_size"]
    words = {"<pad>": 0, "<unk>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(args.seed)
    config = LlamaConfig(**sizes, max_position_embeddings=max(512, args.max_length), bos_token_id=None, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")

    rng = random.Random(args.seed)
    with open(folder / "train.jsonl", "w", encoding="utf-8") as f:
        for _ in range(rows):
            length = example_length(rng, args) - 1  # the eos completes it
            prompt = round(length * rng.uniform(0.25, 0.75))
            ids = [rng.randrange(3, vocab) for _ in range(length)]
            f.write(json.dumps({"prompt": " ".join(f"t{i}" for i in ids[:prompt]),
                                "completion": " " + " ".join(f"t{i}" for i in ids[prompt:])}) + "\n")
    return folder


def example_length(rng: random.Random, args) -> int:
    if args.lengths == "skewed":
        return round(math.exp(rng.uniform(math.log(args.min_length), math.log(args.max_length))))
    return rng.randint(args.min_length, args.max_length)


def run_config(folder: Path, args, plain: bool):
    from studio.core.presets import demo_config

    return demo_config().replace(
        name="throughput", model={"name_or_path": str(folder / "model")},
        data={"train_files": (str(folder / "train.jsonl"),), "eval_files": (), "format": "prompt_completion",
              "max_length": args.max_length, "packing": "none" if plain else "padding_free"},
        lora={"r": 8, "alpha": 16.0, "dropout": 0.0},
        training={"precision": args.precision, "micro_batch_size": args.batch, "max_steps": args.steps,
                  "learning_rate": 1e-3, "lr_scheduler": "constant", "warmup_ratio": 0.0,
                  "chunked_loss": not plain, "seed": args.seed},
        schedule={"sample_every": 0},
    )


# ---------------------------------------------------------------- sides


def timed_steps(step, steps: int, warmup: int, measured: int, tracker_factory, result: Result, tokens_of) -> None:
    """Run ``steps`` optimizer steps; time those after ``warmup`` except the one measured for memory."""
    for index in range(steps):
        if index == measured:
            tracker = tracker_factory()
            with tracker:
                result.losses.append(step(tracker))
            result.peak_bytes, result.vocab_peak_bytes = tracker_peaks(tracker)
            continue
        cpu, wall = time.process_time(), time.perf_counter()
        result.losses.append(step(None))
        sync()
        if index >= warmup:
            result.cpu_seconds += time.process_time() - cpu
            result.wall_seconds += time.perf_counter() - wall
            result.tokens += tokens_of(index)


def tracker_peaks(tracker) -> tuple[int, int]:
    if isinstance(tracker, VocabTracker):
        return tracker.report.peak_bytes, tracker.vocab_peak
    return tracker.report.peak_bytes, 0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_ours(folder: Path, args, plain: bool, tracker_factory, tokens_of) -> Result:
    from studio.core.run.directory import RunDir
    from studio.core.run.events import EventWriter
    from studio.train.control import StopController
    from studio.train.worker import Worker

    config = run_config(folder, args, plain)
    run_dir = RunDir(Path(tempfile.mkdtemp(dir=folder)))
    events = EventWriter(run_dir.events)
    control = StopController(run_dir, watch_stdin=False)
    worker = Worker(config, run_dir, events, control)
    worker.setup(None)
    result = Result("ours_plain" if plain else "ours")

    def step(tracker):
        if tracker is not None:
            tracker.add_module(worker.raw_model)
            tracker.add(state for state in worker.optimizer.state.values())
        loss = worker._optimizer_step()["loss"]
        worker.step += 1
        return loss

    try:
        timed_steps(step, args.steps, args.warmup, args.measured, tracker_factory, result, tokens_of)
    finally:
        control.close()
        events.close()
    return result


def run_hf(folder: Path, args, rows, flat: bool, tracker_factory, tokens_of) -> Result:
    from transformers import (AutoModelForCausalLM, DataCollatorForSeq2Seq, DataCollatorWithFlattening, Trainer,
                              TrainerCallback, TrainingArguments)
    from transformers.trainer_callback import PrinterCallback

    from studio.train.model.build import load_tokenizer
    from studio.train.model.methods import peft_config

    config = run_config(folder, args, plain=True)
    tokenizer = load_tokenizer(config)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    from peft import get_peft_model

    model = get_peft_model(model.to(device()), peft_config(config))
    result = Result("hf_flat" if flat else "hf_padded")
    collator = (DataCollatorWithFlattening() if flat
                else DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100))

    class Timing(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kw):
            index = state.global_step
            self.tracker = tracker_factory() if index == args.measured else None
            if self.tracker is not None:
                self.tracker.__enter__()
                self.tracker.add_module(model)
                self.tracker.add(s for s in trainer.optimizer.state.values())
            self.cpu, self.wall = time.process_time(), time.perf_counter()

        def on_step_end(self, targs, state, control, **kw):
            sync()
            index = state.global_step - 1
            if self.tracker is not None:
                self.tracker.__exit__(None, None, None)
                result.peak_bytes, result.vocab_peak_bytes = tracker_peaks(self.tracker)
            elif index >= args.warmup:
                result.cpu_seconds += time.process_time() - self.cpu
                result.wall_seconds += time.perf_counter() - self.wall
                result.tokens += tokens_of(index)

        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                result.losses.append(float(logs["loss"]))

    class InPlanOrder(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    targs = TrainingArguments(
        output_dir=str(folder / ("hf_flat" if flat else "hf_padded")), per_device_train_batch_size=args.batch,
        max_steps=args.steps, learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, optim="adamw_torch", seed=args.seed, logging_steps=1, save_strategy="no", report_to=[],
        dataloader_num_workers=0, use_cpu=device().type == "cpu", bf16=args.precision == "bf16",
        disable_tqdm=True, remove_unused_columns=False,
    )
    trainer = InPlanOrder(model=model, args=targs, train_dataset=rows, data_collator=collator, callbacks=[Timing()])
    trainer.remove_callback(PrinterCallback)  # the losses go to the table
    trainer.train()
    return result


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------- main


def plan_rows(folder: Path, args):
    """The worker's tokenized rows, in the order of its batch plan, and the real tokens per step."""
    from studio.train.data.prepare import prepare_data
    from studio.train.model.build import load_tokenizer
    from studio.train.worker import BatchPlan

    config = run_config(folder, args, plain=True)
    data = prepare_data(config, load_tokenizer(config))
    plan = BatchPlan(len(data.train), args.batch, args.seed)
    order = [row for step in range(args.steps) for row in plan.rows_of(step)]
    rows = data.train.select(order)
    lengths = [len(ids) for ids in rows["input_ids"]]
    batches = [lengths[s * args.batch:(s + 1) * args.batch] for s in range(args.steps)]
    tokens = [sum(batch) for batch in batches]
    targets = sum(sum(label != -100 for label in row) for row in rows["labels"])
    shape = {"target_token_share": targets / sum(tokens), "mean_tokens": statistics.mean(tokens),
             "padded_per_real": sum(len(batch) * max(batch) for batch in batches) / sum(tokens)}
    return rows, tokens, shape


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps: only checks that it runs")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--min-length", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--lengths", choices=("uniform", "skewed"), default="skewed",
                        help="how example lengths spread over [min, max]: uniformly or log-uniformly")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, the same for every side")
    parser.add_argument("--precision", default="", help="fp32 or bf16 (default: bf16 on CUDA, fp32 on the CPU)")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats, args.max_length = 4, 1, 1, 48
    args.precision = args.precision or ("bf16" if torch.cuda.is_available() else "fp32")
    args.measured = args.warmup  # the first step after the warm-up: optimizer state exists
    args.steps += 1  # the measured step is not timed
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    sides = args.sides.split(",")
    sizes = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_assets(Path(tmp), sizes, args.steps * args.batch, args)
        rows, step_tokens, data_shape = plan_rows(folder, args)
        tokens_of = lambda index: step_tokens[index]  # noqa: E731

        def tracker_factory():
            if device().type == "cuda":
                from studio.train.measure.memtrack import CudaPeakTracker

                return CudaPeakTracker()
            return VocabTracker(sizes["vocab_size"], "cpu")

        runners = {
            "hf_padded": lambda: run_hf(folder, args, rows, False, tracker_factory, tokens_of),
            "hf_flat": lambda: run_hf(folder, args, rows, True, tracker_factory, tokens_of),
            "ours": lambda: run_ours(folder, args, False, tracker_factory, tokens_of),
            "ours_plain": lambda: run_ours(folder, args, True, tracker_factory, tokens_of),
        }
        results: dict[str, list[Result]] = {side: [] for side in sides}
        for repeat in range(args.repeats):
            for side in sides[repeat % len(sides):] + sides[:repeat % len(sides)]:
                results[side].append(runners[side]())
                print(f"repeat {repeat + 1} {side}: {results[side][-1].tokens_per_cpu_s:.0f} tokens/cpu-s", file=sys.stderr)
    summary = summarize(results, args, sizes, data_shape)
    print(table(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return summary


def summarize(results: dict[str, list[Result]], args, sizes: dict, data_shape: dict) -> dict:
    sides = {}
    for side, runs in results.items():
        rates = [r.tokens_per_cpu_s for r in runs]
        sides[side] = {
            "tokens_per_cpu_s": statistics.median(rates), "spread": [min(rates), max(rates)],
            "tokens_per_wall_s": statistics.median(r.tokens_per_wall_s for r in runs),
            "peak_bytes": runs[0].peak_bytes, "vocab_peak_bytes": runs[0].vocab_peak_bytes,
            "final_loss": runs[0].losses[-1], "losses": runs[0].losses,
        }
    return {"device": str(device()), "threads": args.threads, "precision": args.precision, "steps": args.steps - 1,
            "repeats": args.repeats, "batch": args.batch, "lengths": [args.min_length, args.max_length, args.lengths],
            "model": sizes, **data_shape, "sides": sides}


def table(summary: dict) -> str:
    sides = summary["sides"]
    base = sides.get("hf_padded", {}).get("tokens_per_cpu_s")
    flat = sides.get("hf_flat", {}).get("tokens_per_cpu_s")
    lines = [f"device {summary['device']}, {summary['threads']} thread(s), {summary['precision']}, "
             f"{summary['steps']} steps x {summary['repeats']} repeats, batch {summary['batch']}, "
             f"lengths {summary['lengths']}, target tokens {summary['target_token_share']:.0%}",
             f"real tokens per micro-batch {summary['mean_tokens']:.0f}, padded batches hold "
             f"{summary['padded_per_real']:.2f}x that",
             "| side | real tokens/cpu-s (spread) | tokens/wall-s | vs hf_padded | vs hf_flat | peak MiB | vocab-wide MiB | final loss |",
             "|---|---|---|---|---|---|---|---|"]
    for side, s in sides.items():
        ratio = lambda ref: f"{s['tokens_per_cpu_s'] / ref:.2f}x" if ref else "-"  # noqa: E731
        lines.append(f"| {side} | {s['tokens_per_cpu_s']:.0f} ({s['spread'][0]:.0f}-{s['spread'][1]:.0f}) | "
                     f"{s['tokens_per_wall_s']:.0f} | {ratio(base)} | {ratio(flat)} | {s['peak_bytes'] / MIB:.1f} | "
                     f"{s['vocab_peak_bytes'] / MIB:.1f} | {s['final_loss']:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
