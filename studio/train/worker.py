"""The training worker: one run, from a config to checkpoints, with events on the way.

Read top to bottom: ``Worker.setup`` loads data and model and restores a checkpoint
when resuming, ``Worker.train`` runs the optimizer loop, ``Worker.save`` writes a
checkpoint. Everything a viewer needs goes to ``events.jsonl`` (studio.core.events).

Data order is a pure function of the seed and the step, so a run resumed at step k
sees exactly the micro-batches an uninterrupted run would have seen from step k.
The loss of each optimizer step is the mean over all target tokens of its
micro-batches (not a mean of per-micro-batch means), which makes gradient
accumulation equal to a bigger batch.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from studio.core.config import RunConfig, load_config, save_config, to_dict
from studio.core.errors import StudioError
from studio.core.estimate import estimate
from studio.core.events import EventWriter
from studio.core.modelinfo import load_model_config
from studio.core.rundir import RunDir, default_runs_root
from studio.core.validation import raise_if_invalid
from studio.train import checkpoint as ckpt
from studio.train.control import StopController
from studio.train.data import collate, prepare_data
from studio.train.memtrack import tracker_for
from studio.train.metrics import describe_devices, library_versions, memory_snapshot
from studio.train.model import adapted_module_names, after_optimizer_step, build_model, count_parameters, load_tokenizer
from studio.train.optim import build_optimizer, build_scheduler

log = logging.getLogger("studio.train")

EXIT_OK, EXIT_FAILED, EXIT_ABORTED = 0, 1, 130  # a refused config exits 2 from the CLI
MEASURED_STEP = 1  # steps after the start (or resume) before the one whose memory is measured


@dataclass
class BatchPlan:
    """Which rows form micro-batch number ``index`` (counted across epochs)."""

    rows: int
    micro_batch_size: int
    seed: int

    def __post_init__(self):
        self.per_epoch = math.ceil(self.rows / self.micro_batch_size)
        self._epoch, self._order = -1, []

    def rows_of(self, index: int) -> list[int]:
        epoch, offset = divmod(index, self.per_epoch)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.rows, generator=generator).tolist()
        start = offset * self.micro_batch_size
        return self._order[start:start + self.micro_batch_size]

    def total_steps(self, config: RunConfig) -> int:
        t = config.training
        if t.max_steps:
            return t.max_steps
        return max(1, math.ceil(t.epochs * self.per_epoch / t.gradient_accumulation_steps))


class Worker:
    def __init__(self, config: RunConfig, run_dir: RunDir, events: EventWriter, control: StopController):
        self.config = config
        self.run_dir = run_dir
        self.events = events
        self.control = control
        self.step = 0

    # ------------------------------------------------------------------ setup
    def setup(self, resume_from: Path | None) -> None:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)  # several runs in one process (tests, demo)
        config = self.config
        torch.manual_seed(config.training.seed)
        mixed = {"fp32": "no"}.get(config.training.precision, config.training.precision)
        self.accelerator = Accelerator(mixed_precision=mixed, cpu=not torch.cuda.is_available())
        self.device = self.accelerator.device

        self.tokenizer = load_tokenizer(config)
        data = prepare_data(config, self.tokenizer)
        self.train_rows, self.eval_rows = data.train, data.eval
        self.plan = BatchPlan(len(self.train_rows), config.training.micro_batch_size, config.training.seed)
        self.total_steps = self.plan.total_steps(config)

        model = build_model(config, self.device, self.total_steps)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = build_optimizer(config, params)
        scheduler = build_scheduler(config, optimizer, self.total_steps)
        # The scheduler stays unprepared: accelerate would step it once per process.
        self.raw_model = model  # for saving; accelerate's unwrap_model imports deepspeed (seconds)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.scheduler = scheduler
        if resume_from is not None:
            state = ckpt.load_checkpoint(resume_from, self.model, self.optimizer, self.scheduler)
            self.step = state["step"]
            log.info("resumed from %s at step %d", resume_from, self.step)

        trainable, total = count_parameters(self.model)
        self.events.emit(
            "run_started",
            config=to_dict(config), versions=library_versions(), devices=describe_devices(),
            run_dir=str(self.run_dir.path), pid=os.getpid(), total_steps=self.total_steps,
            start_step=self.step, resumed_from=str(resume_from) if resume_from else None,
            trainable_params=trainable, total_params=total, data=data.stats,
            adapted_modules=adapted_module_names(self.model) if config.uses_adapter else [],
        )
        self.predicted_peak = self._emit_estimate()
        log.info("training %s of %s parameters for %d steps on %s", f"{trainable:,}", f"{total:,}", self.total_steps, self.device)

    def _emit_estimate(self) -> int | None:
        """Predict this run's peak memory (the GUI draws it beside the measured); None if it cannot."""
        model = self.config.model
        try:
            predicted = estimate(load_model_config(model.name_or_path, model.revision), self.config, self.device.type)
        except StudioError as exc:
            self.events.emit("warning", message=f"no memory estimate: {exc.message}", hint=exc.hint)
            return None
        self.events.emit("estimate", **predicted.to_json())
        return predicted.peak_bytes

    # ------------------------------------------------------------------ loop
    def train(self) -> str:
        """Run to the end or to a stop request; returns the final status."""
        schedule = self.config.schedule
        first_step = self.step
        while self.step < self.total_steps:
            if self.step == first_step + MEASURED_STEP:
                metrics = self._measured_optimizer_step()
            else:
                metrics = self._optimizer_step()
            self.step += 1
            if self.step % schedule.log_every == 0 or self.step == self.total_steps:
                self.events.emit("step", step=self.step, **metrics, memory=memory_snapshot())
            if self.control.stop_requested:
                self.save()
                return "stopped"
            if schedule.eval_every and self.step % schedule.eval_every == 0:
                self.evaluate()
            if schedule.save_every and self.step % schedule.save_every == 0 and self.step < self.total_steps:
                self.save()
        if self.eval_rows is not None and not (schedule.eval_every and self.step % schedule.eval_every == 0):
            self.evaluate()
        self.save()
        return "completed"

    def _measured_optimizer_step(self) -> dict:
        """One optimizer step with its peak memory tracked, compared with the prediction.

        The second step of a process is measured: the first allocates the optimizer
        state, so the second is the steady state the estimate describes.
        """
        tracker = tracker_for(self.device)
        with tracker:
            tracker.add_module(self.raw_model)
            tracker.add(state for state in self.optimizer.state.values())
            metrics = self._optimizer_step()
        measured = tracker.report.peak_bytes
        self.events.emit("memory_measured", step=self.step + 1, device=str(self.device), peak_bytes=measured,
                         peak_phase=tracker.report.peak_phase, predicted_bytes=self.predicted_peak)
        if self.predicted_peak:
            record_calibration(self.config, self.device.type, self.predicted_peak, measured)
        return metrics

    def _micro_batches(self) -> list[dict[str, torch.Tensor]]:
        accumulation = self.config.training.gradient_accumulation_steps
        first = self.step * accumulation
        pad = self.tokenizer.pad_token_id
        batches = []
        for index in range(first, first + accumulation):
            rows = [self.train_rows[i] for i in self.plan.rows_of(index)]
            batches.append({k: v.to(self.device) for k, v in collate(rows, pad).items()})
        return batches

    def _optimizer_step(self) -> dict:
        started = time.perf_counter()
        batches = self._micro_batches()
        target_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        self.model.train()
        loss_sum = 0.0
        for batch in batches:
            with self.accelerator.autocast():
                loss = token_loss_sum(self.model, batch) / max(target_tokens, 1)
            self.accelerator.backward(loss)
            loss_sum += loss.item()
        max_norm = self.config.training.max_grad_norm
        grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm if max_norm > 0 else float("inf"))
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        after_optimizer_step(self.raw_model, self.step)
        self.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - started
        tokens = sum(int(b["attention_mask"].sum()) for b in batches)
        samples = sum(len(b["input_ids"]) for b in batches)
        if not math.isfinite(loss_sum):
            raise StudioError(f"the loss became {loss_sum} at step {self.step + 1}",
                              "lower training.learning_rate, or use bf16 instead of fp16", kind="diverged")
        return {
            "epoch": round((self.step + 1) * len(batches) / self.plan.per_epoch, 4),
            "loss": loss_sum, "lr": lr, "grad_norm": float(grad_norm),
            "tokens_per_s": tokens / seconds, "samples_per_s": samples / seconds,
            "target_tokens": target_tokens, "step_seconds": seconds,
        }

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        size, pad = self.config.training.micro_batch_size, self.tokenizer.pad_token_id
        total_loss, total_tokens = 0.0, 0
        for start in range(0, len(self.eval_rows), size):
            batch = collate([self.eval_rows[i] for i in range(start, min(start + size, len(self.eval_rows)))], pad)
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with self.accelerator.autocast():
                total_loss += float(token_loss_sum(self.model, batch))
            total_tokens += int((batch["labels"][:, 1:] != -100).sum())
        eval_loss = total_loss / max(total_tokens, 1)
        self.events.emit("eval", step=self.step, eval_loss=eval_loss, tokens=total_tokens)
        return eval_loss

    def save(self) -> Path:
        path = ckpt.save_checkpoint(self.run_dir, self.step, self.raw_model,
                                    self.optimizer, self.scheduler, {"total_steps": self.total_steps})
        self.run_dir.prune_checkpoints(self.config.schedule.keep_checkpoints)
        self.events.emit("checkpoint", step=self.step, path=str(path))
        return path


