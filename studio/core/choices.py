"""The run config's choices: each choice field's values (a ``Literal``) and the words users read for them.

``config.py`` types its choice fields with the ``Literal``s here (a list of choices, ``schedule.trackers``, with a
tuple of one). ``CHOICE_WORDS`` gives, by field path, each
value's label and its one line on what it saves and what it costs: the window's drop-downs show them, and the
worker names a choice with its label. ``tests/test_config.py`` holds the words to exactly the values the
schema allows. The methods' words are their table's (``studio.core.methods.METHOD_SPECS``).
"""

from __future__ import annotations

from typing import Literal

# value -> (label, explanation)
ChoiceWords = dict[str, tuple[str, str]]


Precision = Literal["fp32", "bf16", "fp16"]
PRECISION_WORDS: ChoiceWords = {
    "fp32": ("fp32", "Full precision: the most activation memory and the slowest; never overflows."),
    "bf16": ("bf16 (mixed)", "Halves activation memory and speeds up recent GPUs (Ampere and newer); "
                             "the fp32 range with less precision."),
    "fp16": ("fp16 (mixed)", "Halves activation memory on older GPUs; can overflow: lower the learning "
                             "rate if the loss turns NaN."),
}

WeightDtype = Literal["auto", "float32", "bfloat16", "float16"]
WEIGHT_DTYPE_WORDS: ChoiceWords = {
    "auto": ("auto", "fp32 for full fine-tuning (the optimizer needs fp32 weights), the precision's "
                     "16-bit type for a frozen LoRA base."),
    "float32": ("float32", "4 bytes per weight: exact, twice the memory of 16-bit."),
    "bfloat16": ("bfloat16", "2 bytes per weight: half the memory; full fine-tuning then loses small updates."),
    "float16": ("float16", "2 bytes per weight with a narrow range: for GPUs without bf16."),
}

Optimizer = Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "sgd", "adafactor"]
OPTIMIZER_WORDS: ChoiceWords = {
    "adamw": ("AdamW", "Two fp32 states per trainable parameter (8 bytes): the reliable default."),
    "adamw_8bit": ("AdamW 8-bit", "8-bit states (bitsandbytes): 6 bytes less per trainable parameter, "
                                  "the same results in practice."),
    "paged_adamw_8bit": ("Paged AdamW 8-bit", "8-bit states that can spill to CPU RAM under pressure: "
                                              "avoids out-of-memory spikes, slower while paging."),
    "sgd": ("SGD (momentum)", "One state per parameter (4 bytes): little memory, needs more tuning."),
    "adafactor": ("Adafactor", "Factored second moments, almost no state: the least memory, "
                               "may converge more slowly."),
}

LoadIn = Literal["auto", "none", "4bit", "8bit"]
LOAD_IN_WORDS: ChoiceWords = {
    "auto": ("auto", "4-bit for QLoRA, unquantized otherwise."),
    "none": ("none (16/32-bit)", "Unquantized base weights: the most memory, the fastest steps."),
    "4bit": ("4-bit", "A quarter of the 16-bit weight memory; slower steps, tiny accuracy loss."),
    "8bit": ("8-bit", "Half of the 16-bit weight memory; slower steps than 4-bit on most GPUs."),
}

QuantType = Literal["nf4", "fp4"]
QUANT_TYPE_WORDS: ChoiceWords = {
    "nf4": ("nf4", "Normal float 4: QLoRA's default, best accuracy for normally distributed weights."),
    "fp4": ("fp4", "Plain 4-bit float: same memory as nf4, usually a little less accurate."),
}

QatWeights = Literal["none", "int4", "int8"]
QAT_WEIGHTS_WORDS: ChoiceWords = {
    "none": ("off", "No quantization-aware training: the merged export keeps full-precision weights."),
    "int4": ("int4", "Train with the block linears' weights rounded to 4 bits (torchao): the int4 export "
                     "keeps most of the accuracy; costs a fake-quantized copy of each weight during the step."),
    "int8": ("int8", "Train with 8-bit weights: small accuracy loss even without QAT; the same memory cost."),
}

