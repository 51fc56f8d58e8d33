"""Faults injected on purpose: a killed worker, a killed window, a full disk, memory running out."""

import errno
import sys
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from helpers import quick_config
from studio.core.errors import StudioError
from studio.core.run.commands import EXIT_FAILED, EXIT_OK
from studio.core.run.events import read_events
from studio.train.measure.oom import SIMULATE_ENV, MemoryCap, consistent_after, overflowed_part
from studio.train.objectives.next_token import token_loss_sum
from studio.train.worker import run

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from kill_resume import kill_config, kill_loop  # noqa: E402


@pytest.mark.slow
def test_a_worker_killed_at_random_points_resumes_to_the_same_losses(tmp_path, small_data):
    report = kill_loop(kill_config(small_data, steps=16), tmp_path, kills=2, seed=3)
    assert report.kills == 2 and len(report.resumes) == 2
    assert report.missing_steps == [] and report.torn_left_at_end == []
    assert report.max_loss_error <= 1e-4


def _oom_config(small_data):
    # Rows longer than max_length, so every step has the same size and the estimate is exact.
    return quick_config(small_data, training={"max_steps": 3, "micro_batch_size": 16}, data={"max_length": 24})


@pytest.mark.slow
def test_running_out_of_memory_saves_the_last_step_and_suggests_a_fix_that_fits(tmp_path, small_data, monkeypatch):
    config = _oom_config(small_data)
    code, reference = run(config, tmp_path / "fits", watch_stdin=False)
    steady_peak = next(e for e in read_events(reference.events) if e["type"] == "memory_measured")["peak_bytes"]
    # Step 1 runs without the optimizer state; the second step, which holds it, no longer fits.
    monkeypatch.setenv(SIMULATE_ENV, f"{steady_peak - 300 * 1024}B")

    code, run_dir = run(config, tmp_path / "overflows", watch_stdin=False)
    assert code == EXIT_FAILED
    error = next(e for e in read_events(run_dir.events) if e["type"] == "error")
    assert error["kind"] == "oom" and error["part"] in ("the forward pass", "the loss over the logits", "the backward pass")
    assert error["part"] in error["message"] and "step 1 was saved" in error["hint"]
    assert [p.name for p in run_dir.complete_checkpoints()] == ["step-000001"]

    fix = error["fix"]
    assert fix["description"] in error["hint"] and fix["needed_bytes"] <= fix["gpu_bytes"]
    code, fixed = run(config.replace(**fix["changes"]), tmp_path / "fixed", watch_stdin=False)
    assert code == EXIT_OK, "the suggested change must fit the same memory"


class LogitsModel(torch.nn.Module):
    """Returns logits of a given vocabulary; ``scratch_bytes`` of extra work inside its forward."""

    def __init__(self, vocab: int, scratch_bytes: int = 0):
        super().__init__()
        self.vocab, self.scratch_bytes = vocab, scratch_bytes

    def forward(self, input_ids, attention_mask=None, **_):
        torch.ones(self.scratch_bytes // 4)
        return SimpleNamespace(logits=torch.randn(*input_ids.shape, self.vocab))


@pytest.mark.parametrize("scratch_bytes, part", [(4 * 2**20, "the forward pass"), (0, "the loss over the logits")])
def test_the_overflowing_part_is_read_from_where_memory_ran_out(scratch_bytes, part):
    batch = {"input_ids": torch.zeros(2, 64, dtype=torch.long), "labels": torch.zeros(2, 64, dtype=torch.long)}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    # The logits (256 KiB) fit; a 4 MiB forward does not, nor do the logits' loss temporaries.
    with pytest.raises(torch.OutOfMemoryError) as caught, MemoryCap(400 * 1024, "cpu"):
        token_loss_sum(LogitsModel(500, scratch_bytes), batch)
    assert overflowed_part(caught.value) == part


def test_only_a_failure_before_the_optimizer_step_leaves_weights_worth_saving():
    assert consistent_after("the backward pass") and not consistent_after("the optimizer step")


def _fail_on_call(original, failing_call: int, error: OSError):
    """``original``, except that call number ``failing_call`` writes half its file and raises ``error``."""
    calls = []

    def wrapper(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == failing_call:
            Path(path).write_bytes(b"half a file")
            raise error
        return original(obj, path, *args, **kwargs)
    return wrapper


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_stops_clearly_and_keeps_the_previous_one(tmp_path, small_data, monkeypatch):
    import studio.train.checkpoint as ckpt

    full = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ckpt.torch, "save", _fail_on_call(torch.save, 5, full))  # 3 files per checkpoint: the 2nd one
    config = quick_config(small_data, training={"max_steps": 6}, schedule={"save_every": 2})
    code, run_dir = run(config, tmp_path / "run", watch_stdin=False)
    assert code == EXIT_FAILED
    error = next(e for e in read_events(run_dir.events) if e["type"] == "error")
    assert error["kind"] == "disk" and "step-000004: the disk is full" in error["message"]
    assert "free disk space" in error["hint"]
    assert [p.name for p in run_dir.checkpoints_dir.iterdir()] == ["step-000002"]

    monkeypatch.undo()
    code, _ = run(None, run_dir.path, resume=True, watch_stdin=False)
    assert code == EXIT_OK and run_dir.latest_checkpoint().name == "step-000006"


@pytest.mark.slow
def test_a_read_only_export_folder_keeps_the_earlier_export(tmp_path, small_data, monkeypatch):
    import studio.core.run.directory as rundir
    from studio.train.export.hf_format import export_run

    code, run_dir = run(quick_config(small_data, training={"max_steps": 2}), tmp_path / "run", watch_stdin=False)
    first, _ = export_run(run_dir.path, "adapter")
    before = {p.name: p.read_bytes() for p in first.iterdir()}

    def read_only(folder):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(rundir, "_fsync_tree", read_only)
    with pytest.raises(StudioError, match="adapter: the drive is read-only"):
        export_run(run_dir.path, "adapter")
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert sorted(p.name for p in first.parent.iterdir()) == ["adapter"]


def test_readings_are_of_the_gpu_torch_uses_whatever_nvml_numbers_it(monkeypatch):
    """Under CUDA_VISIBLE_DEVICES=1 torch's cuda:0 is NVML's second GPU: NVML is asked for it by its UUID."""
    from studio.train.measure import metrics

    class Nvml:
        NVMLError = RuntimeError
        cards = {"GPU-bbbb": 7 * 2**30, "GPU-aaaa": 1 * 2**30}  # NVML's order: aaaa is its GPU 0

        def nvmlDeviceGetHandleByUUID(self, uuid):
            return uuid

        def nvmlDeviceGetHandleByIndex(self, index):
            return "GPU-aaaa"

        def nvmlDeviceGetMemoryInfo(self, handle):
            return SimpleNamespace(used=self.cards[handle], total=16 * 2**30)

    monkeypatch.setattr(metrics, "_nvml", lambda: Nvml())
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid="bbbb"))
    assert metrics._nvml_usage(0) == {"nvml_used_bytes": 7 * 2**30, "nvml_total_bytes": 16 * 2**30}
