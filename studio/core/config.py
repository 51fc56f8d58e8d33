"""The run configuration: one schema of frozen dataclasses, saved as YAML.

Every field carries its documentation in ``metadata["doc"]``; ``reference_markdown()``
turns it into docs/config.md and ``studio config --help`` prints the same text.
Loading collects every problem (type errors, unknown keys, bad choices) with its
field path and YAML line before raising once.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from studio.core.choices import (DataFormat, DpoLoss, GenerationBackend, GrpoLoss, LengthUnit, LoadIn, Method,
                                 Objective, Offload, Optimizer, Packing, PipelineSchedule, Precision, QatActivations,
                                 QatWeights, QuantType, ReferenceLogps,
                                 RewardName, Scheduler, Sharding, Template, Tracker, WeightDtype)
from studio.core.data.hub import is_hub_spec
from studio.core.errors import Problem, ProblemsError
from studio.core.methods import METHOD_SPECS, MethodSpec

SCHEMA_VERSION = 1



def _field(default: Any, doc: str, **kwargs: Any) -> Any:
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple for sequence defaults: the config is frozen")
    return field(default=default, metadata={"doc": doc, **kwargs})


@dataclass(frozen=True)
class ModelConfig:
    """Which base model to fine-tune and how to load it."""

    name_or_path: str = _field("", "Local model folder or Hugging Face Hub id (e.g. Qwen/Qwen2.5-0.5B).")
    revision: str = _field("", "Hub revision (branch, tag or commit); empty means the default branch.")
    dtype: WeightDtype = _field(
        "auto",
        "Dtype the weights are loaded in. auto: float32 for full fine-tuning (the optimizer needs "
        "fp32 master weights), the precision's 16-bit type for LoRA/QLoRA's frozen base.",
    )
    trust_remote_code: bool = _field(
        False, "Run Python code shipped with the model. Only for models you trust; off by default."
    )
    attn_implementation: Literal["sdpa", "eager"] = _field(
        "sdpa", "Attention kernel: sdpa (memory-efficient, default) or eager (plain matmuls)."
    )


@dataclass(frozen=True)
class DataConfig:
    """The training data and how it becomes tokens."""

    train_files: tuple[str, ...] = _field(
        (), "Training data files: .jsonl, .json, .csv, .parquet or .txt. Relative paths are read "
        "from the config file's folder. A Hub dataset: hub:OWNER/NAME, with an optional configuration "
        "and split, hub:OWNER/NAME@CONFIG:SPLIT (default split train), loaded through the datasets "
        "library and its cache."
    )
    format: DataFormat = _field(
        "auto",
        "Row format. instruction: alpaca instruction/input/output; chat: OpenAI messages "
        "(role/content; assistant tool_calls, tool turns and a tools column of JSON schemas; reasoning_content) or "
        "ShareGPT conversations (from/value; LLaMA-Factory's function_call and observation); prompt_completion: "
        "prompt/completion; "
        "text: plain text; preference: prompt/chosen/rejected pairs (TRL's preference rows, plain or conversational; "
        "without a prompt field, the turns chosen and rejected share are the prompt); unpaired_preference: "
        "prompt/completion/label rows (TRL's unpaired preference rows, for kto: label true marks a desirable "
        "completion, false an undesirable one); prompt_only: prompt rows, plain text or a list of messages, with an "
        "optional reference answer in answer, solution or reference (for grpo, which writes the completions; grpo "
        "reads instruction, chat and prompt_completion rows as prompts too, each row's answer its reference). auto "
        "detects it from the columns.",
    )
    template: Template = _field(
        "auto",
        "How instruction and chat rows are rendered. auto: the tokenizer's chat template if it has "
        "one, else chatml. tokenizer: require the tokenizer's template (given the row's tools). chatml / alpaca: "
        "built-in; chatml renders tools, tool calls and results, and reasoning in Qwen's convention (README).",
    )
    eval_files: tuple[str, ...] = _field((), "Held-out files for eval loss; empty: split off eval_fraction.")
    eval_fraction: float = _field(
        0.0, "Fraction of the training rows held out for eval loss when no eval_files are given (0 to 0.5)."
    )
    sample_prompts: tuple[str, ...] = _field(
        (), "Prompts the model answers while it trains (schedule.sample_every), asked the way the training rows ask; "
        "empty: the first three held-out rows, their reference answers shown beside."
    )
    max_length: int = _field(512, "Maximum tokens per example; longer examples are truncated (and counted).")
    train_on_prompt: bool = _field(
        False, "Also compute the loss on prompt tokens. Off: loss only on the response tokens."
    )
    last_turn_only: bool = _field(
        False, "Chat rows: learn only the last assistant turn (the earlier ones are context). Off: every assistant "
        "turn is learned, its tool calls included; tool results never are. Either way a turn marked train: false "
        "(or weight: 0) is not learned."
    )
    learn_reasoning: bool = _field(
        True, "Chat rows: learn an assistant turn's reasoning (its reasoning_content or thinking field, or the "
        "<think> tags in its content), rendered as the chat template renders it. Off: the reasoning, and the "
        "</think> closing it, is context the loss ignores; the answer after it is learned."
    )
    packing: Packing = _field(
        "padding_free",
        "How a micro-batch's examples are laid out. padding_free: end to end in one row, each attending "
        "only to itself (same examples and losses as none, no compute on padding; needs sdpa or eager attention; "
        "see docs/performance.md). length_grouped: padded, but micro-batches of similar lengths (changes "
        "which examples share a micro-batch). none: padded to the longest of the micro-batch.",
    )


@dataclass(frozen=True)
class LoraConfig:
    """Adapter settings: LoRA and QLoRA, and the shared ones of AdaLoRA, IA3, LoHa and LoKr."""

    r: int = _field(16, "Rank of the low-rank update: more capacity, more memory. AdaLoRA: the starting rank; "
                    "LoHa / LoKr: the rank of their factors.")
    alpha: float = _field(32.0, "Scaling numerator: the update is scaled by alpha/r (alpha/sqrt(r) with rsLoRA). "
                          "Also AdaLoRA, LoHa and LoKr.")
    dropout: float = _field(0.05, "Dropout on the adapter input; costs activation memory when > 0. "
                            "LoHa / LoKr: dropout of ranks. Unused by IA3 and the virtual-token methods.")
    target_modules: tuple[str, ...] = _field(
        ("all-linear",),
        "Module names to adapt (LoRA, QLoRA, AdaLoRA, IA3, LoHa, LoKr). all-linear: every linear layer of the "
        "transformer blocks, found per architecture (the output head excluded). IA3 scales the input of the "
        "MLP's output projection and the output of the others.",
    )
    use_rslora: bool = _field(False, "Rank-stabilized LoRA: scale by alpha/sqrt(r), better at high ranks.")
    use_dora: bool = _field(False, "DoRA: weight-decomposed LoRA; a little better, slower and more memory.")


@dataclass(frozen=True)
class PeftConfig:
    """Settings of the PEFT methods beyond LoRA (the lora section's rank, alpha, dropout and targets are shared)."""

    num_virtual_tokens: int = _field(
        20, "prefix_tuning / prompt_tuning: trained virtual tokens put in front of every sequence "
        "(prompt tuning: input embeddings; prefix tuning: keys and values of every layer)."
    )
    adalora_target_r: int = _field(
        4, "adalora: average rank per adapted layer left after pruning; it starts from lora.r and the least "
        "important ranks are pruned."
    )
    adalora_warmup_ratio: float = _field(
        0.1, "adalora: fraction of the steps trained at the full rank before pruning starts (peft's tinit)."
    )
    adalora_final_ratio: float = _field(
        0.2, "adalora: fraction of the steps at the end trained with the final ranks fixed (peft's tfinal)."
    )
    adalora_update_every: int = _field(1, "adalora: steps between two rank re-allocations (peft's deltaT).")


@dataclass(frozen=True)
class PreferenceConfig:
    """The preference objectives' settings (objective dpo, orpo, simpo or kto), named as TRL names them."""

    beta: float = _field(
        0.1, "dpo and kto: how far the model may move from the reference (higher: less; ipo: its regularization tau). "
        "orpo: the weight of the odds-ratio term beside the chosen rows' cross-entropy (the paper's lambda). "
        "simpo: the scale of the average log-likelihood margin.")
    dpo_loss: DpoLoss = _field(
        "sigmoid", "dpo: sigmoid (the paper's), ipo (squared, on per-token log-ratios), robust (for flipped labels, "
        "with label_smoothing) or hinge (SLiC). TRL's loss_type.")
    label_smoothing: float = _field(
        0.0, "dpo robust: the chance that a pair's label is flipped (0 to below 0.5). simpo: the same smoothing of "
        "its loss (TRL CPO's label_smoothing). Unused otherwise.")
    sft_weight: float = _field(
        0.0, "dpo and simpo: the weight of the chosen responses' cross-entropy (a token mean) added to the loss "
        "(dpo: TRL's loss_type sft beside sigmoid in loss_weights; simpo: TRL CPO's cpo_alpha). ORPO always adds it, "
        "weight 1.")
    simpo_gamma: float = _field(0.5, "simpo: the target reward margin (TRL CPO's simpo_gamma).")
    desirable_weight: float = _field(
        1.0, "kto: the weight of each desirable row's loss (label true). With more desirable than undesirable rows, "
        "lower it (or raise undesirable_weight) so that desirable_weight x their count over undesirable_weight x "
        "theirs is between 1 and 4/3, as the KTO paper advises.")
    undesirable_weight: float = _field(
        1.0, "kto: the weight of each undesirable row's loss (label false); see desirable_weight.")
    reference: ReferenceLogps = _field(
        "each_step", "dpo and kto: how the reference is had. each_step: run on every step, the base with the adapter off "
        "for adapter methods (no second copy), a frozen copy of the starting weights for full fine-tuning. "
        "precomputed: its log-probabilities of every pair computed once before the first step (TRL's "
        "precompute_ref_log_probs): no copy, no reference forward while training.")


@dataclass(frozen=True)
class RewardConfig:
    """One built-in reward of grpo.rewards: its name, its weight, and the settings of that reward (each reward reads
    only its own; validation refuses the others')."""

    name: RewardName = _field(
        "equals_reference", "equals_reference: 1 when the completion's answer equals the row's reference (answer, "
        "solution or reference column): the last \\boxed{...} of each, else the last number (1,234.0 equals 1234), "
        "else the text (case and surrounding space ignored); a reference after #### (GSM8K's) is what follows it. "
        "matches_format: 1 when the whole completion (stripped) matches pattern. length_within: 1 when the length "
        "is within min_length and max_length. contains: 1 when the completion contains text.")
    weight: float = _field(1.0, "What this reward counts for in the completion's total (a weighted sum).")
    pattern: str = _field(
        "", "matches_format: a Python regular expression the whole completion must match (re.fullmatch, . matching "
        "newlines too); write .*X.* to only ask for X somewhere.")
    min_length: int = _field(0, "length_within: the fewest characters or words (unit); 0: no lower limit.")
    max_length: int = _field(0, "length_within: the most characters or words (unit); 0: no upper limit.")
    unit: LengthUnit = _field("characters", "length_within: what min_length and max_length count.")
    text: str = _field("", "contains: the text the completion must contain.")
    case_sensitive: bool = _field(True, "contains: whether the case of text must match too.")


@dataclass(frozen=True)
class GrpoConfig:
    """GRPO's settings (objective grpo), named as TRL's GRPOConfig names them: the group of completions sampled per
    prompt, the rewards that score them, and the clipped loss."""

    group_size: int = _field(
        4, "Completions sampled per prompt (TRL's num_generations, 8 by default there); each is judged against its "
        "group's mean reward. At least 2: a group of one teaches nothing. A step's completions on each process "
        "(training.micro_batch_size x gradient_accumulation_steps) are whole groups: 4 fits the default micro-batch.")
    temperature: float = _field(
        1.0, "Sampling temperature of the completions; the log-probabilities of the loss are taken at it too, as TRL's.")
    top_p: float = _field(1.0, "Nucleus sampling: the smallest set of likeliest tokens whose probability reaches it "
                          "(1: all tokens).")
    max_completion_length: int = _field(
        256, "The most tokens a completion may have; dr_grpo also divides its loss by it. A prompt and its completion "
        "together are at most data.max_length: prompts longer than data.max_length minus this are left out, named "
        "(TRL's default is 512; 256 leaves 256 tokens of prompt in the default data.max_length).")
    loss_type: GrpoLoss = _field(
        "dapo", "How the per-token losses become one (TRL's loss_type). grpo: each completion's token mean, then the "
        "mean over completions. dr_grpo: their sum over completions x max_completion_length. dapo: their sum over "
        "the completion tokens of the step (token-level; TRL's default).")
    beta: float = _field(
        0.0, "The weight of the KL divergence to the reference (the model as it started; TRL's k3 estimator). 0, "
        "TRL's default: no reference is run.")
    epsilon: float = _field(0.2, "The clip range below: a token's probability ratio to the sampling model counts no "
                            "lower than 1 - epsilon where that would help it.")
    epsilon_high: float = _field(0.2, "The clip range above: no higher than 1 + epsilon_high (DAPO's clip-higher "
                                 "uses 0.28).")
    num_iterations: int = _field(
        1, "Optimization steps on each batch of sampled completions (TRL's num_iterations, the paper's mu); above 1, "
        "the sampling model's log-probabilities are kept for the clipped ratio.")
    rewards: tuple[RewardConfig, ...] = _field(
        (RewardConfig(),), "The built-in rewards and their weights, a list of sections: "
        "[{name: equals_reference, weight: 1}, {name: matches_format, pattern: '<think>.*</think>.*', weight: 0.5}]. "
        "Their fields are in the grpo.rewards table below.")
    reward_file: str = _field(
        "", "A Python file of your own with def reward(completion, prompt, row) returning a number or None "
        "(completion: the text; prompt: the row's text or its messages; row: a dict of all its columns, a supervised "
        "row's answer as its reference column; None: no reward), called once per completion; relative to the config's folder. It runs only with trust_reward_code.")
    reward_file_weight: float = _field(1.0, "What reward_file's reward counts for in the total.")
    trust_reward_code: bool = _field(
        False, "Run reward_file's code (as trust_remote_code runs a model's): it can do anything your user can. An "
        "exception in it gives that completion no reward from it and a warning naming the file, line and row.")
    generation_backend: GenerationBackend = _field(
        "hf", "What samples the completions. hf: HF generate with the weights being trained, the adapter on (no "
        "second copy, any device). vllm: vLLM on an NVIDIA GPU (pip install vllm), with its own copy of the base "
        "model and the run's LoRA adapter handed to it after each optimizer step; LoRA (not DoRA or rsLoRA) in one "
        "process. Seeded by the step as hf is, so a resume samples alike; vLLM's kernels are not HF's, so its "
        "completions differ from hf's.")
    vllm_memory_fraction: float = _field(
        0.3, "vllm: the share of the GPU's memory vLLM takes at the start for its copy of the weights and its KV "
        "cache pool (its gpu_memory_utilization); training has the rest.")


@dataclass(frozen=True)
class VisionConfig:
    """Vision-language models: which parts beside the language model train, and the images' resolution."""

    train_vision_tower: bool = _field(
        False, "Train the vision tower (the image encoder) too. Off: its weights stay as loaded, frozen; LoRA adapts "
        "the language model's linears alone. On: the tower's weights train whole (full fine-tuning, or beside LoRA; "
        "such a run exports merged: an adapter does not carry them).")
    train_projector: bool = _field(
        False, "Train the projector (the layers that map image features into the language model) too, whole; "
        "the same rules as train_vision_tower.")
    max_pixels: int = _field(
        0, "The most pixels an image keeps: the image processor resizes larger ones down (keeping the aspect), "
        "and an image's tokens fall with its area (Qwen2-VL: one token per 28x28 pixels). 0: the processor's own "
        "limit (its preprocessor_config.json). Lowering it saves the vision tower's and the language model's "
        "memory for each image. Idefics3 and SmolVLM: it sets the longest edge images are scaled to, in whole tiles "
        "(one at the least). Gemma 3 and LLaVA resize every image to their vision tower's one size: it changes "
        "nothing there.")


@dataclass(frozen=True)
class QatConfig:
    """Quantization-aware training with torchao: the block linears compute with fake-quantized numbers."""

    weights: QatWeights = _field(
        "none", "Fake-quantize the weights of the decoder blocks' linear layers to int4 or int8 (symmetric, one "
        "scale per group) during training, so that the model learns to work quantized; none: no QAT. The merged "
        "export is then the really quantized model (torchao). Under an adapter the frozen base is fake-quantized."
    )
    activations: QatActivations = _field(
        "none", "Also fake-quantize the linears' inputs to int8 (dynamic, asymmetric, per token); needs weights."
    )
    group_size: int = _field(32, "Weights per quantization scale; must divide the linears' input width.")

    @property
    def enabled(self) -> bool:
        return self.weights != "none"


@dataclass(frozen=True)
class QuantizationConfig:
    """Loading the frozen base model quantized with bitsandbytes (QLoRA)."""

    load_in: LoadIn = _field(
        "auto", "Quantize the base weights: 4bit, 8bit or none. auto: 4bit for qlora, none otherwise."
    )
    quant_type: QuantType = _field("nf4", "4-bit data type: nf4 (normal float, QLoRA's default) or fp4.")
    double_quant: bool = _field(True, "Quantize the 4-bit scales too: saves about 0.4 bits per parameter.")


@dataclass(frozen=True)
class TrainingConfig:
    """The optimization loop."""

    precision: Precision = _field(
        "bf16", "Compute precision: bf16 or fp16 autocast (mixed precision), or fp32."
    )
    gradient_checkpointing: bool = _field(
        False, "Recompute activations in the backward pass: much less memory, about 30 % slower."
    )
    micro_batch_size: int = _field(4, "Examples per forward/backward pass.")
    gradient_accumulation_steps: int = _field(
        1, "Micro-batches per optimizer step; effective batch = micro_batch_size x this."
    )
    epochs: float = _field(1.0, "Passes over the training data (used when max_steps is 0).")
    max_steps: int = _field(0, "Optimizer steps to run; 0 means derive from epochs.")
    optimizer: Optimizer = _field(
        "adamw",
        "adamw (16 bytes per trainable parameter with its weight and gradient), adamw_8bit and "
        "paged_adamw_8bit (bitsandbytes, 6 bytes less), sgd (momentum), adafactor (factored, least).",
    )
    learning_rate: float = _field(2e-4, "Peak learning rate.")
    lr_scheduler: Scheduler = _field("cosine", "Learning-rate schedule after warmup.")
    warmup_ratio: float = _field(0.03, "Fraction of the steps spent warming the learning rate up from 0.")
    weight_decay: float = _field(0.0, "Decoupled weight decay.")
    max_grad_norm: float = _field(1.0, "Clip the gradient norm to this; 0 disables clipping.")
    seed: int = _field(42, "Random seed for initialization, shuffling and dropout.")
    chunked_loss: bool = _field(
        True,
        "Compute the output layer and fp32 cross-entropy only for tokens that carry a loss, a chunk at a "
        "time: same loss and gradients, a fraction of the logits memory, less compute with prompt masking. "
        "Models that scale or soft-cap their logits, and zero3/fsdp sharding, use the full logits anyway.",
    )
    lean_weights: bool = _field(
        True,
        "With 4/8-bit loading, keep the frozen input embedding and output layer 16-bit (k-bit preparation "
        "would upcast them to fp32: 3.9 GiB of Llama-3-8B's weights); the embedding's output is cast to fp32 "
        "instead, so losses and gradients are the same to the bit. Gemma's scaled embedding stays fp32.",
    )
    embedding_on_cpu: bool = _field(
        False,
        "Keep the frozen input embedding in CPU RAM: each step looks its rows up there and moves only those to "
        "the GPU (the same numbers; 1 GiB less GPU memory for a 128k-vocabulary 8B model, as much more CPU RAM). "
        "For adapter methods on one GPU; no effect when the output layer shares the embedding's weight.",
    )
    output_layer_on_cpu: bool = _field(
        False,
        "Keep the frozen output layer in CPU RAM and copy it to the GPU only while the chunked loss computes (it "
        "computes every gradient of the loss right there): the same numbers; 1 GiB less GPU memory through the "
        "backward pass for a 128k-vocabulary 8B model, as much more CPU RAM. For adapter methods with the chunked "
        "loss, without ZeRO or layer split; no effect when the output layer shares the embedding's weight or the "
        "model scales or soft-caps its logits.",
    )
    activation_offload: bool = _field(
        False, "With gradient checkpointing: keep each block's saved input in CPU RAM (copied out and back "
        "while the GPU computes) instead of on the GPU. Exact; costs CPU RAM (shown by the estimate) and a "
        "little time where the copies do not hide behind the compute."
    )
    tiled_mlp: bool = _field(
        False, "Recompute each block's MLP over tiles of the tokens in the backward pass, so that its "
        "intermediate (tokens x intermediate_size, several copies) is never whole: for very long sequences. "
        "Same results; the MLP's forward runs twice. Not for mixtures of experts."
    )
    torch_compile: bool = _field(
        False, "Compile the model with torch.compile (inductor): faster steps after a slow first one; "
        "not with 4/8-bit quantization or DeepSpeed."
    )


SAMPLE_NEW_TOKENS = 64  # the longest answer to a sample prompt while training (schedule.sample_every)
SAMPLED_HELD_OUT_ROWS = 3  # the held-out rows asked while training when data.sample_prompts is empty


@dataclass(frozen=True)
class ScheduleConfig:
    """When to log, evaluate and save."""

    log_every: int = _field(1, "Emit a step event every this many optimizer steps.")
    eval_every: int = _field(0, "Evaluate every this many steps; 0: only at the end (if there is eval data).")
    sample_every: int = _field(0, "Answer the sample prompts (data.sample_prompts) greedily with the current weights "
                               "before the first step, every this many steps and after the last; 0: no samples.")
    save_every: int = _field(0, "Save a checkpoint every this many steps; 0: only at the end and on stop.")
    tensorboard: bool = _field(True, "Also write the run's figures (losses, learning rate, throughput, memory, "
                               "samples, evaluations) as TensorBoard files in RUN/tensorboard: "
                               "tensorboard --logdir RUN/tensorboard.")
    trackers: tuple[Tracker, ...] = _field(
        (), "Also send the same figures to these experiment trackers (trackio, wandb, mlflow), each an optional "
        "extra: pip install \"finetune-studio[wandb]\". Their logins stay theirs (wandb login or WANDB_API_KEY; "
        "MLFLOW_TRACKING_URI and its variables, else a database in studio's data folder; HF_TOKEN for a Trackio "
        "Space), never in the config or the run directory. Each names the run after its directory; a resumed run, "
        "studio eval and studio track RUN --to TRACKER add to it. One that cannot start or fails is dropped with a "
        "warning: the run trains on.")
    tracker_project: str = _field(
        "finetune-studio", "The project (Weights & Biases, Trackio) or experiment (MLflow) the trackers file the run "
        "under.")
    keep_checkpoints: int = _field(2, "Keep the newest this many complete checkpoints.")


@dataclass(frozen=True)
class DistributedConfig:
    """Several GPUs or machines: data parallelism, sharding, offloading, layer split and pipeline."""

    num_processes: int = _field(
        1, "Training processes on this machine, one per GPU (data parallel). More than 1 launches them "
        "with torchrun; without GPUs they run on the CPU over gloo."
    )
    sharding: Sharding = _field(
        "none", "How the processes share the training state. none: each holds a full copy (DDP). "
        "zero1 / zero2 / zero3: DeepSpeed ZeRO shards the optimizer state / and the gradients / and the "
        "weights. fsdp: PyTorch FSDP2 (full sharding) through accelerate, also on the CPU; rank 0 alone reads the "
        "weights and hands each process its shard."
    )
    offload_optimizer: Offload = _field(
        "none", "DeepSpeed ZeRO: keep the optimizer state in CPU RAM (cpu) or on an SSD (nvme) instead of GPU memory."
    )
    offload_params: Offload = _field(
        "none", "DeepSpeed ZeRO-3: keep the weights in CPU RAM (cpu) or on an SSD (nvme), fetched layer by layer."
    )
    nvme_path: str = _field("", "Folder on a fast SSD for nvme offload.")
    deepspeed_config: str = _field(
        "", "Your own DeepSpeed JSON file; its keys override the ones generated from this config (nested "
        "sections key by key). The merged result is written to deepspeed.json in the run directory."
    )
    layer_split: bool = _field(
        False, "Model parallel: split the model's layers across this machine's GPUs in one process, for a "
        "model larger than one GPU; layers that do not fit go to CPU RAM (see max_cpu_memory_gib)."
    )
    max_gpu_memory_gib: float = _field(
        0.0, "Layer split: weights per GPU at most this many GiB; 0: the GPU's memory minus room for activations."
    )
    max_cpu_memory_gib: float = _field(
        0.0, "Layer split: CPU RAM for layers that do not fit on the GPUs (slower); 0: none."
    )
    pipeline_stages: int = _field(
        0, "Pipeline parallel: cut the model's decoder blocks into this many stages, one per process (set "
        "num_processes to the same number), all computing at once on different micro-batches; 0: off. The first "
        "stage holds the embeddings, the last the final norm and output layer. LoRA-style methods, sft, padded "
        "micro-batches (data.packing none or length_grouped), no sharding."
    )
    pipeline_schedule: PipelineSchedule = _field(
        "gpipe", "Pipeline parallel: the order the stages run the step's micro-batches (its "
        "gradient_accumulation_steps) in. gpipe: all forwards, then all backwards. 1f1b: one forward, one "
        "backward in turn, holding fewer micro-batches' activations. interleaved: 1F1B over pipeline_chunks "
        "chunks of blocks per process (torch's ScheduleInterleaved1F1B): a smaller bubble, more activations held."
    )
    pipeline_chunks: int = _field(
        2, "Interleaved pipeline schedule: the chunks of blocks each process holds, not consecutive (process p of P "
        "runs chunks p, p + P, ...; the model is cut into pipeline_stages x pipeline_chunks chunks), the bubble "
        "about as many times smaller. Only used by pipeline_schedule interleaved."
    )

    @property
    def deepspeed_stage(self) -> int | None:
        """The ZeRO stage, or None when DeepSpeed is not used."""
        return int(self.sharding[-1]) if self.sharding.startswith("zero") else None

    @property
    def chunks_per_process(self) -> int:
        """The chunks of blocks each pipeline process runs: pipeline_chunks under the interleaved schedule, else 1."""
        return self.pipeline_chunks if self.pipeline_schedule == "interleaved" else 1

    @property
    def shards_weights(self) -> bool:
        """ZeRO-3 and FSDP split the weights themselves over the processes."""
        return self.sharding in ("zero3", "fsdp")


@dataclass(frozen=True)
class RunConfig:
    """A complete fine-tuning run."""

    schema_version: int = _field(SCHEMA_VERSION, "Version of this schema; written by the app.")
    name: str = _field("run", "Short name, used in the run directory's name.")
    method: Method = _field(
        "lora", "full: train every weight. lora: train a low-rank adapter on a frozen base. "
        "qlora: LoRA on a 4-bit quantized base. adalora: LoRA whose ranks are pruned to a budget while training. "
        "ia3: learned scaling vectors (fewest parameters). loha / lokr: Hadamard / Kronecker product updates. "
        "prefix_tuning / prompt_tuning: trained virtual tokens (keys and values of every layer / input "
        "embeddings); these cannot be merged into the weights."
    )
    objective: Objective = _field(
        "sft", "What training minimizes. sft: the cross-entropy of the response tokens. dpo, orpo, simpo: learn from "
        "preference pairs (data.format preference); kto: from completions labelled desirable or undesirable "
        "(data.format unpaired_preference). Their settings are in the preference section. grpo: from prompts alone "
        "(data.format prompt_only), the model's own completions scored by rewards (the grpo section)."
    )
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": "The base model."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": "The data."})
    lora: LoraConfig = field(default_factory=LoraConfig, metadata={"doc": "LoRA settings."})
    peft: PeftConfig = field(default_factory=PeftConfig, metadata={"doc": "Other PEFT methods' settings."})
    preference: PreferenceConfig = field(
        default_factory=PreferenceConfig, metadata={"doc": "The preference objectives' settings."})
    grpo: GrpoConfig = field(default_factory=GrpoConfig, metadata={"doc": "GRPO's settings."})
    qat: QatConfig = field(default_factory=QatConfig, metadata={"doc": "Quantization-aware training."})
    vision: VisionConfig = field(default_factory=VisionConfig, metadata={"doc": "Vision-language models' parts."})
    quantization: QuantizationConfig = field(
        default_factory=QuantizationConfig, metadata={"doc": "Base-model quantization."}
    )
    training: TrainingConfig = field(default_factory=TrainingConfig, metadata={"doc": "The optimizer loop."})
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig, metadata={"doc": "Logging and saving."})
    distributed: DistributedConfig = field(
        default_factory=DistributedConfig, metadata={"doc": "Several GPUs or machines."}
    )

    @property
    def method_spec(self) -> MethodSpec:
        """What the method trains and allows (studio.core.methods)."""
        return METHOD_SPECS[self.method]

    @property
    def effective_load_in(self) -> str:
        """The quantization actually used: ``auto`` is 4bit for a method that needs a k-bit base (qlora)."""
        if self.quantization.load_in == "auto":
            return "4bit" if self.method_spec.kbit_base == "required" else "none"
        return self.quantization.load_in

    @property
    def sharded_loading(self) -> str | None:
        """How the processes load the model when each builds only its shard ("zero3", "fsdp"); None: whole.
        FSDP loads 8-bit weights whole (rank 0 cannot hand out bitsandbytes' weights as shards; 4-bit ones it refuses)."""
        sharding = self.distributed.sharding
        if sharding == "zero3" or (sharding == "fsdp" and self.effective_load_in == "none"):
            return sharding
        return None

    @property
    def uses_adapter(self) -> bool:
        return self.method_spec.uses_adapter

    @property
    def adapts_linears(self) -> bool:
        """Whether the adapter wraps linear layers (lora.target_modules applies)."""
        return self.method_spec.adapts_linears

    @property
    def can_merge(self) -> bool:
        """Whether the trained model can be exported as one merged model (virtual tokens cannot)."""
        return self.method_spec.mergeable

    @property
    def packs_padding_free(self) -> bool:
        """Whether micro-batches are packed: padding_free, except for virtual-token methods (peft drops
        or shifts the position ids that keep packed examples apart, so they train padded)."""
        return self.data.packing == "padding_free" and not self.method_spec.trains_virtual_tokens

    @property
    def learns_preferences(self) -> bool:
        """Whether the objective learns from preferences (dpo, orpo, simpo, kto) rather than responses or rewards."""
        return self.objective in ("dpo", "orpo", "simpo", "kto")

    @property
    def objective_format(self) -> str | None:
        """The row format the objective reads: pairs (dpo, orpo, simpo), unpaired rows (kto), prompts (grpo); sft,
        which reads any row with a response: None."""
        return {"dpo": "preference", "orpo": "preference", "simpo": "preference", "kto": "unpaired_preference",
                "grpo": "prompt_only"}.get(self.objective)

    @property
    def row_format(self) -> str:
        """The rows' format as the data is read: an objective that reads its own format reads it (its auto)."""
        if self.data.format == "auto" and self.objective_format:
            return self.objective_format
        return self.data.format

    @property
    def uses_reference(self) -> bool:
        """Whether the objective compares the model with its reference (dpo, kto; grpo with a KL term)."""
        return self.objective in ("dpo", "kto") or (self.objective == "grpo" and self.grpo.beta > 0)

    @property
    def sequences_per_row(self) -> int:
        """The sequences a training row puts through the model with gradients: a pair's two (chosen and rejected,
        one forward), else one."""
        return 2 if self.objective in ("dpo", "orpo", "simpo") else 1

    @property
    def frozen_reference(self) -> bool:
        """Whether DPO keeps a frozen copy of the starting weights beside the trained ones: full fine-tuning with
        its reference run on every step (an adapter method's reference is the base with the adapter off)."""
        each_step = self.preference.reference == "each_step" or self.objective == "grpo"  # new completions, each step
        return self.uses_reference and not self.uses_adapter and each_step

    @property
    def effective_batch_size(self) -> int:
        return self.training.micro_batch_size * self.training.gradient_accumulation_steps

    def replace(self, **sections: Any) -> "RunConfig":
        """A copy with some fields changed; nested sections take dicts of their fields.

        ``cfg.replace(training={"micro_batch_size": 2})`` changes one field.
        """
        changes = {}
        for name, value in sections.items():
            current = getattr(self, name)
            if isinstance(value, dict) and dataclasses.is_dataclass(current):
                value = dataclasses.replace(current, **value)
            changes[name] = value
        return dataclasses.replace(self, **changes)


