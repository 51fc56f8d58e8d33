"""Ready-made run configs: the embedded demos (answering, preferring a style, and learning a format from a reward)
that work offline on any machine; and what choosing an objective or a pipeline changes with it."""

from __future__ import annotations

from studio.core.config import RewardConfig, RunConfig
from studio.core.memory.placement import pipeline_replicas
from studio.core.runtime.environment import studio_source_root

RESOURCES = studio_source_root() / "resources"  # beside the studio package: a checkout, or the bundle's copy
DEMO_MODEL = RESOURCES / "models" / "studio-tiny"
DEMO_DATASETS = RESOURCES / "datasets"
DEMO_TRAIN = DEMO_DATASETS / "categories_instruction.jsonl"
DEMO_HELDOUT = DEMO_DATASETS / "categories_heldout.jsonl"
PREFERENCE_TRAIN = DEMO_DATASETS / "preference_train.jsonl"
PREFERENCE_HELDOUT = DEMO_DATASETS / "preference_heldout.jsonl"
GRPO_TRAIN = DEMO_DATASETS / "grpo_train.jsonl"
GRPO_HELDOUT = DEMO_DATASETS / "grpo_heldout.jsonl"
AGENT_CHAT = DEMO_DATASETS / "agent_chat.jsonl"
"""The demo task as agents and reasoning models are trained: a row of each kind (OpenAI tool calls, LLaMA-Factory's
function_call / observation, reasoning_content, <think> tags, a turn marked train: false)."""
VISION_MODEL = RESOURCES / "models" / "studio-tiny-vl"
SHAPES_TRAIN = DEMO_DATASETS / "shapes" / "shapes_train.jsonl"
SHAPES_HELDOUT = DEMO_DATASETS / "shapes" / "shapes_heldout.jsonl"
DEMO_FORMAT = r"kind of [a-z ]+ \."
"""The GRPO demo's format reward: the "kind of" phrasing of a fact, whole."""


# The data choices the demo model keeps when it is picked for data of the user's own (with its held-out rows go
# the samples of them while training).
_USERS_DATA = ("train_files", "eval_files", "eval_fraction", "sample_prompts", "format", "template", "train_on_prompt",
              "last_turn_only", "learn_reasoning")


def demo_config() -> RunConfig:
    """LoRA on the embedded tiny Llama: teaches it to answer questions about what it knows
    (see resources/build_demo_assets.py); held-out questions show its eval loss and, every 20 steps, its answers."""
    return RunConfig(name="demo").replace(
        model={"name_or_path": str(DEMO_MODEL)},
        data={"train_files": (str(DEMO_TRAIN),), "eval_files": (str(DEMO_HELDOUT),), "format": "auto", "max_length": 64},
        lora={"r": 8, "alpha": 16.0, "dropout": 0.0},
        training={"precision": "fp32", "micro_batch_size": 16, "gradient_accumulation_steps": 1,
                  "max_steps": 60, "learning_rate": 3e-3, "lr_scheduler": "cosine", "warmup_ratio": 0.05},
        schedule={"log_every": 1, "save_every": 20, "sample_every": 20},
    )


def preference_demo_config() -> RunConfig:
    """DPO with LoRA on the embedded tiny Llama: teaches it to prefer one phrasing of the facts it knows ("a plum is
    a kind of fruit .") to the other ("a plum is a fruit ."), both right and both in its pretraining
    (resources/build_preference_pairs.py); held-out pairs of words it was never shown measure the preference."""
    return demo_config().replace(
        name="preference-demo", objective="dpo",
        data={"train_files": (str(PREFERENCE_TRAIN),), "eval_files": (str(PREFERENCE_HELDOUT),)},
        # 15 steps: every held-out pair learned and answered so; beyond 20 the likelihood of the shared end
        # " ." + eos falls with the rejected answers' (DPO lowers both responses), and answers run on
        training={"max_steps": 15}, preference={"beta": 0.1}, schedule={"save_every": 0, "sample_every": 5})


