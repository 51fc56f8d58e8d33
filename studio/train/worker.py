"""The training worker: one run, from a config to checkpoints, with events on the way.

Read top to bottom: ``Worker.setup`` loads data and model and restores a checkpoint
when resuming, ``Worker.train`` runs the optimizer loop, ``Worker.save`` writes a
checkpoint. Everything a viewer needs goes to ``events.jsonl`` (studio.core.run.events).

Data order is a pure function of the seed and the step, so a run resumed at step k
sees exactly the micro-batches an uninterrupted run would have seen from step k.
The loss of each optimizer step is the mean over all target tokens of its
micro-batches (not a mean of per-micro-batch means), which makes gradient
accumulation equal to a bigger batch.

With ``distributed.num_processes`` N > 1 the command launches itself N times
through torchrun (studio.train.distributed.launcher) and each process trains as one rank
(studio.train.distributed.engine): an optimizer step takes N x accumulation micro-batches
of the same plan, each rank its own contiguous share, so N processes equal one
process with N times the accumulation. Rank 0 writes the events and checkpoints;
the ranks agree on a stop at the same step. With ``distributed.pipeline_stages`` S the N
processes are N / S data replicas instead, each taking its share of the plan: each of a
replica's processes runs its stage of every micro-batch of the replica's share
(studio.train.distributed.pipeline), the last one computing the loss.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from studio.core.config import RunConfig, key_lines, load_config, save_config, to_dict
from studio.core.errors import StudioError, missing_package
from studio.core.machine import available_ram
from studio.core.memory.derived import TraceNeededError
from studio.core.memory.estimate import Estimate, estimate
from studio.core.memory.run_data import config_for_tokens, largest_micro_batch_tokens, most_image_patches
from studio.core.model.info import load_model_config
from studio.core.rewards import Rewards
from studio.core.run.commands import EXIT_ABORTED, EXIT_FAILED, EXIT_OK, inside_launcher, needs_launcher
from studio.core.run.directory import RunDir, default_runs_root
from studio.core.run.events import EventWriter
from studio.core.sizes import format_bytes
from studio.core.validation import machine_problems, raise_if_invalid
from studio.train import checkpoint as ckpt
from studio.train.control import StopController
from studio.train.data.images import (IMAGE_COLUMN, REJECTED_IMAGE_COLUMN, ImageRows, fills_image_slots,
                                     image_tiles, row_image_patches, tower_patch_size)
from studio.train.data.packed_attention import attend_packed
from studio.train.data.packing import example_count, length_grouped, packing_refusal, real_tokens
from studio.train.data.prepare import PreparedData, load_prepared, prepare_data, save_prepared, sequence_lengths
from studio.train.distributed.engine import leave_process_group, make_engine, process_rank
from studio.train.distributed.failure import FailureReporter, SilentEvents
from studio.train.distributed.launcher import launch, launched_by_studio
from studio.train.distributed.rankwatch import is_lost_contact
from studio.train.evaluation.exact_match import rewarded_answers
from studio.train.evaluation.samples import Sampler, why_no_samples
from studio.train.measure.memtrack import tracker_for
from studio.train.measure.metrics import describe_devices, device_readings, library_versions, memory_snapshot
from studio.train.measure.oom import (consistent_after, oom_report, overflowed_part, release_memory,
                                      simulated_memory_limit)
from studio.train.measure.trace import write_trace
from studio.train.model.build import adapted_module_names, build_model, count_parameters, load_base_model, load_tokenizer
from studio.train.model.layersplit import placement_of, run_scale_out
from studio.train.model.methods import adapter_regularization, after_optimizer_step
from studio.train.objectives import objective_for
from studio.train.objectives.rollout import GroupSampler, Rollout, held_out_rewards, rollout_metrics, sum_names
from studio.train.objectives.vllm_sampling import check_vllm_available
from studio.train.optim import build_scheduler
from studio.train.preflight import check_inputs
from studio.train.savers.host_weights import host_weights
from studio.train.tracking.writer import tracked_events

log = logging.getLogger("studio.train")

MEASURED_STEP = 1  # steps after the start (or resume) before the one whose memory is measured


@dataclass
class BatchPlan:
    """Which rows form micro-batch number ``index`` (counted across epochs)."""

    rows: int
    micro_batch_size: int
    seed: int
    lengths: list[int] | None = None  # given: each epoch is grouped by length (packing.length_grouped)

    def __post_init__(self):
        self.per_epoch = math.ceil(self.rows / self.micro_batch_size)
        self._epoch, self._order = -1, []

    def rows_of(self, index: int) -> list[int]:
        epoch, offset = divmod(index, self.per_epoch)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.rows, generator=generator).tolist()
            if self.lengths is not None:
                self._order = length_grouped(self._order, self.lengths, self.micro_batch_size)
        start = offset * self.micro_batch_size
        return self._order[start:start + self.micro_batch_size]

    @classmethod
    def for_rows(cls, config: RunConfig, train_rows) -> "BatchPlan":
        t = config.training
        if config.objective == "grpo":  # a batch: one process's prompts of a generation batch (a step's completions)
            return cls(len(train_rows), t.micro_batch_size * t.gradient_accumulation_steps // config.grpo.group_size,
                       t.seed)
        grouped = config.data.packing == "length_grouped"
        lengths = sequence_lengths(train_rows) if grouped else None
        return cls(len(train_rows), t.micro_batch_size, t.seed, lengths)

    def largest_micro_batch(self, config: RunConfig, train_rows, world_size: int,
                            padded: bool) -> tuple[int, tuple[int, ...]]:
        """The most tokens any micro-batch of the whole run holds, and the patches of the images of the micro-batch
        with the most (none without an image column: the estimate then counts no images, where its worst case has
        one in every row) (studio.core.memory.run_data)."""
        lengths = sequence_lengths(train_rows)
        count = config.training.gradient_accumulation_steps * world_size * self.total_steps(config, world_size)
        batches = [self.rows_of(i) for i in range(count)]
        images = ()
        if IMAGE_COLUMN in train_rows.column_names:
            model = load_model_config(config.model.name_or_path, config.model.revision)
            patch, tiles = tower_patch_size(model), image_tiles(model)
            patches = [row_image_patches({IMAGE_COLUMN: data}, patch, tiles) for data in train_rows[IMAGE_COLUMN]]
            if REJECTED_IMAGE_COLUMN in train_rows.column_names:  # a pair's images go with both its sequences
                patches = [images * 2 for images in patches]
            images = most_image_patches(patches, batches, fills_image_slots(model))
        return largest_micro_batch_tokens(lengths, batches, padded), images

    def total_steps(self, config: RunConfig, world_size: int = 1) -> int:
        t = config.training
        if t.max_steps:
            return t.max_steps
        if config.objective == "grpo":  # each process's generation batch is trained on num_iterations times
            return max(1, math.ceil(t.epochs * self.per_epoch / world_size)) * config.grpo.num_iterations
        return max(1, math.ceil(t.epochs * self.per_epoch / (t.gradient_accumulation_steps * world_size)))


NO_SPREAD_STEPS = 10  # steps in a row without a reward spread in any group before the worker says so


class Worker:
    def __init__(self, config: RunConfig, run_dir: RunDir, events: EventWriter, control: StopController):
        self.config = config
        self.run_dir = run_dir
        self.events = events
        self.control = control
        self.step = self.start_step = 0

    # ------------------------------------------------------------------ setup
    def setup(self, resume_from: Path | None) -> None:
        """The run's setup phases, in order: its inputs checked, then data, model, engine and restore."""
        reports = check_inputs(self.config, self.events)  # bad data or model files fail here, in seconds
        torch.manual_seed(self.config.training.seed)
        self.engine = make_engine(self.config, self.run_dir.path)  # first: the processes meet before the data
        self.device = self.engine.device
        self._check_cpu_ram()
        if self.config.objective == "grpo" and self.config.grpo.generation_backend == "vllm":
            check_vllm_available(cuda=self.device.type == "cuda")  # before the model loads, not after
        for problem in machine_problems(self.config, nvidia_gpu=self.device.type == "cuda"):  # trains, unverifiable
            self.events.emit("warning", message=f"{problem.where}: {problem.message}", hint=problem.hint)
        data = self._load_data(reports)
        self._build_model(resume_from)
        self._start_engine()
        self._restore(resume_from)
        self._precompute_reference()
        self._announce(data, resume_from)
        self.sampler = self._sampler()

    def _check_cpu_ram(self) -> None:
        """Refuse, before anything loads, a run whose CPU RAM (offloaded activations, weights kept there, ZeRO's
        offloaded state) this machine does not have free: it would be killed, or swap, far into the run."""
        model = self.config.model
        try:
            model_config = load_model_config(model.name_or_path, model.revision)
            needed = estimate(model_config, self.config, self.device.type, run_scale_out(self.config)).host_bytes
        except StudioError:  # no estimate (a model no family describes, not traced yet): _announce says so
            return
        if needed > (available := available_ram()):
            raise StudioError(f"this run needs {format_bytes(needed)} of CPU RAM for what it keeps there, and this "
                              f"machine has {format_bytes(available)} free",
                              "switch off a saver that keeps memory in CPU RAM (activation offload, the embedding or "
                              "output layer in CPU RAM, ZeRO offload), shorten data.max_length, or free CPU RAM",
                              kind="memory")

    def _load_data(self, reports) -> PreparedData:
        """The tokenizer and the tokenized data, made once per machine: its first process downloads and
        tokenizes, the others wait, then read the Hub cache and what it saved in ``prepared/``; and the order
        the rows are trained in."""
        engine = self.engine
        prepared = self.run_dir.path / "prepared" / f"machine-{os.environ.get('GROUP_RANK', '0')}"
        with engine.local_main_first():
            started = time.perf_counter()
            self.tokenizer = load_tokenizer(self.config)
            if engine.is_local_main:
                with_images = any(report is not None and report.image_rows for report in reports)
                image_rows = ImageRows.for_run(self.config, self.tokenizer) if with_images else None
                data = prepare_data(self.config, self.tokenizer, reports, image_rows)  # text alone: no image column
                if engine.world_size > 1:
                    save_prepared(data, prepared)
            else:
                data = load_prepared(prepared)
        how = "tokenized" if engine.is_local_main else "read what this machine's first process tokenized"
        log.info("data: %s in %.2f s (%d training rows)", how, time.perf_counter() - started, len(data.train))
        for message, hint in data.warnings:  # rows left out: named, with what keeps them
            log.warning("%s (%s)", message, hint)
            self.events.emit("warning", message=message, hint=hint)
        self.train_rows, self.eval_rows = data.train, data.eval
        self.plan = BatchPlan.for_rows(self.config, self.train_rows)
        self.total_steps = self.plan.total_steps(self.config, engine.replicas)
        return data

    def _build_model(self, resume_from: Path | None) -> None:
        """The model with its method and savers, built as the engine loads it; a resumed run's trained weights
        are restored before the engine wraps it (under ZeRO-3: one tensor at a time)."""

        def build(device: torch.device) -> torch.nn.Module:
            model = build_model(self.config, device, self.total_steps)
            if resume_from is not None:
                ckpt.load_weights(resume_from, model)
            return model

        self.raw_model = self.engine.load_model(build)  # for saving; accelerate's unwrap_model imports deepspeed
        self.parameters = count_parameters(self.raw_model)  # whole parameters, also of ZeRO-3's shards
        self.adapted = adapted_module_names(self.raw_model) if self.config.uses_adapter else []
        self.objective = objective_for(self.config, self.raw_model, self.tokenizer.pad_token_id, self._frozen_copy())
        self.rollout: Rollout | None = None  # grpo: the generation batch being trained on
        if self.config.objective == "grpo":
            self.sampler_of_groups = GroupSampler(self.config, self.tokenizer, Rewards.for_run(self.config.grpo))
            self._reported_failures: set[tuple] = set()
            self._steps_without_spread = 0  # in a row: steps whose groups all scored alike

    def _frozen_copy(self) -> torch.nn.Module | None:
        """The reference of full fine-tuning (dpo, kto), each step: the starting weights loaded again, frozen (also when
        resuming: the checkpoint's weights are the trained ones)."""
        if not self.config.frozen_reference:
            return None
        copy = load_base_model(self.config, self.device)
        copy.requires_grad_(False)
        return copy.eval()

    def _start_engine(self) -> None:
        """The optimizer and schedule, and the model and optimizer wrapped by the engine."""
        optimizer = self.engine.build_optimizer([p for p in self.raw_model.parameters() if p.requires_grad])
        # The scheduler stays unprepared: accelerate would step it once per process.
        self.scheduler = build_scheduler(self.config, optimizer, self.total_steps)
        self.model, self.optimizer = self.engine.prepare(self.raw_model, optimizer, first_forward=self._probe_packing)

    def _restore(self, resume_from: Path | None) -> None:
        """A resumed run's optimizer, schedule and step (its weights came with the model)."""
        if resume_from is not None:
            state = ckpt.load_checkpoint(resume_from, self.engine, self.scheduler)
            self.step = self.start_step = state["step"]
            if (kept := ckpt.load_rank_state(resume_from, self.engine.rank)) is not None:
                self.rollout = Rollout(**kept)  # grpo: the generation batch the next steps go on training on
            log.info("resumed from %s at step %d", resume_from, self.step)

    def _precompute_reference(self) -> None:
        """A reference's precomputed log-probabilities (dpo, kto): each row's, computed before the first step and kept
        in the run directory (a resumed run's weights are no longer the reference), then carried by the rows."""
        precomputed = self.config.preference.reference == "precomputed" and self.config.objective != "grpo"
        if not (self.config.uses_reference and precomputed):
            return
        path = self.run_dir.path / "reference-logps.pt"
        if path.is_file():
            kept = torch.load(path, weights_only=True)
        else:
            started = time.perf_counter()
            kept = {name: self._reference_of(rows) for name, rows in (("train", self.train_rows),
                                                                      ("eval", self.eval_rows)) if rows is not None}
            if self.engine.is_main:
                torch.save(kept, path)
            log.info("reference log-probabilities of every pair computed in %.1f s", time.perf_counter() - started)
        columns = self.objective.reference_columns
        self.train_rows = _with_reference(self.train_rows, kept["train"], columns)
        if self.eval_rows is not None:
            self.eval_rows = _with_reference(self.eval_rows, kept["eval"], columns)

    @torch.no_grad()
    def _reference_of(self, rows) -> torch.Tensor:
        """(rows, 2): the reference's summed log-probabilities of each row's two sequences (a pair's chosen and
        rejected response; an unpaired row's completion and its mismatched one)."""
        self.model.eval()
        size, found = self.config.training.micro_batch_size, []
        for start in range(0, len(rows), size):
            batch = self.objective.batch([rows[i] for i in range(start, min(start + size, len(rows)))], packed=False)
            with self.engine.autocast():
                found.append(torch.stack(self.objective.reference_logps(
                    self.model, {k: v.to(self.device) for k, v in batch.items()}), dim=1).float().cpu())
        return torch.cat(found)

    def _announce(self, data: PreparedData, resume_from: Path | None) -> None:
        """The run_started event, and the estimate beside what the run will measure."""
        trainable, total = self.parameters
        loading_memory = self.engine.loading_memory()
        self.events.emit(
            "run_started",
            config=to_dict(self.config), versions=library_versions(), devices=describe_devices(),
            run_dir=str(self.run_dir.path), pid=os.getpid(), total_steps=self.total_steps,
            start_step=self.step, resumed_from=str(resume_from) if resume_from else None,
            trainable_params=trainable, total_params=total, data=data.stats, world_size=self.engine.world_size,
            adapted_modules=self.adapted, placement=placement_of(self.raw_model), loading_memory=loading_memory,
        )
        self.predicted = self._emit_estimate()
        log.info("training %s of %s parameters for %d steps on %s", f"{trainable:,}", f"{total:,}", self.total_steps,
                 self.device)

    def _probe_packing(self, model) -> None:
        """Whether micro-batches are packed (then the model attends per example), else why not, in a warning."""
        self.packed = False
        images = IMAGE_COLUMN in self.train_rows.column_names
        if images:
            log.info("rows with images train in plain padded micro-batches (packing them is not supported yet)")
        if not self.config.packs_padding_free:
            return
        if images:
            self.events.emit("warning", message="rows with images are not packed yet: this run pads its micro-batches "
                             "instead (plain padded batches)", hint="set data.packing to none to silence this")
            return
        refusal = packing_refusal(model)
        if refusal is not None:
            self.events.emit("warning", message=f"{refusal}: this run pads its micro-batches instead",
                             hint="set data.packing to none to silence this")
            return
        attend_packed(model)
        self.packed = True

    def _emit_estimate(self) -> Estimate | None:
        """Predict this run's peak memory (the GUI draws it beside the measured); None if it cannot."""
        model = self.config.model
        try:
            model_config = load_model_config(model.name_or_path, model.revision)
            try:
                predicted = estimate(model_config, self.config, self.device.type, run_scale_out(self.config))
            except TraceNeededError:  # no family describes the model: trace its step (seconds, fake tensors)
                write_trace(self.config, neighbours=False)  # a run's settings are fixed: no toggles to answer
                predicted = estimate(model_config, self.config, self.device.type, run_scale_out(self.config))
        except StudioError as exc:
            self.events.emit("warning", message=f"no memory estimate: {exc.message}", hint=exc.hint)
            return None
        self.events.emit("estimate", **predicted.to_json(), run_data=self._run_data_peak(model_config))
        return predicted

    def _run_data_peak(self, model_config: dict) -> dict | None:
        """The estimate of the largest micro-batch this run will train (its data, its order), in tokens and bytes;
        None for grpo (its completions are not known before they are sampled)."""
        config = self.config
        if config.objective == "grpo":
            return None
        tokens, images = self.plan.largest_micro_batch(config, self.train_rows, self.engine.replicas, not self.packed)
        try:
            peak = estimate(model_config, config_for_tokens(config, tokens), self.device.type,
                            run_scale_out(config), images=images).peak_bytes
        except StudioError:
            return None
        return {"tokens": tokens, "peak_bytes": peak, **({"image_patches": sum(images)} if images else {})}

    # ------------------------------------------------------------------ loop
    def train(self) -> str:
        """Run to the end or to a stop request; returns the final status."""
        schedule = self.config.schedule
        first_step = self.step
        if self.step == 0:
            self._sample()  # the base model's answers
            if self.config.objective == "grpo" and self.eval_rows is not None:
                self.evaluate()  # the base model's held-out reward, which the run's is measured against
        while self.step < self.total_steps:
            if self.step == first_step + MEASURED_STEP:
                metrics = self._measured_optimizer_step()
            else:
                metrics = self._optimizer_step()
            self.step += 1
            if self.step % schedule.log_every == 0 or self.step == self.total_steps:
                self.events.emit("step", step=self.step, **metrics, memory=self._memory_of_every_rank())
            if self.engine.any_rank(self.control.stop_requested):
                self.save()
                return "stopped"
            if schedule.eval_every and self.step % schedule.eval_every == 0:
                self.evaluate()
            if schedule.save_every and self.step % schedule.save_every == 0 and self.step < self.total_steps:
                self.save()
            if schedule.sample_every and self.step % schedule.sample_every == 0:
                self._sample()
        if self.eval_rows is not None and not (schedule.eval_every and self.step % schedule.eval_every == 0):
            self.evaluate()
        if schedule.sample_every and self.step % schedule.sample_every:
            self._sample()
        self.save()
        return "completed"

    def _measured_optimizer_step(self) -> dict:
        """One optimizer step with its peak memory tracked, compared with the prediction.

        The second step of a process is measured: the first allocates the optimizer
        state, so the second is the steady state the estimate describes.
        """
        tracker = tracker_for(self.device)
        with tracker:
            tracker.add_module(self.raw_model, host=host_weights(self.raw_model))
            tracker.add(self.engine.optimizer_state())
            metrics = self._optimizer_step(tracker.phase)
        report = tracker.report
        mine = {"device": self._device_name(), "peak_bytes": report.peak_bytes, "peak_phase": report.peak_phase,
                "phase_bytes": dict(report.phase_peaks), **device_readings(self.device, tracker)}
        if tracker.host_report.peak_bytes:  # weights kept in CPU RAM, offloaded activations
            mine["host_bytes"] = tracker.host_report.peak_bytes
        # each reading beside the estimate of the same quantity (peak_bytes is the allocator's allocated): of this
        # process's stage in a pipeline
        own = self.predicted
        if own is not None and self.config.distributed.pipeline_stages:
            own = replace(own, devices=(own.devices[self.engine.stage],))
        predicted = {} if own is None else {
            "predicted_bytes": own.peak_bytes,
            **{f"predicted_{name}": value for name, value in own.predicted_readings().items()}}
        for measured in self.engine.gather({**mine, **predicted}):  # rank 0 writes every rank's measurement
            self.events.emit("memory_measured", step=self.step + 1, **measured)
        if predicted and self.engine.is_main:
            record_calibration(self.config, self.device.type, predicted["predicted_allocated_bytes"], mine["peak_bytes"])
        return metrics

    def _device_name(self) -> str:
        if self.engine.world_size == 1:
            return str(self.device)
        return str(self.device) if self.device.type == "cuda" else f"cpu rank {self.engine.rank}"

    def _memory_of_every_rank(self) -> list[dict]:
        if self.engine.world_size == 1:
            return memory_snapshot()
        entries = self.engine.gather(memory_snapshot(self.device, self.engine.rank))
        return [entry for rank_entries in entries for entry in rank_entries]

    def _micro_batches(self, phase) -> list[dict[str, torch.Tensor]]:
        """This rank's share of the step's micro-batches: a contiguous block of the plan (grpo: its generation
        batch, in micro-batches of completions)."""
        accumulation = self.config.training.gradient_accumulation_steps
        if self.config.objective == "grpo":
            rows, size = self._generation_batch(phase).rows, self.config.training.micro_batch_size
            chunks = [rows[start:start + size] for start in range(0, len(rows), size)]
        else:
            first = (self.step * self.engine.replicas + self.engine.replica) * accumulation
            chunks = [[self.train_rows[i] for i in self.plan.rows_of(index)] for index in range(first, first + accumulation)]
        return [{k: v.to(self.device) for k, v in self.objective.batch(rows, self.packed).items()} for rows in chunks]

    def _generation_batch(self, phase) -> Rollout:
        """grpo: the completions this step trains on: sampled anew every num_iterations steps (this process's prompts
        of the plan), with the sampling model's log-probabilities when they are trained on more than once."""
        iterations = self.config.grpo.num_iterations
        if self.rollout is not None and self.step % iterations:
            return self.rollout
        generation = self.step // iterations
        index = generation * self.engine.replicas + self.engine.replica
        prompts = [self.train_rows[i] for i in self.plan.rows_of(index)]
        with phase("generation"), self.engine.autocast():
            self.rollout = self.sampler_of_groups.rollout(self.raw_model, prompts, self.config.training.seed + index)
            if iterations > 1:
                self.model.train()
                for start in range(0, len(self.rollout.rows), self.config.training.micro_batch_size):
                    chunk = self.rollout.rows[start:start + self.config.training.micro_batch_size]
                    for row, logps in zip(chunk, self.objective.sampling_logps(self.raw_model, chunk, self.device)):
                        row["old_logps"] = logps
        self._report_rollout(self.rollout)
        return self.rollout

    def _report_rollout(self, rollout: Rollout) -> None:
        """The groups to show (a completions event) and the reward file's failures, each place once (the log has
        every one)."""
        self.events.emit("completions", step=self.step + 1, seconds=round(rollout.seconds, 3), groups=rollout.shown)
        for failure in rollout.failures:
            log.warning("%s", failure)
            key = (failure.file, failure.line, failure.error.split(":")[0])
            if key not in self._reported_failures:
                self._reported_failures.add(key)
                self.events.emit("warning", message=str(failure),
                                 hint="training goes on; this warning is not repeated for this line (train.log has "
                                      "every one): fix the file and resume to score them again")

    def _optimizer_step(self, phase=lambda name: contextlib.nullcontext()) -> dict:
        """One optimizer step over the step's micro-batches; ``phase(name)`` marks forward, backward and
        optimizer for a memory tracker."""
        started = time.perf_counter()
        batches = self._micro_batches(phase)
        engine = self.engine
        objective = self.objective
        # the mean is over the units (target tokens) of every rank
        target_tokens = int(engine.all_sum([sum(objective.units(b) for b in batches)])[0])
        self.model.train()
        if engine.pipeline is not None:
            with phase("forward"), engine.autocast():  # the schedule interleaves the stages' forwards and backwards
                loss_sum = engine.pipeline.step(batches, target_tokens)
        else:
            loss_sum = self._accumulate(batches, target_tokens, phase)
        lr = self.scheduler.get_last_lr()[0]
        with phase("optimizer"):
            grad_norm = engine.optimizer_step(after_step=lambda: after_optimizer_step(self.raw_model, self.step))
        self.scheduler.step()
        seconds = time.perf_counter() - started
        metrics = {**self._objective_metrics(target_tokens), **self._rollout_metrics()}
        loss_sum, tokens, samples = engine.all_sum([loss_sum, sum(real_tokens(b) for b in batches),
                                                    sum(example_count(b) for b in batches)])
        if not math.isfinite(loss_sum):
            raise StudioError(f"the loss became {loss_sum} at step {self.step + 1}",
                              "lower training.learning_rate, or use bf16 instead of fp16", kind="diverged")
        drawn = self.step // self.config.grpo.num_iterations + 1 if self.rollout is not None else \
            (self.step + 1) * len(batches)  # the plan's batches this step has reached
        return {
            "epoch": round(drawn * engine.replicas / self.plan.per_epoch, 4),
            "loss": loss_sum, "lr": lr, "grad_norm": float(grad_norm),
            "tokens_per_s": tokens / seconds, "samples_per_s": samples / seconds,
            "target_tokens": target_tokens, "step_seconds": seconds, **metrics,
        }

    def _accumulate(self, batches: list[dict[str, torch.Tensor]], target_tokens: int, phase) -> float:
        """Forward and backward of each micro-batch in turn, gradients accumulated; returns the step's loss."""
        engine = self.engine
        # Data parallel averages the ranks' gradients; scaling by the world size turns that into their sum.
        scale = engine.world_size / max(target_tokens, 1)
        loss_sum = 0.0
        for index, batch in enumerate(batches):
            last = index == len(batches) - 1
            with engine.micro_batch(last):
                with phase("forward"), engine.autocast():
                    batch_loss = self.objective.loss_sum(self.model, batch)
                    minimized = batch_loss * scale + adapter_regularization(self.raw_model) / len(batches)
                with phase("backward"):
                    engine.backward(minimized, last)
            loss_sum += batch_loss.item() / max(target_tokens, 1)
        return loss_sum

    def _objective_metrics(self, units: int) -> dict[str, float]:
        """The objective's metrics (TRL's names; eval ones are prefixed eval_, as TRL's) from its sums over every
        rank."""
        sums, names = self.objective.take_metric_sums(), self.objective.metric_sums
        totals = self.engine.all_sum([sums.get(name, 0.0) for name in names]) if names else []
        return self.objective.metrics(dict(zip(names, totals)), units)

    def _rollout_metrics(self) -> dict[str, float]:
        """grpo: its generation batch's rewards and completions (TRL's names), over every rank; else nothing."""
        if self.rollout is None:
            return {}
        names = sum_names(self.sampler_of_groups.rewards.names)
        sums = dict(zip(names, self.engine.all_sum([self.rollout.sums.get(name, 0.0) for name in names])))
        metrics = rollout_metrics(sums, self.sampler_of_groups.rewards.names)
        self._warn_without_spread(metrics)
        return {**metrics, "generation_s": round(self.rollout.seconds, 3)}

    def _warn_without_spread(self, metrics: dict[str, float]) -> None:
        """Say once when the groups' completions have all scored alike for NO_SPREAD_STEPS steps in a row: their
        advantages are all 0, so GRPO learns nothing while the run goes on."""
        alike = metrics.get("frac_reward_zero_std", 1.0) == 1.0
        self._steps_without_spread = self._steps_without_spread + 1 if alike else 0
        if self._steps_without_spread == NO_SPREAD_STEPS:
            reward = metrics.get("reward")
            scored = f"every completion of a group got the same reward ({reward:g} on average)" if reward is not None \
                else "no completion got a reward"
            self.events.emit("warning", message=f"steps {self.step + 2 - NO_SPREAD_STEPS} to {self.step + 1}: "
                             f"{scored}, so GRPO learns nothing from them",
                             hint="make a reward easier to earn (partial credit, a format reward beside the answer's), "
                                  "or sample more completions per prompt or at a higher temperature")

    @torch.no_grad()
    def evaluate(self) -> float:
        """Every rank evaluates every row (sharded models need all ranks in each forward); rank 0 reports."""
        if self.config.objective == "grpo":
            return self._evaluate_rewards()
        self.model.eval()
        size, objective = self.config.training.micro_batch_size, self.objective
        batches = [{k: v.to(self.device) for k, v in objective.batch(
            [self.eval_rows[i] for i in range(start, min(start + size, len(self.eval_rows)))], packed=False).items()}
            for start in range(0, len(self.eval_rows), size)]
        total_tokens = sum(objective.units(batch) for batch in batches)
        with self.engine.autocast():
            if self.engine.pipeline is not None:
                total_loss = self.engine.evaluated_loss_sum(batches)
            else:
                total_loss = sum(float(objective.loss_sum(self.model, batch)) for batch in batches)
        eval_loss = total_loss / max(total_tokens, 1)
        # every rank evaluated every row: the metrics are this rank's alone (all_sum would count them N times)
        metrics = {f"eval_{name}": value
                   for name, value in objective.metrics(objective.take_metric_sums(), total_tokens).items()}
        self.events.emit("eval", step=self.step, eval_loss=eval_loss, tokens=total_tokens, **metrics)
        return eval_loss

    def _evaluate_rewards(self) -> float:
        """grpo: each held-out prompt's greedy completion scored by the run's rewards; returns their mean (NaN when
        none was scored)."""
        rewards = self.sampler_of_groups.rewards
        self.model.eval()
        with self.engine.autocast():
            answered = rewarded_answers(self.raw_model, self.tokenizer, self.eval_rows, rewards,
                                        self.config.grpo.max_completion_length, self.config.training.micro_batch_size)
        self.model.train()
        means = held_out_rewards([scores for _, scores in answered], rewards.names)
        self.events.emit("eval", step=self.step, **means)
        return means.get("eval_reward", math.nan)

    def _sampler(self) -> Sampler | None:
        """What answers the sample prompts (in the first process), or None: no samples asked for, or a warning
        says why there are none."""
        if not (self.config.schedule.sample_every and self.engine.is_main):
            return None
        refusal = why_no_samples(self.config)
        if refusal is not None:
            self.events.emit("warning", message=refusal[0], hint=refusal[1])
            return None
        return Sampler(self.config, self.tokenizer)

    def _sample(self) -> None:
        """The sample prompts answered with the weights as they are now, as a samples event (by the first process
        alone: the others wait for it at the next step)."""
        if self.sampler is not None:
            with self.engine.autocast():
                self.events.emit("samples", step=self.step, **self.sampler.samples(self.raw_model))

    def save(self) -> Path:
        # a generation batch the next steps still train on goes with the checkpoint: a resume then trains on it
        reused = self.rollout is not None and self.step % self.config.grpo.num_iterations
        path = ckpt.save_checkpoint(self.run_dir, self.step, self.engine, self.raw_model, self.scheduler,
                                    {"total_steps": self.total_steps}, self.rollout.kept() if reused else None)
        if self.engine.is_main:
            self.run_dir.prune_checkpoints(self.config.schedule.keep_checkpoints)
        self.events.emit("checkpoint", step=self.step, path=str(path))
        return path