def differences(before: RunConfig, after: RunConfig) -> dict[str, tuple[Any, Any]]:
    """``{"training.precision": ("bf16", "fp32"), ...}``: every field whose value differs, by dotted path."""
    old, new = to_dict(before), to_dict(after)
    found = {}
    for name, value in new.items():
        if isinstance(value, dict):
            found.update({f"{name}.{key}": (old[name][key], v) for key, v in value.items() if old[name][key] != v})
        elif old[name] != value:
            found[name] = (old[name], value)
    return found


def choice_values(path: str) -> tuple[Any, ...]:
    """The values a choice field allows, in the schema's order: ``choice_values("training.precision")``."""
    owner: Any = RunConfig
    *sections, name = path.split(".")
    for section in sections:
        owner = get_type_hints(owner)[section]
        if get_origin(owner) is tuple:  # a list of sections: grpo.rewards
            owner = get_args(owner)[0]
    hint = get_type_hints(owner)[name]
    if get_origin(hint) is tuple:  # a list of choices: schedule.trackers
        hint = get_args(hint)[0]
    if get_origin(hint) is not Literal:
        raise TypeError(f"{path} is not a choice field")
    return get_args(hint)


# ---------------------------------------------------------------- (de)serialization


def to_dict(obj: Any) -> Any:
    """Plain dicts/lists for YAML and JSON (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_listed_section(v) if dataclasses.is_dataclass(v) else to_dict(v) for v in obj]
    return obj


def _listed_section(obj: Any) -> dict:
    """An item of a list of sections (grpo.rewards) as YAML reads best: its name and weight, then only the settings
    that differ from their defaults (each kind of item reads only its own)."""
    default = type(obj)()
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if f.name in ("name", "weight") or getattr(obj, f.name) != getattr(default, f.name)}


def dump_yaml(config: RunConfig) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False, allow_unicode=True)


def save_config(config: RunConfig, path: Path) -> None:
    Path(path).write_text(dump_yaml(config), encoding="utf-8")


def load_config(path: Path) -> RunConfig:
    """Read a YAML config file; raises ProblemsError naming every bad field and its line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ProblemsError([Problem(str(path), f"cannot read the file: {exc}", "check the path")], "config")
    config = parse_config(text, source=str(path))
    return _resolve_paths(config, path.parent)