QatActivations = Literal["none", "int8"]
QAT_ACTIVATIONS_WORDS: ChoiceWords = {
    "none": ("full precision", "Only the weights are quantized."),
    "int8": ("int8 (dynamic)", "Also round each linear's input to 8 bits per token, as the quantized model "
                               "will: costs a copy of every linear input."),
}

Packing = Literal["padding_free", "length_grouped", "none"]
# Measured effects: docs/performance.md (benchmarks/throughput.py, 56M Llama, LoRA r8, batch 8, lengths 16-256).
PACKING_WORDS: ChoiceWords = {
    "padding_free": ("Padding-free packing", "A micro-batch's examples end to end in one row, each attending only "
                     "to itself: the same losses with no compute on padding. With the lean loss, measured 2.7x the "
                     "tokens/s of the Hugging Face Trainer with padding on instruction-like data (docs/performance.md)."),
    "length_grouped": ("Group by length", "Padded micro-batches of similar lengths: less padding without packing, "
                       "but it changes which examples train together."),
    "none": ("Pad each micro-batch", "Every example padded to the longest of its micro-batch: compute is spent on "
             "padding."),
}

DataFormat = Literal["auto", "instruction", "chat", "prompt_completion", "text", "preference", "unpaired_preference",
                     "prompt_only"]
DATA_FORMAT_WORDS: ChoiceWords = {
    "auto": ("auto", "Detected from the columns of the first row."),
    "instruction": ("instruction (alpaca)", "instruction, optional input, output: one user turn and its answer."),
    "chat": ("chat (messages / conversations)", "OpenAI role/content or ShareGPT from/value turns."),
    "prompt_completion": ("prompt / completion", "The prompt as context, the completion learned."),
    "text": ("plain text", "Every token is learned (continued pre-training)."),
    "preference": ("preference pairs", "prompt, chosen and rejected (plain or conversational; without a prompt "
                   "the turns chosen and rejected share are it): for dpo, orpo and simpo."),
    "unpaired_preference": ("unpaired preference rows", "prompt, completion and label (true: desirable, false: "
                            "undesirable; plain or conversational): for kto."),
    "prompt_only": ("prompts only", "prompt (plain or conversational), optional reference answer (answer, solution "
                    "or reference): for grpo, which writes its own completions."),
}

Objective = Literal["sft", "dpo", "orpo", "simpo", "kto", "grpo"]
OBJECTIVE_WORDS: ChoiceWords = {
    "sft": ("Supervised (SFT)", "Learn the responses token by token: the cross-entropy of the target tokens."),
    "dpo": ("DPO", "Learn from pairs: raise the chosen response's likelihood against the rejected one's, relative to "
                   "the model as it started (the reference): costs a reference forward per step, or one pass before "
                   "training."),
    "orpo": ("ORPO", "Learn from pairs without a reference: the chosen rows' cross-entropy plus an odds-ratio term "
                     "that pushes the rejected response down."),
    "simpo": ("SimPO", "Learn from pairs without a reference: the margin of the responses' average log-likelihoods "
                       "must exceed a target (preference.simpo_gamma)."),
    "kto": ("KTO", "Learn from single completions labelled desirable or undesirable: raise the desirable ones' "
                   "likelihood and lower the undesirable ones', relative to the reference, as DPO."),
    "grpo": ("GRPO (verifiable rewards)", "Learn from prompts alone: the model answers each prompt several times, "
                                          "the rewards score the answers, and the better ones of each group are made "
                                          "likelier (grpo section)."),
}

GrpoLoss = Literal["grpo", "dr_grpo", "dapo"]
GRPO_LOSS_WORDS: ChoiceWords = {
    "grpo": ("GRPO", "Each completion's token mean, then the mean over completions: a short completion's tokens "
                     "weigh more than a long one's."),
    "dr_grpo": ("Dr. GRPO", "Every token summed, over the completions times max_completion_length: no length bias."),
    "dapo": ("DAPO (token-level)", "Every token summed, over the step's completion tokens: each token weighs the "
                                   "same (TRL's default)."),
}

