"""The studio command as a user types it: readable errors, non-zero exits, nothing overwritten."""

import json
import subprocess
import sys

from studio.cli import main
from studio.core.presets import demo_config


def test_config_init_writes_a_valid_starter_and_never_overwrites(tmp_path, capsys):
    target = tmp_path / "my.yaml"
    assert main(["config", "init", str(target)]) == 0
    assert main(["config", "check", str(target)]) == 0
    assert "valid" in capsys.readouterr().out
    target.write_text("keep me")
    assert main(["config", "init", str(target)]) == 2
    assert target.read_text() == "keep me"
    assert "already exists" in capsys.readouterr().err


def test_config_check_lists_every_problem_with_lines(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: lorra\ntraining:\n  learning_rate: fast\n")
    assert main(["config", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "method (" in err and "bad.yaml:1" in err and "did you mean 'lora'" in err
    assert "training.learning_rate" in err and "bad.yaml:3" in err


def test_config_check_reports_missing_files(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{name_or_path: {demo_config().model.name_or_path}}}\ndata: {{train_files: [gone.jsonl]}}\n")
    assert main(["config", "check", str(config)]) == 2
    assert "data.train_files[0]" in capsys.readouterr().err


def test_train_without_config_explains_usage(capsys):
    assert main(["train"]) == 2
    assert "studio config init" in capsys.readouterr().err


def test_config_help_prints_the_field_reference():
    out = subprocess.run([sys.executable, "-m", "studio", "config", "--help"], capture_output=True, text=True).stdout
    assert "training.gradient_accumulation_steps" in out and "lora.use_dora" in out


def test_config_check_reads_the_data_too(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{name_or_path: {demo_config().model.name_or_path}}}\ndata: {{train_files: [rows.jsonl]}}\n")
    assert main(["config", "check", str(config)]) == 2
    assert "rows.jsonl:2" in capsys.readouterr().err


def test_config_check_names_the_rows_cut_before_their_response_and_says_the_rest_trains(tmp_path, capsys):
    long = {"instruction": "Repeat: " + "word " * 100, "output": "done"}
    short = {"instruction": "Hi", "output": "Hello"}
    rows = [short, long, long, short, long, long, long, short]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{name_or_path: {demo_config().model.name_or_path}}}\n"
                      "data: {train_files: [rows.jsonl], max_length: 64}\n")
    assert main(["config", "check", str(config)]) == 0
    out = capsys.readouterr().out
    assert "valid; 8 training rows" in out
    assert "warning: 5 of 8 training rows are left out: their response starts beyond the 64 tokens of " \
           "data.max_length" in out
    assert "(rows.jsonl:2: after " in out and "rows.jsonl:3: after" in out and "rows.jsonl:5: after" in out
    assert "; and 2 more)" in out and "rows.jsonl:6" not in out
    assert "hint: a run trains on the other 3 rows; to keep them, raise data.max_length to at least " in out


def test_config_check_says_when_no_tokenizer_measured_the_rows(tmp_path, capsys):
    import shutil

    model = tmp_path / "model"  # a SentencePiece tokenizer only: nothing here counts its tokens without the ML stack
    shutil.copytree(demo_config().model.name_or_path, model)
    (model / "tokenizer.json").rename(model / "tokenizer.model")
    (tmp_path / "rows.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    config = tmp_path / "run.yaml"
    config.write_text("model: {name_or_path: ./model}\ndata: {train_files: [rows.jsonl]}\n")
    assert main(["config", "check", str(config)]) == 0
    assert "note: the rows' token lengths are not checked" in capsys.readouterr().out


def test_config_check_reads_grpo_prompts_and_the_reward_file_opt_in(tmp_path, capsys):
    (tmp_path / "math.jsonl").write_text('{"prompt": "2+2?", "answer": "4"}\n{"prompt": "3+3?", "answer": "6"}\n')
    (tmp_path / "mine.py").write_text("def reward(completion, prompt, row):\n    return 1.0\n")
    config = tmp_path / "run.yaml"
    text = (f"model: {{name_or_path: {demo_config().model.name_or_path}}}\nobjective: grpo\n"
            "data: {train_files: [math.jsonl]}\ngrpo:\n  reward_file: mine.py\n")
    config.write_text(text)
    assert main(["config", "check", str(config)]) == 2
    assert "grpo.trust_reward_code" in capsys.readouterr().err
    config.write_text(text + "  trust_reward_code: true\n")
    assert main(["config", "check", str(config)]) == 0
    assert "valid; 2 training rows in prompt_only format" in capsys.readouterr().out