def parse_config(text: str, source: str = "<config>") -> RunConfig:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        reason = getattr(exc, "problem", None) or str(exc)
        raise ProblemsError([Problem(where, f"not valid YAML: {reason}", "fix the YAML syntax")], "config")
    if data is None:
        data = {}
    lines = _key_lines(node)
    return from_dict(data, source=source, lines=lines)


def from_dict(data: Any, source: str = "<config>", lines: dict[str, int] | None = None) -> RunConfig:
    """Build a RunConfig from plain data, collecting every problem before raising."""
    problems: list[Problem] = []
    lines = lines or {}

    def where(path: str) -> str:
        line = lines.get(path)
        return f"{path} ({source}:{line})" if line else path

    if not isinstance(data, dict):
        raise ProblemsError([Problem(source, "the top level must be a mapping of sections", "see docs/config.md")], "config", source)
    version = data.get("schema_version", SCHEMA_VERSION)
    if isinstance(version, int) and version > SCHEMA_VERSION:
        problems.append(Problem(where("schema_version"), f"written by a newer Finetune Studio (schema {version}, this one reads {SCHEMA_VERSION})", "upgrade finetune-studio"))
    config = _build(RunConfig, data, "", problems, where)
    if problems:
        raise ProblemsError(problems, "config", source)
    return config


