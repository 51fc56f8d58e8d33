"""``studio demo``: a real LoRA fine-tune of the embedded tiny model, then base vs tuned on held-out questions.

The base model was pretrained on plain facts ("a plum is a kind of fruit .") but has
never been asked a question (resources/build_demo_assets.py). The demo trains an
adapter like any other run, evaluates the base and the tuned model on held-out
questions ("What kind of thing is a guava?", `studio eval`) and exports the adapter.

``studio demo --objective dpo`` teaches a preference instead: DPO on pairs of two phrasings of a fact the base knows
("a guava is a" + " kind of fruit ." chosen, + " fruit ." rejected; resources/build_preference_pairs.py), measured
by the preference accuracy on held-out pairs and the greedy answers to their prompts, base vs tuned.
``studio demo --objective grpo`` teaches that phrasing from prompts and a format reward alone, measured by the reward
of the greedy answers to held-out prompts, base vs tuned.
``studio demo --vision`` teaches the embedded tiny vision-language model (random weights) to name the colour of a
small drawn shape (resources/build_vision_assets.py), measured by the exact match of its answers on held-out
drawings, base vs tuned; a full fine-tune, so it exports the merged model.
"""

from __future__ import annotations

import logging
from pathlib import Path

from studio.core.presets import demo_config, grpo_demo_config, preference_demo_config, vision_demo_config
from studio.core.run.commands import EXIT_OK
from studio.core.run.evaluation import comparison_lines
from studio.train.evaluation.compare import evaluate_run
from studio.train.export.hf_format import export_run
from studio.train.worker import run

log = logging.getLogger("studio.train")


DEMOS = {  # objective (or vision): (its config, what it teaches)
    "sft": (demo_config, "teach the embedded tiny model to answer questions about what it knows (LoRA)"),
    "dpo": (preference_demo_config, 'teach the embedded tiny model to prefer saying "a plum is a kind of fruit" '
                                    'to "a plum is a fruit" (DPO, LoRA)'),
    "grpo": (grpo_demo_config, 'teach the embedded tiny model, from prompts and a format reward alone, to write "a '
                               'plum is a kind of fruit ." (GRPO, LoRA)'),
    "vision": (vision_demo_config, "teach the embedded tiny vision-language model to name the colour of a drawn "
                                   "shape (a full fine-tune, its vision tower too)"),
}


def run_demo(run_dir: Path | None = None, demo: str = "sft") -> int:
    """Train, measure and export the demo ``demo`` (a key of DEMOS); returns the exit code."""
    make_config, teaches = DEMOS[demo]
    config = make_config()
    print(f"Finetune Studio demo: {teaches}")
    code, rd = run(config, run_dir, watch_stdin=False)
    if code != EXIT_OK or rd.latest_checkpoint() is None:
        print(f"training did not finish; see {rd.log}")
        return code or 1
    print("\n".join(comparison_lines(evaluate_run(rd.path), rd.path)))  # on its held-out questions, pairs or prompts
    export_run(rd.path, "adapter" if config.uses_adapter else "merged")  # logs where it went and how it verified
    print(f"run directory: {rd.path}")
    return 0
