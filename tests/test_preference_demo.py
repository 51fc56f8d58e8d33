"""``studio demo --objective dpo``: the embedded model learns a preference the base lacks, measured on held-out pairs
by ``studio eval`` (preference accuracy, margin, answers), named in the model card, and its exports reload."""

import contextlib
import io
import json
import shutil

import pytest
import torch
import yaml

from studio.cli import main
from studio.core.config import load_config
from studio.core.export.model_card import front_matter
from studio.core.presets import PREFERENCE_HELDOUT
from studio.core.run.directory import RunDir
from studio.core.run.evaluation import comparison_lines, summary, worst_first
from studio.core.run.events import read_events
from studio.train.evaluation.compare import evaluate_run
from studio.train.export.hf_format import export_run
from test_export import sample_batch, trained_logits

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The preference demo as the README runs it: (its run directory, what it printed)."""
    path = tmp_path_factory.mktemp("preference-demo") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["demo", "--objective", "dpo", "--run-dir", str(path)]) == 0
    return RunDir(path), printed.getvalue()


def test_the_demo_teaches_a_preference_the_base_model_lacks(demo):
    run_dir, printed = demo
    evaluation = next(e for e in read_events(run_dir.events) if e["type"] == "evaluation")
    base, tuned = evaluation["base"], evaluation["tuned"]
    assert base["pairs"] == tuned["pairs"] == 80
    assert base["preference_accuracy"] <= 0.1 and tuned["preference_accuracy"] >= 0.95  # held-out words
    assert base["margin"] < 0 < tuned["margin"]
    assert base["exact_match"] <= 0.1 and tuned["exact_match"] >= 0.9  # it answers in the chosen phrasing
    assert "preference accuracy" in printed and "fine-tuned" in printed
    samples = [e["samples"] for e in read_events(run_dir.events) if e["type"] == "samples"]
    assert not any(s["answer"].startswith("kind of") for s in samples[0])  # the base says "fruit ."
    assert all(s["answer"] == s["reference"].strip() for s in samples[-1])  # "kind of fruit ."


def test_the_evaluation_ranks_each_pair_as_the_objective_does_and_lists_the_weakest_first(demo, tmp_path):
    run_dir, _ = demo
    result = json.loads((run_dir.path / "evaluation.json").read_text())
    rows = result["rows"]
    assert [row["tuned"]["margin"] for row in rows] == sorted(row["tuned"]["margin"] for row in rows)
    row = rows[0]
    assert row["location"].startswith(f"{PREFERENCE_HELDOUT.name}:") and row["prompt"].endswith(" is a")
    assert row["reference"].startswith(" kind of") and not row["rejected"].startswith(" kind of")
    for model in ("base", "tuned"):
        scores = row[model]
        assert scores["margin"] == pytest.approx(scores["chosen_logp"] - scores["rejected_logp"])
        assert scores["loss_sum"] == pytest.approx(-scores["chosen_logp"])  # dpo ranks the summed log-probabilities
        assert result["summary"][model]["preference_accuracy"] == sum(r[model]["margin"] > 0 for r in rows) / 80
    # simpo (and orpo) rank the per-token mean: the same checkpoint evaluated as a simpo run
    simpo_run = tmp_path / "simpo"
    shutil.copytree(run_dir.path, simpo_run)
    config = yaml.safe_load((simpo_run / "config.yaml").read_text())
    (simpo_run / "config.yaml").write_text(yaml.safe_dump({**config, "objective": "simpo"}))
    by_row = {r["location"]: r for r in evaluate_run(simpo_run)["rows"]}
    again = by_row[row["location"]]
    assert again["tuned"]["chosen_logp"] == pytest.approx(row["tuned"]["chosen_logp"] / row["tokens"], rel=1e-4)
    assert again["tuned"]["loss_sum"] == pytest.approx(row["tuned"]["loss_sum"], rel=1e-4)


def pair_row(location: str, base_margin: float, tuned_margin: float) -> dict:
    def scores(margin):
        return {"loss_sum": 4.0, "chosen_logp": -4.0, "rejected_logp": -4.0 - margin, "margin": margin}
    return {"location": location, "prompt": "a fig is a", "reference": " kind of fruit .", "rejected": " fruit .",
            "tokens": 5, "base": scores(base_margin), "tuned": scores(tuned_margin)}


def test_the_console_names_pairs_the_tuned_model_ranks_the_wrong_way():
    ranked = worst_first([pair_row("pairs.jsonl:1", -1.0, 2.0), pair_row("pairs.jsonl:3", -1.0, -0.5)])
    assert [row["location"] for row in ranked] == ["pairs.jsonl:3", "pairs.jsonl:1"]
    result = {"checkpoint": "step-000001", "rows": ranked,
              "summary": {model: summary(ranked, model) for model in ("base", "tuned")}}
    assert result["summary"]["tuned"]["preference_accuracy"] == 0.5 and result["summary"]["base"]["margin"] == -1.0
    lines = comparison_lines(result, "RUN")
    assert lines[0] == "2 held-out pairs, 10 chosen-response tokens; checkpoint step-000001"
    assert "preference accuracy                   0.0%       50.0%   +50.0 pts" in lines
    assert ("weakest: pairs.jsonl:3: ranks the rejected ' fruit .' above the chosen ' kind of fruit .' (margin -0.5)"
            in lines)


def test_the_card_names_the_objective_and_its_data(demo):
    run_dir, _ = demo
    card = (run_dir.exports_dir / "adapter" / "README.md").read_text()
    assert "objective `dpo` (learning from preference pairs)" in card
    assert "| objective | DPO (sigmoid loss, beta 0.1, reference each_step) |" in card
    assert "preference_train.jsonl`" in card and "preference_heldout.jsonl` (eval)" in card
    assert "| train | 80 | 1,300 | 660 | preference |" in card  # the pairs, as they were tokenized
    assert "| preference accuracy | 0.0% | 100.0% |" in card and "On 80 held-out pairs" in card
    assert "dpo" in front_matter(card)["tags"]


def test_adapter_and_merged_exports_of_a_dpo_run_reload_with_the_same_logits(demo, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir, _ = demo
    config = load_config(run_dir.config)
    assert config.objective == "dpo"
    batch = sample_batch(config.model.name_or_path)
    trained = trained_logits(config, run_dir, batch)
    adapter = run_dir.exports_dir / "adapter"  # the demo exported it, verified on its training pairs
    assert json.loads((adapter / "studio_export.json").read_text())["verification"]["base_max_abs_diff"] > 1e-2
    with torch.no_grad():
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(config.model.name_or_path),
                                             str(adapter)).eval()(**batch).logits
    assert torch.allclose(reloaded, trained, atol=1e-5)
    merged, verification = export_run(run_dir.path, "merged", tmp_path / "merged", dtype="float32")
    assert verification.passed and verification.max_abs_diff < 1e-3
    with torch.no_grad():
        assert torch.allclose(AutoModelForCausalLM.from_pretrained(merged).eval()(**batch).logits, trained, atol=1e-4)