def _with_reference(rows, logps: torch.Tensor, columns: tuple[str, ...]):
    """The rows with their reference log-probabilities as ``columns`` (the objective's batches carry them)."""
    for index, column in enumerate(columns):
        rows = rows.add_column(column, logps[:, index].tolist())
    return rows


def record_calibration(config: RunConfig, device_type: str, predicted: int, measured: int) -> None:
    """Keep predicted-vs-measured pairs per machine, for calibrating later estimates: the tensors' peak, as the
    allocator counts it (allocated), both sides."""
    entry = {"time": time.time(), "device": device_type, "model": config.model.name_or_path, "method": config.method,
             "predicted_bytes": predicted, "measured_bytes": measured}
    try:
        path = default_runs_root().parent / "memory-calibration.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
    except (OSError, ModuleNotFoundError) as exc:  # never worth failing a run (nor is a missing platformdirs)
        log.warning("cannot record memory calibration: %s", exc)


# ---------------------------------------------------------------------- entry


def _setup_logging(run_dir: RunDir, rank: int | None = None) -> None:
    logger = logging.getLogger("studio")
    logger.setLevel(logging.INFO)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    file_handler = logging.FileHandler(run_dir.log, encoding="utf-8")
    who = "" if rank is None else f"rank {rank} "  # the ranks share one log
    file_handler.setFormatter(logging.Formatter(f"%(asctime)s {who}%(levelname)s %(message)s"))
    logger.addHandler(file_handler)
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(logging.Formatter(f"[studio{' ' + who.strip() if who else ''}] %(message)s"))
    logger.addHandler(stream)
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").addHandler(file_handler)


