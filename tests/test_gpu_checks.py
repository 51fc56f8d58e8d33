"""The prepared GPU checks stay runnable: every config they train is one the worker accepts, and what a CPU can
run of them (the depth scaling, the random NF4 model, the time budgets, the results written as they come) runs."""

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_checks  # noqa: E402
from gpu_checks import check_config, checks, offload_comparison, offload_markdown  # noqa: E402
from studio.core.memory.estimate import estimate  # noqa: E402
from studio.core.validation import validate  # noqa: E402


@pytest.mark.parametrize("name, sections", checks(gpus=2).items())
def test_every_gpu_check_is_a_valid_run_config(name, sections):
    assert validate(check_config(sections)) == []


def test_the_checks_of_a_missing_package_are_skipped_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_checks.importlib.util, "find_spec", lambda name: None if name == "deepspeed" else True)
    jobs, skipped = gpu_checks.worker_jobs(1, tmp_path)
    assert {record["check"] for record in skipped} == {name for name in checks(1) if name.startswith("zero")}
    assert all("needs deepspeed" in r["status"] and "gpu_carry.py" in r["status"] for r in skipped)
    assert {job.name for job in jobs} == {name for name in checks(1) if not name.startswith("zero")}
    assert jobs[0].seconds == gpu_checks.SLOW_CHECK_SECONDS  # torch.compile starts first
    assert all((tmp_path / "runs" / gpu_checks.folder_name(job.name) / "run.yaml").is_file() for job in jobs)


def test_the_frontier_rows_are_valid_configs_the_estimate_fits_in_their_cards(tmp_path):
    from gpu_frontier import ROWS, SCALED_DEPTHS, plan_row, row_config
    from memory_frontier import MODELS, usable_gib

    planned = [plan_row(model, card) for model, card in ROWS]
    assert sorted((row.model, row.card_gb) for row in planned) == [("Llama-3.1-8B", c) for c in (8, 12, 24, 80)] + [
        ("Llama-3.3-70B", c) for c in (48, 80)]
    for row in planned:
        config = row_config(row.tokens, tmp_path)
        assert config.method == "qlora" and config.lora.r == 32 and config.training.lean_weights
        assert estimate(MODELS[row.model], config).peak_bytes <= usable_gib(row.card_gb) * 2**30 < estimate(
            MODELS[row.model], config.replace(data={"max_length": row.tokens + 64})).peak_bytes
    whole = {(row.model, row.card_gb) for row in planned if row.depths == (row.layers,)}
    assert ("Llama-3.1-8B", 8) in whole and ("Llama-3.1-8B", 80) not in whole
    assert all(row.depths == SCALED_DEPTHS for row in planned if (row.model, row.card_gb) not in whole)


def test_a_slower_gpu_measures_more_rows_at_two_depths():
    from gpu_frontier import ASSUMED_FLOPS, SCALED_DEPTHS, plan_row

    assert plan_row("Llama-3.1-8B", 12).depths == (32,)
    assert plan_row("Llama-3.1-8B", 12, ASSUMED_FLOPS / 10).depths == SCALED_DEPTHS == (2, 3)


def test_a_quantity_is_scaled_by_depth_along_the_line_through_two_depths():
    from gpu_frontier import scaled_measurement, scaled_to_depth

    assert scaled_to_depth({1: 100, 2: 130}, 32) == 100 + 31 * 30
    assert scaled_to_depth({2: 130, 4: 190}, 80) == 130 + 78 * 30
    assert scaled_to_depth({32: 7}, 32) == 7
    with pytest.raises(ValueError, match="two depths"):
        scaled_to_depth({2: 7}, 32)
    # each phase apart: the loss's forward holds a short model's peak, the growing backward a deep one's
    at_depths = {2: {"allocated": 100, "phases": {"forward": 100, "backward": 60}, "reserved": 150, "nvml_used": 700,
                     "host": 10},
                 3: {"allocated": 105, "phases": {"forward": 105, "backward": 80}, "reserved": 120, "nvml_used": 730,
                     "host": 20}}
    scaled = scaled_measurement(at_depths, 11)
    assert scaled["allocated"] == 240 and scaled["peak_phase"] == "backward" and scaled["phases"]["forward"] == 145
    assert scaled["host"] == 100
    # the allocator's cache does not follow the depth (here less reserved at 3 blocks than at 2, as on the first
    # GPU run): reserved and NVML's used are the allocated bytes and what they were beyond them at 3 blocks
    assert (scaled["reserved"], scaled["nvml_used"]) == (240 + 15, 240 + 625)