def _build(cls: type, data: dict, prefix: str, problems: list[Problem], where) -> Any:
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean '{prefix}{close[0]}'?" if close else f"known fields: {', '.join(fields)}"
            problems.append(Problem(where(path), "unknown field", hint))
            continue
        kwargs[key] = _convert(hints[key], value, path, problems, where)
    try:
        return cls(**{k: v for k, v in kwargs.items() if v is not _INVALID})
    except TypeError as exc:  # only reachable through a schema bug
        problems.append(Problem(prefix.rstrip("."), str(exc)))
        return cls()


_INVALID = object()


def _convert(tp: Any, value: Any, path: str, problems: list[Problem], where) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(Problem(where(path), f"expected a section of fields, got {value!r}", "indent its fields under it"))
            return _INVALID
        return _build(tp, value, path + ".", problems, where)
    if origin is Literal:
        return _choice(get_args(tp), value, path, problems, where)
    if origin is tuple and dataclasses.is_dataclass(get_args(tp)[0]):
        return _sections(get_args(tp)[0], value, path, problems, where)
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            problems.append(Problem(where(path), f"expected a list of strings, got {value!r}", "write it as [a, b]"))
            return _INVALID
        item = get_args(tp)[0]
        if get_origin(item) is Literal:
            value = [_choice(get_args(item), v, f"{path}[{i}]", problems, where) for i, v in enumerate(value)]
            return _INVALID if _INVALID in value else tuple(value)
        return tuple(value)
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(Problem(where(path), f"expected true or false, got {value!r}"))
            return _INVALID
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(Problem(where(path), f"expected a whole number, got {value!r}"))
            return _INVALID
        return value
    if tp is float:
        if isinstance(value, str):  # YAML reads 2e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(Problem(where(path), f"expected a number, got {value!r}"))
            return _INVALID
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(Problem(where(path), f"expected text, got {value!r}", "put it in quotes"))
            return _INVALID
        return value
    raise TypeError(f"unsupported config type {tp} at {path}")  # schema bug, not user input