def prepare_run_dir(config: RunConfig | None, run_dir: Path | None, resume: bool,
                    config_file: Path | None = None) -> tuple[RunConfig, RunDir, Path | None]:
    """The run directory to use, the config to run (validated, once per process: refused with the lines of
    ``config_file`` or of the run's config.yaml) and the checkpoint to resume from."""
    if resume:
        rd = RunDir(run_dir)
        if not rd.config.is_file():
            raise StudioError(f"{rd.path} is not a run directory (no config.yaml)", "pass the folder of an earlier run", kind="config")
        config = load_config(rd.config)
        raise_if_invalid(config, str(rd.config), lines=key_lines(rd.config))
        return config, rd, rd.latest_checkpoint()
    if config_file is None:
        raise_if_invalid(config)
    else:
        raise_if_invalid(config, str(config_file), lines=key_lines(config_file))
    if inside_launcher():  # one of several ranks: the parent (or rank 0) prepares the folder
        rd = RunDir(run_dir)
        rd.path.mkdir(parents=True, exist_ok=True)
        if process_rank() == 0 and not rd.config.is_file():
            save_config(config, rd.config)
        return config, rd, None
    if run_dir is None:
        rd = RunDir.create(config.name)
    else:
        rd = RunDir(run_dir)
        if rd.events.exists():
            raise StudioError(f"{rd.path} already holds a run", "use --resume to continue it, or pick a new folder", kind="config")
        rd.path.mkdir(parents=True, exist_ok=True)
    save_config(config, rd.config)
    return config, rd, None


