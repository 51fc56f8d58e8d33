"""The ranks' watch over each other (studio.train.distributed.rankwatch), without launching processes: a peer on another
machine is judged by its heartbeat, an earlier attempt's records are ignored, and the right rank reports."""

import json
import time

import pytest

from studio.train.distributed import rankwatch


def write_presence(run_dir, rank: int, host: str, beat: int, started: float | None = None, pid: int = 999_999) -> None:
    folder = rankwatch.ranks_folder(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    entry = {"rank": rank, "host": host, "boot": 0, "pid": pid, "started": started or time.time(), "beat": beat,
             "ended": False}
    (folder / f"rank-{rank}.json").write_text(json.dumps(entry))


@pytest.fixture
def watch(tmp_path, monkeypatch):
    monkeypatch.setattr(rankwatch, "SILENT_AFTER_S", 0.3)
    failures = []
    watch = rankwatch.RankWatch(tmp_path, rank=0, world_size=2, on_failure=failures.append)
    watch.stop_watching()  # the test calls check() itself
    yield watch


def test_a_peer_on_another_machine_is_dead_when_its_heartbeat_stops(tmp_path, watch):
    write_presence(tmp_path, 1, "other-machine", beat=1)
    assert watch.check() is None  # first sight
    for beat in (2, 3, 4):  # beating: alive however long it takes
        time.sleep(0.15)
        write_presence(tmp_path, 1, "other-machine", beat=beat)
        assert watch.check() is None
    time.sleep(0.4)  # silent past SILENT_AFTER_S
    failure = watch.check()
    assert failure["rank"] == 1 and failure["host"] == "other-machine" and failure["kind"] == "killed"
    assert rankwatch.described(failure).startswith("rank 1 on other-machine: the process (pid 999999) ended")


def test_a_vanished_pid_on_this_machine_is_dead_at_once(tmp_path, watch):
    write_presence(tmp_path, 1, watch.host, beat=1, pid=2**22 + 12345)  # no such process
    presence = json.loads((rankwatch.ranks_folder(tmp_path) / "rank-1.json").read_text())
    presence["boot"] = watch.boot
    (rankwatch.ranks_folder(tmp_path) / "rank-1.json").write_text(json.dumps(presence))
    assert watch.check()["kind"] == "killed"


def test_records_of_an_earlier_attempt_are_ignored(tmp_path, watch):
    old = watch.started - 2 * rankwatch.EARLIER_ATTEMPT_S  # started: this (test) process's start, maybe long ago
    write_presence(tmp_path, 1, "other-machine", beat=1, started=old)
    rankwatch.record_failure(tmp_path, 1, "internal", "from before", "")
    failure_file = rankwatch.ranks_folder(tmp_path) / "rank-1.error.json"
    failure_file.write_text(json.dumps({**json.loads(failure_file.read_text()), "time": old}))
    time.sleep(0.4)
    assert watch.check() is None


def test_the_cause_wins_over_lost_contact_and_the_lowest_survivor_reports(tmp_path, watch):
    one, three = (rankwatch.RankWatch(tmp_path, rank=r, world_size=4, on_failure=lambda f: None) for r in (1, 3))
    for other in (one, three):
        other.stop_watching()
    rankwatch.record_failure(tmp_path, 1, rankwatch.LOST_CONTACT, "connection closed by peer", "")
    rankwatch.record_failure(tmp_path, 2, "oom", "out of memory in the forward pass", "")
    assert rankwatch.first_failure(rankwatch.read_failures(tmp_path))["rank"] == 2
    assert rankwatch.record_failure(tmp_path, 2, "internal", "a second record of rank 2", "") is False
    assert watch.reports({"rank": 2, "kind": "oom"}) and not three.reports({"rank": 2, "kind": "oom"})  # rank 0 does
    rankwatch.record_failure(tmp_path, 0, "killed", "ended without reporting an error", "")
    assert three.reports({"rank": 0, "kind": "killed"}) and not one.reports({"rank": 0, "kind": "killed"})