GenerationBackend = Literal["hf", "vllm"]
GENERATION_BACKEND_WORDS: ChoiceWords = {
    "hf": ("the training weights (HF generate)", "Samples with the weights being trained, the adapter on: no second "
                                                "copy, on any device."),
    "vllm": ("vLLM (NVIDIA GPU)", "Samples with vLLM, much faster for long completions: its own copy of the base "
                                  "and a KV cache pool take grpo.vllm_memory_fraction of the GPU, the adapter is "
                                  "handed to it after every optimizer step (LoRA runs of one process; vllm "
                                  "installed)."),
}

RewardName = Literal["equals_reference", "matches_format", "length_within", "contains"]
REWARD_NAME_WORDS: ChoiceWords = {
    "equals_reference": ("answer equals the reference", "1 when the completion's answer (its last \\boxed{...}, "
                         "else its last number, else its text) equals the row's reference answer, else 0."),
    "matches_format": ("matches a format", "1 when the whole completion matches the regular expression, else 0."),
    "length_within": ("length within limits", "1 when the completion's length (characters or words) is within the "
                      "limits, else 0."),
    "contains": ("contains a text", "1 when the completion contains the text, else 0."),
}

LengthUnit = Literal["characters", "words"]
LENGTH_UNIT_WORDS: ChoiceWords = {
    "characters": ("characters", "The completion's length in characters."),
    "words": ("words", "The completion's length in words (separated by white space)."),
}

DpoLoss = Literal["sigmoid", "ipo", "robust", "hinge"]
DPO_LOSS_WORDS: ChoiceWords = {
    "sigmoid": ("sigmoid (DPO)", "The paper's loss: -log sigmoid(beta x the margin of log-ratios)."),
    "ipo": ("IPO", "A squared loss on the per-token margin, towards 1/(2 beta): does not overfit deterministic "
                   "preferences."),
    "robust": ("robust DPO", "For noisy labels: preference.label_smoothing is the chance a pair's label is flipped."),
    "hinge": ("hinge (SLiC)", "max(0, 1 - beta x the margin): pairs past the margin teach nothing more."),
}

ReferenceLogps = Literal["each_step", "precomputed"]
REFERENCE_LOGPS_WORDS: ChoiceWords = {
    "each_step": ("each step", "The reference runs beside every step: for adapter methods the base with the "
                               "adapter off (no second copy), for full fine-tuning a frozen copy of the weights."),
    "precomputed": ("once, before training", "The reference's log-probabilities of every pair computed before the "
                    "first step and kept: no frozen copy and no reference forward while training."),
}

Template = Literal["auto", "tokenizer", "chatml", "alpaca"]
TEMPLATE_WORDS: ChoiceWords = {
    "auto": ("auto", "The tokenizer's chat template when it has one, else ChatML."),
    "tokenizer": ("the tokenizer's template", "Exactly how the model was trained to chat."),
    "chatml": ("ChatML", "<|im_start|>role … <|im_end|> turns: a common choice for base models."),
    "alpaca": ("Alpaca", "### Instruction / ### Response: single-turn rows only."),
}

Sharding = Literal["none", "zero1", "zero2", "zero3", "fsdp"]
SHARDING_WORDS: ChoiceWords = {
    "none": ("none (DDP)", "Every GPU holds the whole model and optimizer state and trains on its own share of "
                           "each batch: faster training, no memory saved."),
    "zero1": ("ZeRO-1", "DeepSpeed shards the optimizer state over the GPUs: saves most of AdamW's 8 bytes per "
                        "trained parameter, costs almost no speed."),
    "zero2": ("ZeRO-2", "Also shards the gradients: saves a little more, costs a little more communication."),
    "zero3": ("ZeRO-3", "Also shards the weights, gathered layer by layer: the model can exceed one GPU; costs "
                        "the most communication."),
    "fsdp": ("FSDP", "PyTorch's full sharding (like ZeRO-3) through accelerate, without DeepSpeed: rank 0 reads "
                     "the weights and hands each GPU its shard."),
}