def run(config: RunConfig | None, run_dir: Path | None = None, resume: bool = False, watch_stdin: bool = True,
        config_file: Path | None = None) -> tuple[int, RunDir]:
    """Train one run; returns (exit code, run directory).

    A config that cannot start raises StudioError before anything is loaded; every
    later failure becomes an ``error`` event and a non-zero exit code. With
    ``distributed.num_processes`` > 1 this process prepares the run directory and
    launches the ranks (studio.train.distributed.launcher); inside torchrun it trains as its rank.
    """
    config, rd, checkpoint = prepare_run_dir(config, run_dir, resume, config_file)
    use_expandable_segments()
    rank = process_rank() if inside_launcher() else None
    if not launched_by_studio():  # the process the user (or the GUI) started, or a rank of a cluster bundle
        rd.clear_control_files()  # every rank: a stale STOP must not reach one before rank 0 clears it
        if not rank:
            rd.write_worker_info(sys.argv)
    _setup_logging(rd, rank)
    if resume and not rank and (torn := rd.remove_torn_checkpoints()):
        log.info("removed torn checkpoint folders left by an interrupted save: %s", ", ".join(torn))
    if needs_launcher(config.distributed.num_processes):
        return launch(rd, config.distributed.num_processes, resume, watch_stdin), rd
    events = tracked_events(rd, config) if not rank else SilentEvents()
    reporter = FailureReporter(events, rd, rank, int(os.environ.get("WORLD_SIZE", "1")))  # ranks: watches the others
    control = StopController(rd, watch_stdin=watch_stdin and rank is None)
    log.info("run directory %s", rd.path)
    if resume and checkpoint is None:
        events.emit("warning", message=f"{rd.path} has no complete checkpoint: training starts again from step 0")
    worker = Worker(config, rd, events, control)
    try:
        worker.setup(checkpoint)
        with simulated_memory_limit(worker.raw_model, worker.optimizer, worker.device):
            status = worker.train()
        events.emit("finished", status=status, step=worker.step)
        log.info("%s at step %d", status, worker.step)
        return EXIT_OK, rd
    except KeyboardInterrupt:
        reporter.aborted(worker.step)
        log.info("aborted")
        return EXIT_ABORTED, rd
    except StudioError as exc:
        reporter.failed(exc.kind, exc.message, exc.hint)
        return EXIT_FAILED, rd
    except torch.OutOfMemoryError as exc:
        _report_oom(reporter, worker, exc)
        return EXIT_FAILED, rd
    except Exception as exc:  # report anything else readably; the traceback goes to the log
        log.error("%s", traceback.format_exc())
        if (missing := missing_package(exc)) is not None:  # a package this run needs, imported where it is used
            reporter.failed(missing.kind, missing.message, missing.hint)
        elif rank is not None and is_lost_contact(exc):  # another rank went away: report its cause
            reporter.lost_contact(exc, worker.step)
        else:
            reporter.failed("internal", f"{type(exc).__name__}: {exc}", f"see {rd.log} for the full traceback")
        return EXIT_FAILED, rd
    finally:
        reporter.close()
        control.close()
        events.close()
        if rank is not None:  # a rank started by torchrun: its process ends next
            leave_process_group()


def _report_oom(reporter: "FailureReporter", worker: Worker, exc: torch.OutOfMemoryError) -> None:
    """Save the last finished step when the weights are still consistent (and saving needs no other
    rank, which may not have failed), then say what overflowed and the cheapest fix."""
    saved = None
    part = overflowed_part(exc)
    exc.__traceback__ = None  # its frames hold the activations that filled the memory
    alone = getattr(worker, "engine", None) is not None and worker.engine.world_size == 1
    if alone and consistent_after(part) and worker.step > worker.start_step:
        release_memory(getattr(worker, "optimizer", None))
        try:
            saved = worker.save()
        except (OSError, StudioError, torch.OutOfMemoryError) as save_error:
            log.error("could not save after running out of memory: %s", save_error)
    report = oom_report(exc, worker.config, getattr(worker, "device", None), saved)
    reporter.failed(report.pop("kind"), report.pop("message"), report.pop("hint"), step=worker.step, **report)


def use_expandable_segments() -> None:
    """Let the CUDA allocator grow segments instead of caching many sizes (less fragmentation with
    packed rows of varying width); read when CUDA allocates first. A user's own setting wins."""
    if torch.cuda.is_available() and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
