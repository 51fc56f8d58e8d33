"""Exports load with the plain libraries and reproduce the trained model; failed exports leave nothing."""

import json
import subprocess
import sys

import pytest
import torch

from helpers import quick_config
from studio.core.errors import StudioError
from studio.core.run.commands import EXIT_OK, read_export_record
from studio.core.run.directory import COMPLETE_MARKER
from studio.train.checkpoint import load_weights
from studio.train.export import hf_format as export_module
from studio.train.export.hf_format import export_run
from studio.train.model.build import build_model
from studio.train.worker import run

pytestmark = pytest.mark.slow


def trained_run(tmp_path_factory, data, name, **sections):
    config = quick_config(data, training={"max_steps": 6, "learning_rate": 1e-2}).replace(**sections)
    code, run_dir = run(config, tmp_path_factory.mktemp(name) / "run", watch_stdin=False)
    assert code == EXIT_OK
    return config, run_dir


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, small_data):
    return trained_run(tmp_path_factory, small_data, "lora")


def sample_batch(tokenizer_path) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return tokenizer(["What kind of thing is a plum?", "the cat is a"],
                     return_tensors="pt", padding=True)


@torch.no_grad()
def trained_logits(config, run_dir, batch):
    model = build_model(config, torch.device("cpu"))
    load_weights(run_dir.latest_checkpoint(), model)
    return model.eval()(**batch).logits


def test_adapter_loads_with_plain_peft_and_gives_the_same_logits(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config, run_dir = lora_run
    out, verification = export_run(run_dir.path, "adapter")
    assert out == run_dir.exports_dir / "adapter" and verification.passed and verification.exact
    assert {"adapter_config.json", "adapter_model.safetensors", COMPLETE_MARKER} <= {p.name for p in out.iterdir()}

    batch = sample_batch(config.model.name_or_path)
    base = AutoModelForCausalLM.from_pretrained(config.model.name_or_path)
    with torch.no_grad():
        reloaded = PeftModel.from_pretrained(base, str(out)).eval()(**batch).logits
    assert torch.allclose(reloaded, trained_logits(config, run_dir, batch), atol=1e-5)
    recorded = json.loads((out / "studio_export.json").read_text())["verification"]
    assert recorded["max_abs_diff"] < 1e-4 and recorded["base_max_abs_diff"] > 1e-2  # the adapter changed the model


def test_merged_fp32_loads_with_plain_transformers(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    config, run_dir = lora_run
    out, verification = export_run(run_dir.path, "merged", tmp_path / "merged", dtype="float32")
    assert verification.passed and verification.max_abs_diff < 1e-3
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    batch = sample_batch(out)
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out).eval()(**batch).logits
    assert torch.allclose(merged, trained_logits(config, run_dir, batch), atol=1e-4)


def test_merged_bf16_agrees_on_next_tokens(lora_run, tmp_path):
    _, run_dir = lora_run
    out, verification = export_run(run_dir.path, "merged", tmp_path / "merged16", dtype="bfloat16")
    assert not verification.exact and verification.top1_agreement >= 0.9 and verification.passed
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert read_export_record(out)["form"] == "merged model in bfloat16"  # not "full-precision"
    modes = {path.name: path.stat().st_mode & 0o777 for path in out.iterdir() if path.is_file()}
    assert len(set(modes.values())) == 1, modes  # the weights as readable as the rest (were 0600 among 0644)


def test_qlora_merges_into_a_16bit_base(tmp_path_factory, small_data, tmp_path):
    _, run_dir = trained_run(tmp_path_factory, small_data, "qlora", method="qlora")
    out, verification = export_run(run_dir.path, "merged", tmp_path / "qmerged", dtype="bfloat16")
    assert verification.passed
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_full_fine_tune_has_no_adapter_but_merges(tmp_path_factory, small_data, tmp_path):
    _, run_dir = trained_run(tmp_path_factory, small_data, "full", method="full", training={"max_steps": 2, "learning_rate": 1e-4})
    with pytest.raises(StudioError, match="no adapter"):
        export_run(run_dir.path, "adapter")
    _, verification = export_run(run_dir.path, "merged", tmp_path / "full", dtype="float32")
    assert verification.passed and verification.max_abs_diff < 1e-3


def test_a_failed_verification_leaves_no_folder_and_keeps_the_earlier_export(lora_run, monkeypatch):
    _, run_dir = lora_run
    out, _ = export_run(run_dir.path, "adapter")
    before = (out / "adapter_model.safetensors").read_bytes()

    def broken(*args, **kwargs):
        return export_module.Verification(1.0, 0.1, 1.0, True, False, 2)

    monkeypatch.setattr(export_module, "_verify", broken)
    with pytest.raises(StudioError, match="does not reproduce"):
        export_run(run_dir.path, "adapter")
    assert (out / "adapter_model.safetensors").read_bytes() == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["adapter"]


def test_export_before_any_checkpoint_says_what_to_do(tmp_path, small_data):
    from studio.core.config import save_config
    from studio.core.run.directory import RunDir

    run_dir = RunDir.create("empty", root=tmp_path)
    save_config(quick_config(small_data), run_dir.config)
    with pytest.raises(StudioError, match="no complete checkpoint"):
        export_run(run_dir.path, "adapter")


def test_the_console_of_an_export_holds_only_what_is_about_it(lora_run, tmp_path):
    """No import-time library warnings, deprecation notices or one progress bar per model loaded."""
    _, run_dir = lora_run
    done = subprocess.run([sys.executable, "-m", "studio", "export", str(run_dir.path), "--merged", "--dtype",
                           "bfloat16", "--out", str(tmp_path / "quiet")], capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_OK, done.stderr
    assert done.stderr == "", done.stderr
    assert [line.split(":")[0] for line in done.stdout.splitlines()] == ["exported merged to " + str(tmp_path / "quiet"),
                                                                         "form", "verified"]