Offload = Literal["none", "cpu", "nvme"]
OFFLOAD_WORDS: ChoiceWords = {
    "none": ("none", "Kept on the GPU: the fastest."),
    "cpu": ("CPU RAM", "Kept in CPU RAM: frees GPU memory, costs PCIe transfers every step."),
    "nvme": ("NVMe SSD", "Kept on a fast SSD: for what CPU RAM cannot hold; the slowest."),
}

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved"]
PIPELINE_SCHEDULE_WORDS: ChoiceWords = {
    "gpipe": ("GPipe", "Every micro-batch forward, then every backward: simple; holds all micro-batches' activations."),
    "1f1b": ("1F1B", "One forward, one backward in turn once the pipeline is full: the same bubble, the activations "
                     "of at most as many micro-batches as stages."),
    "interleaved": ("Interleaved 1F1B", "1F1B over several chunks of blocks per GPU (Chunks per GPU), taken in turn: "
                                        "a bubble that many times smaller, more activations held and more hidden "
                                        "states sent."),
}

Tracker = Literal["trackio", "wandb", "mlflow"]
TRACKER_WORDS: ChoiceWords = {
    "trackio": ("Trackio", "Hugging Face's tracker: a dashboard on this machine (trackio show), or a Space named by "
                           "TRACKIO_SPACE_ID with the login of HF_TOKEN or hf auth login."),
    "wandb": ("Weights & Biases", "wandb.ai or your W&B server, with the login of wandb login or WANDB_API_KEY; "
                                  "WANDB_MODE=offline keeps the run on this machine (wandb sync uploads it later)."),
    "mlflow": ("MLflow", "The tracking server MLFLOW_TRACKING_URI names, with its own login variables; without one, a "
                         "database in studio's data folder (mlflow ui shows it)."),
}

# Choices whose words are elsewhere or need none: what each method trains and allows is its row of
# studio.core.methods.METHOD_SPECS, keyed by these values; a schedule's name says what it does.
Method = Literal["full", "lora", "qlora", "ia3", "adalora", "loha", "lokr", "prefix_tuning", "prompt_tuning"]
Scheduler = Literal["constant", "linear", "cosine"]

CHOICE_WORDS: dict[str, ChoiceWords] = {
    "training.precision": PRECISION_WORDS,
    "model.dtype": WEIGHT_DTYPE_WORDS,
    "training.optimizer": OPTIMIZER_WORDS,
    "quantization.load_in": LOAD_IN_WORDS,
    "quantization.quant_type": QUANT_TYPE_WORDS,
    "qat.weights": QAT_WEIGHTS_WORDS,
    "qat.activations": QAT_ACTIVATIONS_WORDS,
    "data.packing": PACKING_WORDS,
    "data.format": DATA_FORMAT_WORDS,
    "data.template": TEMPLATE_WORDS,
    "objective": OBJECTIVE_WORDS,
    "preference.dpo_loss": DPO_LOSS_WORDS,
    "preference.reference": REFERENCE_LOGPS_WORDS,
    "grpo.loss_type": GRPO_LOSS_WORDS,
    "grpo.generation_backend": GENERATION_BACKEND_WORDS,
    "grpo.rewards.name": REWARD_NAME_WORDS,
    "grpo.rewards.unit": LENGTH_UNIT_WORDS,
    "distributed.sharding": SHARDING_WORDS,
    "distributed.offload_optimizer": OFFLOAD_WORDS,
    "distributed.offload_params": OFFLOAD_WORDS,
    "distributed.pipeline_schedule": PIPELINE_SCHEDULE_WORDS,
    "schedule.trackers": TRACKER_WORDS,
}


def choice_label(path: str, value: str) -> str:
    """The label users read for ``value`` of the choice field ``path``: ``choice_label("distributed.sharding", "zero3")``
    is ``ZeRO-3``."""
    return CHOICE_WORDS[path][value][0]