def grpo_demo_config() -> RunConfig:
    """GRPO with LoRA on the embedded tiny Llama: from prompts alone ("a plum is a"), the model samples 8
    continuations of each, a format reward scores the "kind of fruit ." phrasing (the base writes it about one time in
    ten: it knows both, resources/build_preference_pairs.py), and the model learns to write it for held-out words."""
    return demo_config().replace(
        name="grpo-demo", objective="grpo",
        data={"train_files": (str(GRPO_TRAIN),), "eval_files": (str(GRPO_HELDOUT),), "max_length": 64},
        training={"max_steps": 30, "micro_batch_size": 8, "gradient_accumulation_steps": 2, "learning_rate": 1e-3},
        grpo={"group_size": 8, "max_completion_length": 12,
              "rewards": (RewardConfig(name="matches_format", pattern=DEMO_FORMAT),)},
        schedule={"save_every": 0, "sample_every": 0, "eval_every": 10})


def vision_demo_config() -> RunConfig:
    """A full fine-tune of the embedded tiny Qwen2-VL (random weights, resources/build_vision_assets.py), its vision
    tower and projector too (a random tower has nothing to keep): teaches it to name the colour of a small drawn
    shape; held-out drawings of every colour and shape measure it."""
    return demo_config().replace(
        name="vision-demo", method="full", model={"name_or_path": str(VISION_MODEL)},
        data={"train_files": (str(SHAPES_TRAIN),), "eval_files": (str(SHAPES_HELDOUT),)},
        vision={"train_projector": True, "train_vision_tower": True},
        training={"max_steps": 100, "learning_rate": 1e-2},
        schedule={"save_every": 0, "sample_every": 0, "eval_every": 20})


def objective_changes(config: RunConfig, objective: str) -> dict:
    """The changes that choosing ``objective`` makes: the objective, and for grpo a completion length that leaves
    half of data.max_length to the prompt when the one set leaves none (the window shows grpo's settings only once
    it is chosen, so one of them cannot be what keeps it from being chosen)."""
    changes: dict = {"objective": objective}
    if objective == "grpo" and config.grpo.max_completion_length >= config.data.max_length:
        changes["grpo"] = {"max_completion_length": max(1, config.data.max_length // 2)}
    return changes


def pipeline_changes(config: RunConfig, stages: int) -> dict:
    """The changes that setting the pipeline's stages makes: one process per stage of each of its data replicas
    (as many as before, one when there was no pipeline); when the pipeline goes off, one process per replica (a
    replica's processes were its stages)."""
    if stages:
        return {"distributed": {"pipeline_stages": stages, "num_processes": stages * pipeline_replicas(config)}}
    return {"distributed": {"pipeline_stages": 0, "num_processes": pipeline_replicas(config)}}


def pipeline_replicas_changes(config: RunConfig, replicas: int) -> dict:
    """The changes that setting the pipeline's data replicas makes: one process per stage of each."""
    return {"distributed": {"num_processes": config.distributed.pipeline_stages * replicas}}


def with_demo_model(config: RunConfig) -> RunConfig:
    """The demo preset: its tiny model and every setting it trains with (whatever ``config`` had: a 4-bit base,
    bf16 or savers meant for a big model), keeping the data ``config`` names, if any."""
    if not config.data.train_files:
        return demo_config()
    return demo_config().replace(data={name: getattr(config.data, name) for name in _USERS_DATA},
                                 schedule={"sample_every": config.schedule.sample_every})


def train_files_changes(config: RunConfig, files: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The data changes that make ``config`` train on ``files``: the demo's held-out questions go and come with
    the demo's data (they would measure nothing on data of the user's own)."""
    demo_held_out, changes = (str(DEMO_HELDOUT),), {"train_files": tuple(files)}
    if config.data.eval_files == demo_held_out and changes["train_files"] != (str(DEMO_TRAIN),):
        changes["eval_files"] = ()
    elif changes["train_files"] == (str(DEMO_TRAIN),) and not (config.data.eval_files or config.data.eval_fraction):
        changes["eval_files"] = demo_held_out
    return changes