def record_calibration(config: RunConfig, device_type: str, predicted: int, measured: int) -> None:
    """Keep predicted-vs-measured pairs per machine, for calibrating later estimates."""
    path = default_runs_root().parent / "memory-calibration.jsonl"
    entry = {"time": time.time(), "device": device_type, "model": config.model.name_or_path, "method": config.method,
             "predicted_bytes": predicted, "measured_bytes": measured}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
    except OSError as exc:  # a calibration record is never worth failing a run
        log.warning("cannot record memory calibration in %s: %s", path, exc)


def token_loss_sum(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token cross-entropy over the target tokens (labels != -100), in fp32."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, -batch["input_ids"].shape[1]:]  # prompt tuning prepends its virtual tokens' logits
    shifted = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    targets = batch["labels"][:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(shifted, targets, ignore_index=-100, reduction="sum")


# ---------------------------------------------------------------------- entry


def _setup_logging(run_dir: RunDir) -> None:
    logger = logging.getLogger("studio")
    logger.setLevel(logging.INFO)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    file_handler = logging.FileHandler(run_dir.log, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(file_handler)
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(logging.Formatter("[studio] %(message)s"))
    logger.addHandler(stream)
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").addHandler(file_handler)


def prepare_run_dir(config: RunConfig, run_dir: Path | None, resume: bool) -> tuple[RunConfig, RunDir, Path | None]:
    """The run directory to use, the config to run, and the checkpoint to resume from."""
    if resume:
        rd = RunDir(run_dir)
        if not rd.config.is_file():
            raise StudioError(f"{rd.path} is not a run directory (no config.yaml)", "pass the folder of an earlier run", kind="config")
        config = load_config(rd.config)
        raise_if_invalid(config, str(rd.config))
        return config, rd, rd.latest_checkpoint()
    raise_if_invalid(config)
    if run_dir is None:
        rd = RunDir.create(config.name)
    else:
        rd = RunDir(run_dir)
        if rd.events.exists():
            raise StudioError(f"{rd.path} already holds a run", "use --resume to continue it, or pick a new folder", kind="config")
        rd.path.mkdir(parents=True, exist_ok=True)
    save_config(config, rd.config)
    return config, rd, None


def run(config: RunConfig | None, run_dir: Path | None = None, resume: bool = False, watch_stdin: bool = True) -> tuple[int, RunDir]:
    """Train one run; returns (exit code, run directory).

    A config that cannot start raises StudioError before anything is loaded; every
    later failure becomes an ``error`` event and a non-zero exit code.
    """
    config, rd, checkpoint = prepare_run_dir(config, run_dir, resume)
    rd.clear_control_files()
    rd.write_worker_info(sys.argv)
    _setup_logging(rd)
    events = EventWriter(rd.events)
    control = StopController(rd, watch_stdin=watch_stdin)
    log.info("run directory %s", rd.path)
    if resume and checkpoint is None:
        events.emit("warning", message=f"{rd.path} has no complete checkpoint: training starts again from step 0")
    worker = Worker(config, rd, events, control)
    try:
        worker.setup(checkpoint)
        status = worker.train()
        events.emit("finished", status=status, step=worker.step)
        log.info("%s at step %d", status, worker.step)
        return EXIT_OK, rd
    except KeyboardInterrupt:
        events.emit("finished", status="aborted", step=worker.step)
        log.info("aborted")
        return EXIT_ABORTED, rd
    except StudioError as exc:
        _report(events, exc.kind, exc.message, exc.hint)
        return EXIT_FAILED, rd
    except torch.OutOfMemoryError as exc:
        _report(events, "oom", f"out of memory: {exc}", "run `studio fit` for a configuration that fits, or lower the micro-batch size")
        return EXIT_FAILED, rd
    except Exception as exc:  # report anything else readably; the traceback goes to the log
        log.error("%s", traceback.format_exc())
        _report(events, "internal", f"{type(exc).__name__}: {exc}", f"see {rd.log} for the full traceback")
        return EXIT_FAILED, rd
    finally:
        control.close()
        events.close()


def _report(events: EventWriter, kind: str, message: str, hint: str) -> None:
    log.error("%s\n  hint: %s", message, hint)
    events.emit("error", kind=kind, message=message, hint=hint)
    events.emit("finished", status="failed")