def _sections(cls: type, value: Any, path: str, problems: list[Problem], where) -> Any:
    """A list of sections of one kind (grpo.rewards), each named by its index when wrong."""
    if not isinstance(value, list):
        problems.append(Problem(where(path), f"expected a list of sections, got {value!r}",
                                "write each as - name: ... under it"))
        return _INVALID
    items = [_convert(cls, item, f"{path}[{i}]", problems, where) for i, item in enumerate(value)]
    return _INVALID if _INVALID in items else tuple(items)


def _choice(choices: tuple[Any, ...], value: Any, path: str, problems: list[Problem], where) -> Any:
    if value not in choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f"did you mean '{close[0]}'?" if close else "choose one of: " + ", ".join(map(str, choices))
        problems.append(Problem(where(path), f"{value!r} is not one of {', '.join(map(str, choices))}", hint))
        return _INVALID
    return value


def key_lines(path: Path) -> dict[str, int]:
    """The 1-based YAML line of each dotted key in a config file ({} when it cannot be read)."""
    try:
        return _key_lines(yaml.compose(Path(path).read_text(encoding="utf-8"), Loader=yaml.SafeLoader))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}


def _key_lines(node: Any, prefix: str = "") -> dict[str, int]:
    """Map each dotted key path in a composed YAML tree to its 1-based line."""
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = f"{prefix}{key_node.value}"
            lines[path] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, path + "."))
    return lines


