"""Several processes (torchrun over gloo on the CPU), DeepSpeed ZeRO and FSDP, against plain training.

One plain reference run (1 process, accumulation 2) fixes the expected loss curve:
data parallel with 2 processes and accumulation 1 takes the same rows per optimizer
step, so every layout below must reproduce that curve (tolerance: 1e-4 relative,
the difference of summation orders in float32). Most layouts train STEPS steps; the
cluster bundle trains LONG_STEPS, so the reference trains that many once for all.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from helpers import losses, quick_config
from studio.core.config import save_config
from studio.core.memory.estimate import estimate
from studio.core.memory.sharding import ScaleOut, model_width
from studio.core.model.info import load_model_config
from studio.core.run.commands import EXIT_FAILED, EXIT_OK
from studio.core.run.directory import RunDir
from studio.core.run.events import read_events
from studio.core.validation import validate
from studio.gui.state.series import RunSeries
from studio.train.distributed.deepspeed_config import deepspeed_config
from studio.train.export.hf_format import export_run
from studio.train.worker import run

STEPS = 6
LONG_STEPS = 12  # the cluster bundle's run: long enough to stop after step 2 and resume
CLOSE = {"rel": 1e-4, "abs": 1e-5}


def config_for(data, processes: int, **distributed):
    return quick_config(data, training={"micro_batch_size": 4, "max_steps": STEPS, "gradient_accumulation_steps": 2 // processes},
                        schedule={"save_every": 3}, distributed={"num_processes": processes, **distributed})


def train_cli(config, folder, *extra) -> tuple[int, RunDir]:
    """``studio train`` in a subprocess, as a user (or the GUI) starts it."""
    folder.mkdir(parents=True, exist_ok=True)
    save_config(config, folder / "run.yaml")
    run_dir = RunDir(folder / "run")
    process = subprocess.run([sys.executable, "-m", "studio.train", str(folder / "run.yaml"), "--run-dir", str(run_dir.path), *extra],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    return process.returncode, run_dir


def resume_cli(run_dir: RunDir) -> int:
    return subprocess.run([sys.executable, "-m", "studio.train", "--resume", str(run_dir.path)], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600).returncode


def events_of(run_dir: RunDir, kind: str) -> list[dict]:
    return [e for e in read_events(run_dir.events) if e["type"] == kind]


def resumed_copy(run_dir: RunDir, folder) -> RunDir:
    """The run as if it had been stopped after its first checkpoint."""
    copy = RunDir(folder)
    shutil.copytree(run_dir.path, copy.path)
    shutil.rmtree(copy.latest_checkpoint())
    return copy


@pytest.fixture(scope="module")
def long_reference(small_data, tmp_path_factory) -> list[float]:
    """The plain run's losses for steps 1..LONG_STEPS (a constant learning rate: its first STEPS are those of a
    STEPS-step run)."""
    config = config_for(small_data, 1).replace(training={"max_steps": LONG_STEPS})
    code, run_dir = run(config, tmp_path_factory.mktemp("reference") / "run", watch_stdin=False)
    assert code == EXIT_OK
    return losses(run_dir)


@pytest.fixture(scope="module")
def reference(long_reference) -> list[float]:
    return long_reference[:STEPS]


def test_user_deepspeed_keys_win_over_the_generated_ones(small_data, tmp_path):
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"overlap_comm": True}, "gradient_clipping": 0.5}))
    config = config_for(small_data, 2, sharding="zero2", offload_optimizer="cpu", deepspeed_config=str(user))
    generated = deepspeed_config(config, world_size=2, hidden=64)
    assert generated["zero_optimization"] == {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 64 * 64,
                                              "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert generated["gradient_clipping"] == 0.5 and generated["train_batch_size"] == 4 * 1 * 2
    user.write_text(json.dumps({"zero_optimization": {"stage": 3}}))  # a stage the config does not say
    assert [p.where for p in validate(config)] == ["distributed.deepspeed_config"]


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_zero_s_reduce_bucket_is_sized_to_the_model_and_estimated_as_configured(small_data, sharding):
    """DeepSpeed allocates its reduce bucket whole on every GPU: at its default 5e8 elements, 2 GB in fp32 beside a
    tiny model (the first GPU run); studio sizes it hidden x hidden and the estimate counts what it configured."""
    config = config_for(small_data, 1, sharding=sharding)
    model_config = load_model_config(config.model.name_or_path)
    hidden = model_config["hidden_size"]
    zero = deepspeed_config(config, world_size=1, hidden=model_width(model_config))["zero_optimization"]
    assert zero["reduce_bucket_size"] == hidden * hidden
    assert ("stage3_prefetch_bucket_size" in zero) == (sharding == "zero3")
    predicted = estimate(model_config, config, "cuda", ScaleOut.from_config(config))
    assert predicted.devices[0].parts["communication"] == hidden * hidden * 4  # fp32 weights, fp32 bucket
    bf16 = config.replace(training={"precision": "bf16"})
    assert estimate(model_config, bf16, "cuda", ScaleOut.from_config(bf16)).devices[0].parts["communication"] == \
        hidden * hidden * 2


@pytest.mark.slow
def test_two_processes_equal_doubled_accumulation_and_stop_on_the_stop_file(small_data, tmp_path, reference):
    long = config_for(small_data, 2).replace(training={"max_steps": 400}, schedule={"save_every": 0})
    tmp_path.mkdir(exist_ok=True)
    save_config(long, tmp_path / "run.yaml")
    run_dir = RunDir(tmp_path / "run")
    process = subprocess.Popen([sys.executable, "-m", "studio.train", str(tmp_path / "run.yaml"), "--run-dir", str(run_dir.path)],
                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not any(e["step"] >= STEPS for e in events_of(run_dir, "step")):
        assert process.poll() is None, "the ranks ended before the stop"
        time.sleep(0.1)
    run_dir.request_stop()
    assert process.wait(timeout=300) == EXIT_OK
    stopped = events_of(run_dir, "finished")[-1]
    assert stopped["status"] == "stopped" and STEPS <= stopped["step"] < 400
    assert run_dir.latest_checkpoint().name == f"step-{stopped['step']:06d}"
    assert losses(run_dir)[:STEPS] == pytest.approx(reference, **CLOSE)

    # The data is tokenized once on this machine: rank 1 waits for rank 0 and reads what it saved.
    log = run_dir.log.read_text()
    assert log.count("rank 0 INFO data: tokenized") == 1
    assert log.count("rank 1 INFO data: read what this machine's first process tokenized") == 1

    # Every rank's memory is drawn: one curve per process.
    assert {e["device"] for e in events_of(run_dir, "memory_measured")} == {"cpu rank 0", "cpu rank 1"}
    assert set(RunSeries.from_events(read_events(run_dir.events)).memory) == {"cpu rank 0", "cpu rank 1"}

    # A rank that cannot resume (its random state is damaged) fails; the other does not hang.
    (run_dir.latest_checkpoint() / "rng-rank1.pt").write_bytes(b"damaged")
    assert resume_cli(run_dir) == EXIT_FAILED
    assert events_of(run_dir, "finished")[-1]["status"] == "failed"
    errors = events_of(run_dir, "error")
    assert len(errors) == 1 and errors[0]["message"].startswith(f"rank 1 on {errors[0]['host']}: ")


# DeepSpeed: stage x processes x offload, each value twice and each pair of values at least once; and FSDP.
SHARDED_RUNS = {
    "zero2-1proc": (1, {"sharding": "zero2"}),
    "zero3-1proc-offload": (1, {"sharding": "zero3", "offload_optimizer": "cpu"}),
    "zero2-2proc-offload": (2, {"sharding": "zero2", "offload_optimizer": "cpu"}),
    "zero3-2proc": (2, {"sharding": "zero3"}),
    "fsdp-2proc": (2, {"sharding": "fsdp"}),
}
HEAVY_RUNS = ("zero2-1proc", "zero3-1proc-offload", "zero2-2proc-offload")  # CI keeps two processes of ZeRO-3 and FSDP


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.heavy) if name in HEAVY_RUNS else name
                                  for name in SHARDED_RUNS])
def test_sharded_training_resumes_and_exports_like_plain_training(small_data, tmp_path, reference, name):
    processes, distributed = SHARDED_RUNS[name]
    sharding = distributed["sharding"]
    code, run_dir = train_cli(config_for(small_data, processes, **distributed), tmp_path)
    assert code == EXIT_OK, events_of(run_dir, "error")
    assert losses(run_dir) == pytest.approx(reference, **CLOSE)
    if sharding.startswith("zero"):
        assert json.loads((run_dir.path / "deepspeed.json").read_text())["zero_optimization"]["stage"] == int(sharding[-1])
    loading = events_of(run_dir, "run_started")[0]["loading_memory"]
    assert [entry["rank"] for entry in loading] == list(range(processes))
    assert all(entry["sharded"] == (sharding in ("zero3", "fsdp")) for entry in loading)
    if sharding in ("zero3", "fsdp") and processes == 2:  # built under zero.Init, or on meta but rank 0: each holds about half
        held = [int(line.rsplit("holds ", 1)[1].split(" ")[0].replace(",", "")) for line in run_dir.log.read_text().splitlines()
                if "loaded sharded" in line]
        total = events_of(run_dir, "run_started")[0]["total_params"]
        assert len(held) == 2 and all(h < 0.6 * total for h in held)

    resumed = resumed_copy(run_dir, tmp_path / "resumed")
    assert resume_cli(resumed) == EXIT_OK
    assert losses(resumed)[STEPS:] == pytest.approx(reference[3:], **CLOSE)

    _, verification = export_run(run_dir.path, "adapter" if processes == 1 else "merged")
    assert verification.passed


@pytest.mark.slow
@pytest.mark.heavy
def test_zero1_trains(small_data, tmp_path, reference):
    code, run_dir = train_cli(config_for(small_data, 1, sharding="zero1"), tmp_path)
    assert code == EXIT_OK and losses(run_dir) == pytest.approx(reference, **CLOSE)


def test_fsdp_in_one_process_is_refused_with_a_reason(small_data, tmp_path):
    code, run_dir = run(config_for(small_data, 1, sharding="fsdp"), tmp_path / "run", watch_stdin=False)
    assert code == EXIT_FAILED
    assert "FSDP needs several processes" in events_of(run_dir, "error")[0]["message"]
    # refused before accelerate marks the environment: later runs in this process must not turn into FSDP
    assert os.environ.get("ACCELERATE_USE_FSDP", "false") != "true"


@pytest.mark.slow
@pytest.mark.heavy  # test_bundle checks the bundle's files and layout; the two-process runs here cover stop, resume, export
@pytest.mark.skipif(sys.platform == "win32", reason="runs the bundle's .sh scripts")
def test_cluster_bundle_runs_as_two_machines_stops_resumes_and_exports(small_data, tmp_path, long_reference):
    """The bundle's node scripts as two "machines" on this one: two node ranks on localhost, one process
    each, sharing the bundle's run folder, against one process with doubled accumulation (the layout
    test_two_processes_... shows two processes on one machine match)."""
    from studio.core.run.bundle import write_bundle
    from studio.train.distributed.engine import free_port

    config = config_for(small_data, 2).replace(training={"max_steps": LONG_STEPS})
    bundle = write_bundle(config, ("127.0.0.1", "localhost"), 1, tmp_path / "bundle", port=free_port(),
                          python=sys.executable)
    run_dir = RunDir(bundle.folder / "run")

    def start_nodes(script: str) -> list[subprocess.Popen]:
        return [subprocess.Popen(["sh", str(bundle.folder / f"{script}-node-{rank}.sh")], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for rank in (0, 1)]

    nodes = start_nodes("launch")
    while not any(e["step"] >= 2 for e in events_of(run_dir, "step")):
        assert all(node.poll() is None for node in nodes), "a node ended before the stop"
        time.sleep(0.1)
    run_dir.request_stop()  # what the app does for a run it watches
    assert [node.wait(timeout=300) for node in nodes] == [EXIT_OK, EXIT_OK]
    stopped = events_of(run_dir, "finished")[-1]
    assert stopped["status"] == "stopped" and 2 <= stopped["step"] < LONG_STEPS
    assert run_dir.latest_checkpoint().name == f"step-{stopped['step']:06d}"
    assert events_of(run_dir, "run_started")[0]["world_size"] == 2

    assert [node.wait(timeout=300) for node in start_nodes("resume")] == [EXIT_OK, EXIT_OK]
    assert [e["status"] for e in events_of(run_dir, "finished")] == ["stopped", "completed"]
    assert events_of(run_dir, "run_started")[-1]["start_step"] == stopped["step"]
    assert losses(run_dir) == pytest.approx(long_reference, **CLOSE)  # steps 1..12, across the stop

    _, verification = export_run(run_dir.path, "adapter")
    assert verification.passed
