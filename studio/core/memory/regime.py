"""The run's settings that memory depends on, resolved from its config for one device type.

The worker asks the same rules (``weight_dtype_name``, ``loss_impl_for``), so
that what it loads and computes is what the estimate counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.methods import DORA, INPUT_TOKENS, METHOD_SPECS, MethodSpec
from studio.core.model.families import LinearLayer
from studio.core.model.info import ModelShape

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "bool": 1, "int64": 8}
_CONFIG_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class Regime:
    """Everything about a run the memory depends on, resolved from a RunConfig and a device type."""

    device_type: str  # "cuda" or "cpu"
    compute: str  # dtype of matmuls: the autocast dtype, or the weights' dtype without autocast
    autocast: bool
    base_dtype: str  # loaded dtype of the non-quantized weights
    quantization: str  # "none", "4bit", "8bit"
    double_quant: bool
    full: bool  # every weight trains
    adapted: tuple[LinearLayer, ...]  # block linears with an adapter (LoRA, AdaLoRA, IA3, LoHa, LoKr)
    rank: int
    lora_dropout: float
    dora: bool
    checkpointing: bool
    attention: str  # "sdpa" or "eager"
    optimizer: str
    micro_batch: int  # sequences: a preference pair's chosen and rejected are two
    accumulation: int
    sequence: int
    loss_impl: str
    method: MethodSpec = METHOD_SPECS["lora"]
    virtual_tokens: int = 0  # prefix / prompt tuning
    feedforward_width: int = 0  # IA3 scales the input of linears this wide (the MLP's output projection)
    qat: bool = False  # torchao fake-quantizes the block linears' weights
    qat_activations: bool = False  # and their inputs
    lean_embedding: bool = False  # k-bit preparation leaves the frozen input embedding 16-bit (lean_outer_weights)
    lean_head: bool = False  # and the output layer
    embedding_on_host: bool = False  # the frozen input embedding stays in CPU RAM (training.embedding_on_cpu)
    head_on_host: bool = False  # the frozen output layer too, on the device only in the loss (output_layer_on_cpu)
    activation_offload: bool = False  # checkpointed block inputs wait in host RAM (studio.core.memory.parts.offload)
    tiled_mlp: bool = False  # each MLP recomputed over tiles of tokens (studio.core.memory.parts.tiled)
    token_logps: bool = False  # a preference objective: per-token log-probabilities, each chunk projected again in backward
    frozen_reference: bool = False  # DPO of full fine-tuning: a frozen copy of the weights beside the trained ones
    sampled_group: int = 0  # GRPO: the completions sampled of a prompt at a time, between steps (0: no sampling)
    completion_length: int = 0  # GRPO: the most tokens of each

    @property
    def kbit_prepared(self) -> bool:
        return self.quantization != "none"

    @property
    def outer_dtype(self) -> str:
        """Dtype of every non-quantized weight: k-bit preparation upcasts 16-bit ones to fp32."""
        return "fp32" if self.kbit_prepared else self.base_dtype

    @property
    def embedding_dtype(self) -> str:
        """Dtype of the input embedding's weight (its output is cast to ``outer_dtype`` when they differ)."""
        return self.base_dtype if self.lean_embedding else self.outer_dtype

    @property
    def head_dtype(self) -> str:
        """Dtype of the output layer's weight."""
        return self.base_dtype if self.lean_head else self.outer_dtype

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.sequence

    @property
    def embedding_output_needs_grad(self) -> bool:
        # full fine-tuning trains the embeddings; LoRA with checkpointing calls enable_input_require_grads;
        # prompt tuning's trained tokens are part of the input
        return self.full or self.checkpointing or self.method.token_entry == INPUT_TOKENS


LOSS_IMPLS = ("full_fp32", "chunked")
CHUNKED_LOSS_BYTES = 64 * 2**20  # fp32 logits of one chunk of the chunked loss (studio.train.objectives.next_token)


def pinned_bytes(nbytes: int, device_type: str) -> int:
    """The host RAM a pinned block of ``nbytes`` takes: on CUDA, torch's caching host allocator rounds each block it
    asks the driver for up to a power of two (a 5.6 GiB block input takes 8 GiB); elsewhere nothing is pinned."""
    return 1 << (nbytes - 1).bit_length() if device_type == "cuda" and nbytes > 0 else nbytes