def _resolve_paths(config: RunConfig, base: Path) -> RunConfig:
    """Make data and DeepSpeed paths (and a local model path) absolute, relative to the config's folder."""

    def absolute(p: str) -> str:
        return str((base / p).resolve()) if p and not Path(p).is_absolute() and not is_hub_spec(p) else p

    model_path = config.model.name_or_path
    if model_path and (base / model_path).exists():
        model_path = absolute(model_path)
    return config.replace(
        model={"name_or_path": model_path},
        data={
            "train_files": tuple(absolute(p) for p in config.data.train_files),
            "eval_files": tuple(absolute(p) for p in config.data.eval_files),
        },
        grpo={"reward_file": absolute(config.grpo.reward_file)},
        distributed={
            "nvme_path": absolute(config.distributed.nvme_path),
            "deepspeed_config": absolute(config.distributed.deepspeed_config),
        },
    )


# ---------------------------------------------------------------- reference


def _type_text(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return ", ".join(map(str, get_args(tp)))
    if origin is tuple:
        item = get_args(tp)[0]
        if dataclasses.is_dataclass(item):
            return "list of sections"
        return f"list of: {_type_text(item)}" if get_origin(item) is Literal else "list of text"
    if isinstance(tp, type):
        return {"str": "text", "int": "integer", "float": "number", "bool": "true/false"}.get(tp.__name__, tp.__name__)
    if isinstance(tp, types.UnionType) or origin is typing.Union:
        return " or ".join(_type_text(a) for a in get_args(tp))
    return str(tp)


def _default_text(value: Any) -> str:
    value = to_dict(value)
    return "(empty)" if value in ("", []) else f"`{value}`"


def reference_markdown() -> str:
    """The documentation of every field, generated from the schema."""
    out = ["# Run configuration reference", "",
           "Generated from `studio/core/config.py` by `studio config reference > docs/config.md`; `studio config --help` prints the same.", ""]
    default = RunConfig()
    top = [f for f in dataclasses.fields(RunConfig) if not dataclasses.is_dataclass(getattr(default, f.name))]
    sections = [f for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(getattr(default, f.name))]
    hints = get_type_hints(RunConfig)
    out += ["## Top level", "", "| field | type | default | meaning |", "|---|---|---|---|"]
    for f in top:
        out.append(f"| `{f.name}` | {_type_text(hints[f.name])} | {_default_text(getattr(default, f.name))} | {f.metadata['doc']} |")
    for section in sections:
        obj = getattr(default, section.name)
        cls = type(obj)
        sh = get_type_hints(cls)
        out += ["", f"## `{section.name}`: {cls.__doc__.strip()}", "", "| field | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            out.append(f"| `{section.name}.{f.name}` | {_type_text(sh[f.name])} | {_default_text(getattr(obj, f.name))} | {f.metadata['doc']} |")
        out += _listed_sections_reference(section.name, cls)
    return "\n".join(out) + "\n"


def _listed_sections_reference(prefix: str, cls: type) -> list[str]:
    """The fields of each item of a section's lists of sections (grpo.rewards), as a table of their own."""
    out = []
    for f in dataclasses.fields(cls):
        hint = get_type_hints(cls)[f.name]
        if get_origin(hint) is tuple and dataclasses.is_dataclass(item := get_args(hint)[0]):
            out += ["", f"### each of `{prefix}.{f.name}`: {' '.join(item.__doc__.split())}", "",
                    "| field | type | default | meaning |", "|---|---|---|---|"]
            out += [f"| `{g.name}` | {_type_text(get_type_hints(item)[g.name])} | {_default_text(g.default)} | "
                    f"{g.metadata['doc']} |" for g in dataclasses.fields(item)]
    return out
