"""Event files survive partial writes and crashes; checkpoints and exports are never seen half-written."""

import errno
import json
from pathlib import Path

import pytest

from studio.core.errors import StudioError
from studio.core.run.directory import COMPLETE_MARKER, RunDir, atomic_folder
from studio.core.run.events import EventReader, EventWriter, read_events, summarize


def test_reader_returns_only_complete_lines_across_split_writes(tmp_path):
    path = tmp_path / "events.jsonl"
    reader = EventReader(path)
    assert reader.read_new() == []  # the file does not exist yet
    line = json.dumps({"type": "step", "step": 1, "loss": 2.5}) + "\n"
    with open(path, "w") as f:
        f.write(line[:10])
        f.flush()
        assert reader.read_new() == []
        f.write(line[10:] + line[:5])
        f.flush()
        assert [e["step"] for e in reader.read_new()] == [1]
        f.write(line[5:])
    assert [e["step"] for e in reader.read_new()] == [1]


def test_a_torn_line_is_skipped(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"type": "step", "step": 1}\n{"type": "st\n{"type": "finished", "status": "completed"}\n')
    reader = EventReader(path)
    assert [e["type"] for e in reader.read_new()] == ["step", "finished"]


def test_writer_and_summary(tmp_path):
    writer = EventWriter(tmp_path / "events.jsonl")
    writer.emit("run_started", total_steps=10)
    writer.emit("step", step=3, loss=1.5)
    writer.emit("error", kind="oom", message="out of memory", hint="lower the batch")
    writer.emit("finished", status="failed")
    writer.close()
    summary = summarize(read_events(tmp_path / "events.jsonl"))
    assert (summary.status, summary.last_step, summary.last_loss, summary.total_steps) == ("failed", 3, 1.5, 10)
    assert summary.error == "out of memory"


def test_a_failed_atomic_write_leaves_no_folder_and_keeps_the_old_one(tmp_path):
    target = tmp_path / "exports" / "adapter"
    with atomic_folder(target) as staging:
        (staging / "weights").write_text("v1")
    assert (target / COMPLETE_MARKER).is_file()
    with pytest.raises(StudioError, match="cannot write .*adapter: the disk is full"):
        with atomic_folder(target, replace=True) as staging:
            (staging / "weights").write_text("v2 half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert (target / "weights").read_text() == "v1"
    assert sorted(p.name for p in target.parent.iterdir()) == ["adapter"]


def test_a_failed_swap_puts_the_earlier_folder_back(tmp_path, monkeypatch):
    target = tmp_path / "adapter"
    with atomic_folder(target) as staging:
        (staging / "weights").write_text("v1")
    real_rename = Path.rename

    def rename(self, to):
        if self.name.startswith(".staging-"):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_rename(self, to)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(StudioError, match="no permission"):
        with atomic_folder(target, replace=True) as staging:
            (staging / "weights").write_text("v2")
    assert (target / "weights").read_text() == "v1" and sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_only_complete_checkpoints_are_listed(tmp_path):
    run = RunDir.create("t", root=tmp_path)
    for step in (5, 10):
        with atomic_folder(run.checkpoint_path(step)) as staging:
            (staging / "state.json").write_text("{}")
    run.checkpoint_path(15).mkdir()  # torn: a crash before the marker
    (run.checkpoints_dir / ".staging-step-000020-1").mkdir()
    assert [p.name for p in run.complete_checkpoints()] == ["step-000005", "step-000010"]
    assert run.latest_checkpoint().name == "step-000010"
    run.prune_checkpoints(keep=1)
    assert [p.name for p in run.complete_checkpoints()] == ["step-000010"]


def test_run_directories_are_unique(tmp_path):
    first, second = RunDir.create("my run!", root=tmp_path), RunDir.create("my run!", root=tmp_path)
    assert first.path != second.path and first.path.name.startswith("my-run-")


def test_an_event_written_after_a_torn_line_is_read_whole(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"type": "step", "step": 1}\n{"type": "step", "st', encoding="utf-8")  # killed mid-write
    writer = EventWriter(path)
    writer.emit("run_started", start_step=1)
    writer.close()
    assert [e["type"] for e in read_events(path)] == ["step", "run_started"]


def test_resume_cleanup_removes_torn_checkpoints_and_keeps_complete_ones(tmp_path):
    rd = RunDir(tmp_path)
    with atomic_folder(rd.checkpoint_path(2)) as staging:
        (staging / "weights").write_text("w")
    rd.checkpoint_path(4).mkdir()  # renamed into place, killed before its COMPLETE marker
    (rd.checkpoints_dir / ".staging-step-000006-123").mkdir()
    assert rd.remove_torn_checkpoints() == [".staging-step-000006-123", "step-000004"]
    assert [p.name for p in rd.checkpoints_dir.iterdir()] == ["step-000002"]


def test_the_kept_history_of_a_resumed_run_drops_what_its_lost_steps_wrote():
    from studio.core.run.events import kept_history

    events = [{"type": "run_started", "start_step": 0}, *({"type": "step", "step": s} for s in (1, 2, 3)),
              {"type": "eval", "step": 3}, {"type": "warning", "message": "slow"},
              {"type": "run_started", "start_step": 2}, {"type": "step", "step": 3}]
    assert kept_history(events) == [events[0], events[1], events[2], events[5], events[6], events[7]]