def loss_impl_for(config: RunConfig) -> str:
    """The loss the worker computes: chunked unless switched off, or the weights are sharded (then they are
    only gathered inside the model's own forward, not for a separate output layer)."""
    chunked = config.training.chunked_loss and not config.distributed.shards_weights
    return "chunked" if chunked else "full_fp32"


def lean_weights_apply(config: RunConfig) -> bool:
    """Whether ``training.lean_weights`` changes anything: with 4/8-bit loading, whose preparation freezes the
    weights it upcasts."""
    kbit = config.effective_load_in != "none"
    return config.training.lean_weights and kbit and not config.method_spec.trains_every_weight


def embedding_on_cpu_allowed(config: RunConfig) -> bool:
    """Where the input embedding may stay in CPU RAM (``embedding_on_cpu_refusal``)."""
    return embedding_on_cpu_refusal(config) is None


def embedding_on_cpu_refusal(config: RunConfig) -> str | None:
    """Why the input embedding cannot stay in CPU RAM, or None where it can: frozen (an adapter on linear
    layers), in one process that holds the whole model (no sharding, no layer split)."""
    d = config.distributed
    if config.adapts_linears and d.num_processes == 1 and d.sharding == "none" and not d.layer_split:
        return None
    return ("the input embedding stays in CPU RAM only for a frozen embedding (adapter methods on linear layers) in "
            "one process without sharding or layer split")


def embedding_on_host(config: RunConfig, tied: bool) -> bool:
    """Whether the worker keeps the input embedding in CPU RAM: asked for, allowed, and not the output layer's
    weight too (a tied head computes on the GPU)."""
    return config.training.embedding_on_cpu and embedding_on_cpu_allowed(config) and not tied


def output_layer_on_cpu_allowed(config: RunConfig) -> bool:
    """Where the output layer may stay in CPU RAM, on the device only while the chunked loss runs."""
    return output_layer_refusal(config) is None


def output_layer_refusal(config: RunConfig) -> str | None:
    """Why the output layer cannot stay in CPU RAM, or None where it can: frozen (an adapter that does not target
    it), and the chunked loss, which computes all the loss's gradients in that call (studio.train.objectives.next_token), in
    processes that each hold the whole model (no ZeRO, no layer split)."""
    d = config.distributed
    if not config.uses_adapter:
        return "full fine-tuning trains the output layer: it must stay on the GPU"
    if loss_impl_for(config) != "chunked":
        return ("the output layer leaves the GPU only with the chunked loss (training.chunked_loss on, no zero3 or "
                "fsdp), which computes all its gradients while it runs")
    if d.sharding != "none" or d.layer_split:
        return ("the output layer stays in CPU RAM only in processes that each hold the whole model: no ZeRO "
                "sharding (distributed.sharding none), no distributed.layer_split")
    if config.adapts_linears and "lm_head" in config.lora.target_modules:
        return "lora.target_modules adapts lm_head, so the output layer trains: it must stay on the GPU"
    return None


def output_layer_on_host(config: RunConfig, tied: bool, plain_logits: bool) -> bool:
    """Whether the worker keeps the output layer in CPU RAM: asked for, allowed, not the input embedding's weight
    too (the forward pass looks rows up in it), and logits that are plainly its output (else the full loss runs)."""
    return config.training.output_layer_on_cpu and output_layer_on_cpu_allowed(config) and not tied and plain_logits


def lean_outer_weights(lean: bool, autocast: bool, embedding_scales: bool, tied: bool) -> tuple[bool, bool]:
    """Which frozen weights k-bit preparation leaves 16-bit instead of upcasting them: (input embedding, output
    layer). studio.train.model.build asks the same, from the modules it holds.

    An upcast lookup equals the lookup upcast, so the embedding stays 16-bit and its output is cast to fp32,
    unless its module scales the rows in the weight's dtype (Gemma's). Under autocast the output layer's matmul
    runs on a 16-bit copy of an fp32 weight, which is the 16-bit weight itself; without autocast it must stay
    fp32. A tied head is the embedding's weight: both or neither.
    """
    head = lean and autocast
    embedding = lean and not embedding_scales and (head or not tied)
    return embedding, embedding if tied else head


