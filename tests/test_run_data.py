"""The estimate for the run's own data: the largest micro-batch it trains, known before it starts."""

import json

import pytest

from helpers import quick_config
from studio.cli import main
from studio.core.config import save_config
from studio.core.memory.estimate import estimate
from studio.core.memory.run_data import config_for_longest_row, config_for_tokens, largest_micro_batch_tokens
from studio.core.model.info import load_model_config
from studio.core.run.events import read_events
from studio.train import worker
from studio.train.objectives import next_token


def test_packed_batches_count_their_rows_and_padded_ones_their_longest_row():
    lengths = [5, 30, 7, 12]
    batches = [[0, 1], [2, 3]]
    assert largest_micro_batch_tokens(lengths, batches, padded=False) == 35
    assert largest_micro_batch_tokens(lengths, batches, padded=True) == 60  # 2 x 30
    assert largest_micro_batch_tokens(lengths, [[2], [3], []], padded=True) == 12


def test_the_configs_the_run_s_own_peak_is_estimated_with():
    config = quick_config("data.jsonl").replace(data={"max_length": 512}, training={"micro_batch_size": 4})
    assert config_for_tokens(config, 1000).data.max_length == 250
    assert config_for_tokens(config, 10**6).data.max_length == 512  # never above the cut
    assert config_for_longest_row(config, 37).data.max_length == 37


@pytest.mark.parametrize("packing", ["padding_free", "none"])
def test_the_worker_s_prediction_is_its_largest_micro_batch(small_data, tmp_path, monkeypatch, packing):
    seen = []
    for name in ("pack", "collate"):  # record every micro-batch the worker trains (its objective makes them)
        original = getattr(next_token, name)
        monkeypatch.setattr(next_token, name, lambda rows, *args, _f=original: seen.append(_f(rows, *args)) or seen[-1])
    config = quick_config(small_data, data={"packing": packing, "max_length": 256},
                          training={"micro_batch_size": 4, "max_steps": 6, "gradient_accumulation_steps": 2})
    code, run_dir = worker.run(config, tmp_path / "run", watch_stdin=False)
    assert code == 0
    event = next(e for e in read_events(run_dir.events) if e["type"] == "estimate")
    trained = [batch["input_ids"].numel() for batch in seen if batch["input_ids"].shape[0] > 0]
    assert event["run_data"]["tokens"] == max(trained)
    assert event["run_data"]["tokens"] < 4 * 256  # its rows are shorter than max_length
    assert event["run_data"]["peak_bytes"] < event["peak_bytes"]

    config_file = tmp_path / "run.yaml"
    save_config(config, config_file)
    assert main(["estimate", str(config_file), "--data", "--json", "--device", "cpu"]) == 0


def test_studio_estimate_shows_the_run_s_own_peak_beside_the_worst_case(small_data, tmp_path, capsys):
    config = quick_config(small_data, data={"max_length": 512}, training={"micro_batch_size": 2, "max_steps": 4})
    config_file = tmp_path / "run.yaml"
    save_config(config, config_file)
    assert main(["estimate", str(config_file), "--data", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    tokens = result["run_data"]["tokens"]
    own = estimate(load_model_config(config.model.name_or_path), config_for_tokens(config, tokens)).peak_bytes
    assert result["run_data"]["peak_bytes"] == own < result["peak_bytes"]
    assert main(["estimate", str(config_file), "--data"]) == 0
    assert f"your data: its largest micro-batch holds {tokens:,} tokens" in capsys.readouterr().out


def test_fit_with_data_fits_the_longest_row_and_keeps_max_length(small_data, tmp_path, capsys):
    config = quick_config(small_data, data={"max_length": 4096}, training={"micro_batch_size": 2})
    config_file, fitted = tmp_path / "run.yaml", tmp_path / "fitted.yaml"
    save_config(config, config_file)
    worst = estimate(load_model_config(config.model.name_or_path), config).peak_bytes
    gpu = f"{worst * 0.6 / 2**20:.0f}MiB"  # less than every row at max_length needs, more than this data needs
    main(["fit", str(config_file), "--gpu-memory", gpu, "--json"])
    assert json.loads(capsys.readouterr().out)["changes"]  # the worst case needs savers
    assert main(["fit", str(config_file), "--gpu-memory", gpu, "--data", "--json", "--write", str(fitted)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["changes"] == [] and result["needed_bytes"] < worst * 0.6
    assert result["config"]["data"]["max_length"] == 4096 and "max_length: 4096" in fitted.read_text()