@pytest.mark.slow
def test_two_depths_of_the_random_nf4_model_scale_to_what_a_deeper_one_measures(tmp_path):
    """The frontier's method on the CPU: a row of the lean QLoRA step of a random NF4 model (bitsandbytes
    quantizes on the CPU too) measured at two and three blocks and scaled to four is what four blocks measure,
    phase by phase. Not from one block: a model of two blocks or more holds the next block's offloaded input,
    fetched back ahead in backward, which one block never does."""
    import bitsandbytes as bnb
    import torch

    from gpu_frontier import SCALED_DEPTHS, Row, measure_depth, measure_row, random_model, row_config, scaled_to_depth
    from model_factory import tiny_config

    cpu = torch.device("cpu")
    # wide and long enough that a block input outweighs a block's weights, as at the frontier's lengths
    model = tiny_config("llama", num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                        num_key_value_heads=2)
    row = Row("tiny llama", 1, 2048, 4, SCALED_DEPTHS)
    result = measure_row(row, model, tmp_path, cpu)
    assert result["status"] == "completed" and set(result["at_depths"]) == {2, 3}
    config = row_config(row.tokens, tmp_path)
    at = result["at_depths"]
    assert result["predicted"]["allocated"] > at[3]["predicted"]["allocated"] > at[2]["predicted"]["allocated"]
    deeper = measure_depth(config, model, 4, cpu)
    scaled = result["measured"]
    assert scaled["allocated"] == pytest.approx(deeper["allocated"], rel=0.01)
    for phase in ("forward", "backward", "optimizer"):
        assert scaled["phases"][phase] == pytest.approx(deeper["phases"][phase], rel=0.01), phase
    assert scaled["host"] == deeper["host"] > at[3]["host"]  # one offloaded block input more
    one_block = measure_depth(config, model, 1, cpu)
    from_one = scaled_to_depth({1: one_block["allocated"], 2: at[2]["allocated"]}, 4)
    assert from_one > 1.05 * deeper["allocated"]  # the input fetched ahead, counted once per block

    built = random_model(config, cpu, 2)
    quantized = [m.weight for m in built.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 2 * 7 and all(w.bnb_quantized and w.dtype == torch.uint8 for w in quantized)
    assert not any(t.is_meta for t in [*built.parameters(), *built.buffers()])


def test_the_offload_comparison_runs_on_the_cpu(tmp_path):
    """The GPU's offload rows, on a small model on the CPU: the offload saves device memory as predicted, and
    the host RAM it takes is what the estimate says."""
    import torch

    small = {"num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2}
    plain, offloaded = offload_comparison(torch.device("cpu"), tmp_path / "model", small, length=256, steps=1)
    assert offloaded["measured_mib"] < plain["measured_mib"]
    assert plain["host_predicted_mib"] == 0 and offloaded["host_measured_mib"] == offloaded["host_predicted_mib"] > 0
    assert "step time x" in offload_markdown([plain, offloaded])


HEADER = {"gpus": 1, "gpu": "NVIDIA H200", "gpu_mib": 143771, "driver": "580", "cuda": "13.0", "python": "3.12.3",
          "versions": {"torch": "2.11.0"}, "started": "now"}
FRONTIER_ROW = {"part": "frontier", "check": "Llama-3.1-8B, 8 GiB card, 11,983 tokens (whole)", "status": "completed",
                "seconds": 12.5, "fraction_enforced": True, "fits": True,
                "measured": {"allocated": 7 * 2**30, "reserved": 7.5 * 2**30, "nvml_used": 8 * 2**30, "host": 2**30,
                             "peak_phase": "forward"},
                "predicted": {"allocated": 6.5 * 2**30, "reserved": 6.8 * 2**30, "nvml_used": 7.3 * 2**30,
                              "host": 2**29}}


def test_results_are_written_again_after_every_check(tmp_path, capsys):
    results = gpu_checks.Results(tmp_path, dict(HEADER))
    assert json.loads((tmp_path / "gpu-checks.json").read_text())["records"] == []
    results.add(FRONTIER_ROW)
    assert "allocated 7.00 (estimate 6.50), reserved 7.50 (estimate 6.80), NVML used 8.00 (estimate 7.30)" in (
        capsys.readouterr().out)
    results.add({"part": "worker", "check": "qlora nf4", "status": "completed", "last_loss": 1.25, "seconds": 20})
    saved = json.loads((tmp_path / "gpu-checks.json").read_text())
    assert [r["check"] for r in saved["records"]] == [FRONTIER_ROW["check"], "qlora nf4"]
    page = (tmp_path / "gpu-checks.md").read_text()
    assert "1 x NVIDIA H200 (143771 MiB)" in page and "## Memory frontier" in page and "## Worker checks" in page
    assert "| 7.00 (6.50) | 7.50 (6.80) | 8.00 (7.30) | 1.00 (0.50) | forward | yes | yes | 12.5 |" in page
    assert "| qlora nf4 | completed | 1.2500 |" in page


def test_the_throughput_record_compares_tokens_per_wall_second_with_the_hf_trainer(tmp_path):
    sides = {name: {"tokens_per_wall_s": rate, "peak_bytes": 2**20, "final_loss": 2.0, "tokens_per_cpu_s": 1.0}
             for name, rate in (("hf_padded", 1000.0), ("hf_flat", 2000.0), ("ours", 3000.0))}
    summary = {"precision": "bf16", "steps": 12, "repeats": 1, "batch": 8, "lengths": [16, 256, "skewed"],
               "model": {}, "sides": sides}
    (tmp_path / "throughput.json").write_text(json.dumps(summary))
    record = gpu_checks.throughput_record(tmp_path / "throughput.json", gpu_checks.Outcome(0, 30.0, ""))
    assert record["status"] == "completed"
    assert record["sides"]["ours"] == {"tokens_per_s": 3000, "peak_mib": 1.0, "final_loss": 2.0, "vs_hf_padded": 3.0,
                                       "vs_hf_flat": 1.5}
    stopped = gpu_checks.throughput_record(tmp_path / "none.json", gpu_checks.Outcome(None, 90.0, "tail", "stopped"))
    assert stopped["status"] == "stopped" and stopped["error"] == "tail"


def python_job(name: str, code: str, seconds: float, rows: Path | None = None) -> "gpu_checks.Job":
    return gpu_checks.Job("test", name, [sys.executable, "-c", code], seconds,
                          lambda outcome: [{"part": "test", "check": name, "exit": outcome.exit,
                                            "status": outcome.stopped or "completed", "output": outcome.tail}], rows)


def test_jobs_are_stopped_at_their_budgets_and_their_rows_come_while_they_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_checks, "POLL_SECONDS", 0.1)
    monkeypatch.setattr(gpu_checks, "LEAST_SECONDS", 4)
    rows = tmp_path / "rows.jsonl"
    writer = (f"import json, time\nfor i in range(2):\n    open({str(rows)!r}, 'a').write(json.dumps("
              "{'part': 'test', 'check': f'row {i}', 'status': 'completed'}) + '\\n')\n    time.sleep(1)\n"
              "print('done')\n")
    seen = []

    class Recorder(gpu_checks.Results):
        def add(self, record):
            seen.append((record["check"], record["status"], time.monotonic()))
            super().add(record)

    results = Recorder(tmp_path / "out", dict(HEADER))
    started = time.monotonic()
    jobs = [python_job("writer", writer, 30, rows), python_job("sleeper", "import time; time.sleep(60)", 2),
            python_job("late", "print('never')", 30)]
    gpu_checks.run_jobs(jobs, results, started + 5.5, {**__import__("os").environ}, tmp_path, at_once=2)
    by_check = {check: (status, at - started) for check, status, at in seen}
    assert by_check["row 0"][1] < by_check["writer"][1]  # a row as it comes, before its process ends
    assert by_check["writer"][0] == "completed" and by_check["row 1"][0] == "completed"
    assert by_check["sleeper"][0] == "stopped at its time budget of 2 s" and by_check["sleeper"][1] < 4
    assert by_check["late"][0].startswith("skipped:")  # it would have started with under LEAST_SECONDS left
    assert [r["check"] for r in json.loads((tmp_path / "out" / "gpu-checks.json").read_text())["records"]] == [
        check for check, _, _ in seen]


def test_the_pipeline_checks_report_their_tokens_per_second_against_the_layer_split():
    steps = [{"type": "step", "tokens_per_s": rate} for rate in (10, 200, 220)]  # the first holds the set-up
    assert gpu_checks.steady_tokens_per_s(steps) == 210
    records = [{"part": "worker", "check": name, "status": "completed", "tokens_per_s": rate}
               for name, rate in ((gpu_checks.LAYER_SPLIT_CHECK, 100), ("pipeline of 2 stages over 2 GPUs, 1f1b", 170))]
    table = gpu_checks.worker_markdown(records)
    assert "| 170 (1.70x the layer split) |" in table and "| 100 |" in table


def test_a_depth_that_runs_out_of_memory_is_freed_before_the_next_is_measured(tmp_path, monkeypatch):
    """After an out-of-memory step the model and its tensors are freed when the allocator's cache is emptied, not
    after: the exception's traceback holds the step's frames until its except clause is left (the first GPU run
    then measured a failed step's tensors as part of the next depth's)."""
    import weakref

    import torch

    import gpu_frontier
    from model_factory import tiny_config

    model = tiny_config("llama", num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(model), encoding="utf-8")
    config = gpu_frontier.row_config(64, tmp_path)
    built, steps, alive_at_release = [], [], []
    real_model, real_steps, real_release = (gpu_frontier.random_model, gpu_frontier.run_optimizer_steps,
                                            gpu_frontier.release)

    def random_model(*args):
        made = real_model(*args)
        built.append(weakref.ref(made))
        return made

    def run_optimizer_steps(*args):
        steps.append(real_steps(*args))
        if len(steps) == 2:  # the measured step, after the warm-up
            raise torch.OutOfMemoryError("CUDA out of memory (on the CPU, for the test)")

    def release(device):
        alive_at_release.append(built[-1]() is not None)
        real_release(device)

    monkeypatch.setattr(gpu_frontier, "random_model", random_model)
    monkeypatch.setattr(gpu_frontier, "run_optimizer_steps", run_optimizer_steps)
    monkeypatch.setattr(gpu_frontier, "release", release)
    at_depths, failure = gpu_frontier.measure_depths(config, model, (2, 3), torch.device("cpu"))
    assert at_depths == {} and failure.startswith("out of memory at 2 blocks")
    assert alive_at_release == [False]