def weight_dtype_name(config: RunConfig) -> str:
    """The dtype of the loaded (non-quantized) weights, by name (see ModelConfig.dtype): fp32 for full
    fine-tuning unless configured, else the compute precision. studio.train.model.build loads them so."""
    if config.model.dtype != "auto":
        return _CONFIG_DTYPES[config.model.dtype]
    return "fp32" if config.method_spec.trains_every_weight else config.training.precision


def lora_dropout_for(config: RunConfig, adapted: tuple[LinearLayer, ...]) -> float:
    """The adapter's dropout: none when it wraps parameters (peft's ParamWrapper takes no dropout), so that a
    mixture of experts' experts and router are adapted too; studio.train.model.methods does the same."""
    return 0.0 if any(not layer.is_module for layer in adapted) else config.lora.dropout


def attention_for(config: RunConfig, shape: ModelShape) -> str:
    """The attention the worker runs: the configured one, or eager where transformers has no sdpa for the
    family (Gemma 2: sdpa cannot soft-cap its scores)."""
    return config.model.attn_implementation if shape.family.sdpa else "eager"


def samples_with_training_weights(config: RunConfig) -> bool:
    """Whether the run samples completions with HF generate beside its training (grpo; vllm's are its own)."""
    return config.objective == "grpo" and config.grpo.generation_backend == "hf"


def regime_for(config: RunConfig, shape: ModelShape, device_type: str = "cuda", loss_impl: str | None = None) -> Regime:
    training = config.training
    precision = training.precision  # the config's names are the estimate's dtype names
    base = weight_dtype_name(config)
    loss_impl = loss_impl or ("full_fp32" if shape.transformed_logits else loss_impl_for(config))
    if loss_impl not in LOSS_IMPLS:
        raise StudioError(f"unknown loss implementation {loss_impl!r}", "use " + " or ".join(LOSS_IMPLS), kind="config")
    autocast = precision != "fp32"
    spec = config.method_spec
    adapted = (shape.resolve_targets(config.lora.target_modules, parameters=spec.peft_lora)
               if config.adapts_linears else ())
    virtual = config.peft.num_virtual_tokens if spec.trains_virtual_tokens else 0
    prompt = virtual if spec.token_entry == INPUT_TOKENS else 0  # the virtual tokens run through the whole model
    lean_embedding, lean_head = lean_outer_weights(lean_weights_apply(config), autocast,
                                                   shape.family.embedding_module_scales, shape.tie_embeddings)
    return Regime(
        device_type=device_type, compute=precision if autocast else base, autocast=autocast, base_dtype=base,
        quantization=config.effective_load_in, double_quant=config.quantization.double_quant,
        full=spec.trains_every_weight,
        adapted=adapted, rank=config.lora.r, lora_dropout=lora_dropout_for(config, adapted),
        dora=config.lora.use_dora and DORA in spec.settings,
        checkpointing=training.gradient_checkpointing, attention=attention_for(config, shape),
        optimizer=training.optimizer, micro_batch=training.micro_batch_size * config.sequences_per_row,
        accumulation=training.gradient_accumulation_steps, sequence=config.data.max_length + prompt,
        loss_impl=loss_impl, method=spec, virtual_tokens=virtual, feedforward_width=shape.intermediate,
        qat=config.qat.enabled, qat_activations=config.qat.activations != "none",
        lean_embedding=lean_embedding, lean_head=lean_head,
        embedding_on_host=embedding_on_host(config, shape.tie_embeddings),
        head_on_host=output_layer_on_host(config, shape.tie_embeddings, loss_impl == "chunked"),
        activation_offload=training.activation_offload and training.gradient_checkpointing,
        tiled_mlp=training.tiled_mlp, token_logps=config.learns_preferences,
        frozen_reference=config.frozen_reference,
        sampled_group=config.grpo.group_size if samples_with_training_weights(config) else 0,
        completion_length=config.grpo.max_completion_length if samples_with_training_weights(config) else 0,
    )

