"""Every PEFT method trains the tiny model, checkpoints, and exports what it can, verified with plain peft."""

import json
import shutil

import pytest
import torch

from helpers import losses, quick_config
from studio.core.errors import StudioError
from studio.core.run.commands import EXIT_OK
from studio.core.run.events import read_events
from studio.train.checkpoint import load_weights
from studio.train.export.hf_format import export_run
from studio.train.model.build import build_model
from studio.train.model.methods import adapter_regularization
from studio.train.worker import run

pytestmark = pytest.mark.slow  # a run and two exports per method: a few seconds each

# Later losses over the first one. benchmarks/loss_margins.py shows each method's room across seeds, which
# stands in for the rounding of another CPU: 1.15x or more for every method.
METHOD_THRESHOLD = 0.85
# Each method's settings make 12 steps on 8 lines of text visibly memorize them. Prefix tuning levels off
# at a loss near 1.0 whatever its rate, so its room comes from the first loss: 64 virtual tokens start
# further from that floor than 20 do.
METHODS = {
    "ia3": {"training": {"learning_rate": 5e-2}},
    "adalora": {"training": {"learning_rate": 2e-2}},
    "loha": {"training": {"learning_rate": 1e-2}},
    "lokr": {"training": {"learning_rate": 1e-2}},
    "prefix_tuning": {"training": {"learning_rate": 2e-2}, "peft": {"num_virtual_tokens": 64}},
    "prompt_tuning": {"training": {"learning_rate": 3e-2}},
}
MERGEABLE = ("ia3", "adalora", "loha", "lokr")


@pytest.fixture(scope="module", params=list(METHODS))
def method_run(request, tmp_path_factory, story_data):
    method = request.param
    config = quick_config(story_data, method=method, data={"format": "text"}, schedule={"save_every": 6},
                          **METHODS[method])
    code, run_dir = run(config, tmp_path_factory.mktemp(method) / "run", watch_stdin=False)
    events = read_events(run_dir.events)
    assert code == EXIT_OK, [e for e in events if e["type"] == "error"]
    return method, config, run_dir, events


def test_loss_falls_and_the_run_says_what_it_trained(method_run):
    method, config, run_dir, events = method_run
    curve = losses(run_dir)
    assert len(curve) == 12
    assert sum(curve[-4:]) / 4 < METHOD_THRESHOLD * curve[0], f"{method}: loss did not fall: {curve}"
    started = events[0]
    assert 0 < started["trainable_params"] < started["total_params"] / 5
    expected = {"prompt_encoder"} if method.endswith("_tuning") else {"q_proj", "v_proj", "down_proj"}
    assert expected <= set(started["adapted_modules"])


def test_resuming_from_the_middle_repeats_the_uninterrupted_run(method_run, tmp_path):
    method, config, run_dir, _ = method_run
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir.path, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000012")
    events_file = resumed / "events.jsonl"
    events_file.write_text("".join(line for line in events_file.read_text().splitlines(keepends=True)
                                   if json.loads(line)["type"] != "finished"))
    code, resumed_dir = run(None, resumed, resume=True, watch_stdin=False)
    assert code == EXIT_OK
    steps = [e for e in read_events(resumed_dir.events) if e["type"] == "step"]
    after = [e["loss"] for e in steps if e["step"] > 6][-6:]
    assert after == pytest.approx(losses(run_dir)[6:], rel=1e-4), method


def test_adapter_export_reloads_with_plain_peft(method_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, config, run_dir, _ = method_run
    out, verification = export_run(run_dir.path, "adapter")
    assert verification.passed and verification.exact and verification.base_max_abs_diff > 1e-2
    batch = {"input_ids": torch.tensor([[5, 17, 42, 99, 7, 3]])}
    base = AutoModelForCausalLM.from_pretrained(config.model.name_or_path)
    trained = build_model(config, torch.device("cpu"), total_steps=12)
    load_weights(run_dir.latest_checkpoint(), trained)
    with torch.no_grad():
        reloaded = PeftModel.from_pretrained(base, str(out)).eval()(**batch).logits
        expected = trained.eval()(**batch).logits
    assert torch.allclose(reloaded, expected, atol=1e-5)


def test_merged_export_where_peft_can_merge(method_run, tmp_path):
    from transformers import AutoModelForCausalLM

    method, _, run_dir, _ = method_run
    if method not in MERGEABLE:
        with pytest.raises(StudioError, match="cannot be merged") as refused:
            export_run(run_dir.path, "merged", tmp_path / "merged")
        assert "--adapter" in refused.value.hint and not (tmp_path / "merged").exists()
        return
    out, verification = export_run(run_dir.path, "merged", tmp_path / "merged", dtype="float32")
    assert verification.passed and verification.max_abs_diff < 1e-3
    assert json.loads((out / "studio_export.json").read_text())["form"] == "merged model in float32 (full precision)"
    AutoModelForCausalLM.from_pretrained(out)  # plain transformers, no peft


def test_adalora_keeps_its_singular_vectors_orthogonal(small_data):
    """peft adds this penalty only to a loss it computes from labels; the worker adds it itself."""
    model = build_model(quick_config(small_data, method="adalora"), torch.device("cpu"), total_steps=12)
    penalty = adapter_regularization(model)
    penalty.backward()
    assert penalty > 0 and any(p.grad is not None and p.grad.abs().sum() > 0
                               for name, p in model.named_parameters() if "lora_A" in name)
    assert adapter_regularization(build_model(quick_config(small_data), torch.device("cpu"))) == 0.0
