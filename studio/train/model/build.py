"""Loading the tokenizer and model and applying the configured techniques.

Each technique goes through its library: bitsandbytes quantization through
``BitsAndBytesConfig``, LoRA/DoRA/rsLoRA, AdaLoRA, IA3, LoHa, LoKr, prefix and
prompt tuning through peft (each method's peft config and training hooks are in
studio.train.model.methods), k-bit preparation as peft's ``prepare_model_for_kbit_training`` does
it (``prepare_kbit_model``, leaner), quantization-aware training through torchao's ``QATConfig``,
checkpointing through transformers (its block inputs offloaded to CPU RAM by studio.train.savers.offload when asked).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
import socket
from pathlib import Path

import torch

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory.regime import lean_outer_weights, lean_weights_apply, weight_dtype_name
from studio.core.model.info import cached_config, load_model_config, looks_like_path
from studio.core.model.vision import VisionFamily, vision_family
from studio.train.model.methods import attach_hooks, hooks_of, peft_config
from studio.train.preflight import refused_pickle_error, weight_load_kwargs
from studio.train.savers import apply_when_built

log = logging.getLogger("studio.train")

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # by the estimate's names


def compute_dtype(config: RunConfig) -> torch.dtype:
    return _TORCH_DTYPES[config.training.precision]


def weight_dtype(config: RunConfig) -> torch.dtype:
    """The dtype of the loaded (non-quantized) weights: the estimate's rule, as a torch dtype."""
    return _TORCH_DTYPES[weight_dtype_name(config)]


def hub_kwargs(config: RunConfig) -> dict:
    kwargs = {"trust_remote_code": config.model.trust_remote_code}
    if config.model.revision:
        kwargs["revision"] = config.model.revision
    return kwargs


def load_error(config: RunConfig, exc: Exception) -> StudioError:
    name = config.model.name_or_path
    if isinstance(exc, pickle.UnpicklingError):  # torch's weights_only loader found code in a pickle file
        return refused_pickle_error(name, exc)
    if Path(name).exists():
        return StudioError(f"cannot load the model in {name}: {exc}",
                           "the folder needs config.json, the weights (*.safetensors) and the tokenizer files", kind="model")
    if looks_like_path(name):
        return StudioError(f"model folder {name} does not exist", "check the path in model.name_or_path", kind="model")
    return StudioError(
        f"cannot get '{name}' from the Hugging Face Hub: {type(exc).__name__}: {exc}",
        "check the id and your network; offline, download it once or point model.name_or_path at a local folder",
        kind="model",
    )


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    from urllib.parse import urlparse

    from huggingface_hub import constants

    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def use_cache_when_offline(config: RunConfig) -> None:
    """Decide in seconds what an unreachable Hub means, instead of a minute of retries.

    A local folder needs no Hub. A Hub id already in the cache loads offline; one that
    is not cached cannot load at all, which is said at once.
    """
    name = config.model.name_or_path
    if Path(name).exists() or os.environ.get("HF_HUB_OFFLINE") == "1" or _hub_reachable():
        return
    if cached_config(name, config.model.revision) is None:
        raise StudioError(f"cannot reach the Hugging Face Hub to download '{name}', and it is not in the local cache",
                          "connect to the network once, or point model.name_or_path at a local model folder", kind="model")
    from huggingface_hub import constants

    log.info("the Hub is unreachable: loading %s from the local cache", name)
    os.environ["HF_HUB_OFFLINE"] = "1"  # for child processes
    constants.HF_HUB_OFFLINE = True  # read at import time, so set it here too


def load_tokenizer(config: RunConfig):
    from transformers import AutoTokenizer

    use_cache_when_offline(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(config.model.name_or_path, **hub_kwargs(config))
    except Exception as exc:  # transformers raises OSError, ValueError, HTTP errors...
        raise load_error(config, exc) from exc
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise StudioError("the tokenizer has neither a pad nor an eos token", "use a tokenizer that defines eos_token", kind="model")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def quantization_config(config: RunConfig):
    from transformers import BitsAndBytesConfig

    load_in = config.effective_load_in
    if load_in == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=config.quantization.quant_type,
            bnb_4bit_use_double_quant=config.quantization.double_quant,
            bnb_4bit_compute_dtype=compute_dtype(config),
            bnb_4bit_quant_storage=torch.uint8,
        )
    if load_in == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def attention_implementation(config: RunConfig) -> str | None:
    """What transformers is asked for: sdpa is its own default (None), which falls back to eager for families
    without sdpa (Gemma 2: sdpa cannot soft-cap the scores); studio.core.memory.regime.attention_for says the same."""
    return None if config.model.attn_implementation == "sdpa" else config.model.attn_implementation


def hub_config(config: RunConfig):
    """The model's transformers config, read from its config.json alone."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(config.model.name_or_path, **hub_kwargs(config))
    except Exception as exc:  # transformers raises OSError, ValueError, HTTP errors...
        raise load_error(config, exc) from exc


def vision_of(config: RunConfig) -> VisionFamily | None:
    """The run's vision-language family, None for a text model (and a family not trained on images yet: its
    causal-LM class loads, as before)."""
    return vision_family(load_model_config(config.model.name_or_path, config.model.revision))


def auto_model_class(config: RunConfig):
    """transformers' auto class of the run's model: image-text to text for a vision-language model."""
    import transformers

    return transformers.AutoModelForImageTextToText if vision_of(config) else transformers.AutoModelForCausalLM


def skeleton_model(config: RunConfig, hf_config=None, dtype: torch.dtype | None = None):
    """The base model's modules with every weight on the meta device, from config.json alone (no weight is read)."""
    with torch.device("meta"):
        return auto_model_class(config).from_config(hf_config or hub_config(config), dtype=dtype or weight_dtype(config),
                                                attn_implementation=attention_implementation(config))


def load_base_model(config: RunConfig, device: torch.device, quantized: bool = True, dtype: torch.dtype | None = None):
    """The base model as configured (``quantized=False`` loads 16/32-bit weights even for QLoRA). On the meta
    device its skeleton: a rank of FSDP's sharded load, which receives rank 0's weights when it is sharded."""
    if device.type == "meta":
        model = skeleton_model(config, dtype=dtype)
        model.config.use_cache = False
        return model
    kwargs = {**hub_kwargs(config), **weight_load_kwargs(config)}
    quant = quantization_config(config) if quantized else None
    if quant is not None:
        kwargs["quantization_config"] = quant
        kwargs["device_map"] = {"": device}
    if config.distributed.layer_split:
        from studio.train.model import layersplit

        placement = layersplit.plan(config)
        kwargs["device_map"] = layersplit.hf_device_map(placement, config)
    try:
        model = auto_model_class(config).from_pretrained(
            config.model.name_or_path,
            dtype=dtype or weight_dtype(config),
            attn_implementation=attention_implementation(config),
            **kwargs,
        )
    except Exception as exc:
        raise load_error(config, exc) from exc
    if config.distributed.layer_split:
        layersplit.dispatch_offloaded(model, placement, kwargs["device_map"])
    elif quant is None:
        model.to(device)
    model.config.use_cache = False
    return model


def qat_base_config(config: RunConfig):
    """The torchao post-training quantization that QAT simulates (and that the export applies)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup

    qat = config.qat
    dtype = {"int4": torch.int4, "int8": torch.int8}[qat.weights]
    if qat.activations == "int8":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=dtype, weight_granularity=PerGroup(qat.group_size))
    return IntxWeightOnlyConfig(weight_dtype=dtype, granularity=PerGroup(qat.group_size))


def qat_targets(model):
    """QAT covers the linear layers except the output head (tied to the embeddings in many models)."""
    head = model.get_output_embeddings()
    return lambda module, name: isinstance(module, torch.nn.Linear) and module is not head


def prepare_qat(model, config: RunConfig):
    """Swap the linears for torchao's fake-quantized ones (the weights stay full precision)."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    wanted = qat_targets(model)
    size = config.qat.group_size
    for name, module in model.named_modules():
        if wanted(module, name) and module.in_features % size:
            raise StudioError(f"qat.group_size {size} does not divide the input width {module.in_features} of {name}",
                              "pick a group size that divides it (32 or 64 usually do)", kind="config")
    quantize_(model, QATConfig(qat_base_config(config), step="prepare"), filter_fn=wanted)
    return model


def prepare_kbit_model(model, config: RunConfig, lean: bool = True) -> None:
    """peft's ``prepare_model_for_kbit_training`` (freeze every weight, upcast the 16-bit ones bitsandbytes did
    not quantize to fp32), except for the frozen weights that need not be fp32 to compute the same numbers
    (``training.lean_weights``, studio.core.memory.regime.lean_outer_weights): the input embedding stays 16-bit
    and its output is cast to fp32, and under autocast the output layer stays 16-bit. ``lean=False``: peft's."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    scales = type(embedding).forward is not torch.nn.Embedding.forward  # Gemma scales the rows in the weight's dtype
    lean_embedding, lean_head = lean_outer_weights(lean and lean_weights_apply(config),
                                                   config.training.precision != "fp32", scales, tied)
    kept = {id(module.weight) for module, stays in ((embedding, lean_embedding), (head, lean_head)) if stays}
    if lean_head and getattr(head, "bias", None) is not None:
        kept.add(id(head.bias))
    for param in model.parameters():
        param.requires_grad = False
        sixteen_bit = param.dtype in (torch.float16, torch.bfloat16) and type(param).__name__ != "Params4bit"
        if sixteen_bit and id(param) not in kept:
            param.data = param.data.to(torch.float32)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # as peft does: the upcasts' 16-bit originals
    if lean_embedding and embedding.weight.dtype != torch.float32:
        embedding.register_forward_hook(_output_as_fp32)


def _output_as_fp32(module, args, output: torch.Tensor) -> torch.Tensor:
    return output.float()


def build_model(config: RunConfig, device: torch.device, total_steps: int | None = None, for_inference: bool = False):
    """The trainable model: base, quantized and prepared if configured, with its adapter.

    ``for_inference``: run without autocast (export, generation), which a 16-bit output layer cannot do on
    fp32 hidden states: k-bit preparation upcasts it as peft does (lean weights are for training)."""
    model = load_base_model(config, device)
    checkpointing = config.training.gradient_checkpointing
    if config.effective_load_in != "none":
        prepare_kbit_model(model, config, lean=not for_inference)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.qat.enabled:
        model = prepare_qat(model, config)
    if config.uses_adapter:
        model = attach_adapter(model, config, total_steps)
        if checkpointing:
            model.enable_input_require_grads()
    freeze_vision_parts(model, config)
    apply_when_built(model, config)
    return model


def freeze_vision_parts(model, config: RunConfig) -> None:
    """A vision-language model's tower and projector train only when vision.train_vision_tower and
    vision.train_projector say so (whole: under LoRA too); by default the language model alone trains."""
    family = vision_of(config)
    if family is None:
        return
    parts = ((family.tower, config.vision.train_vision_tower), (family.projector, config.vision.train_projector))
    for name, param in model.named_parameters():
        for pattern, trains in parts:
            if re.fullmatch(pattern, name):
                param.requires_grad = trains


def attach_adapter(model, config: RunConfig, total_steps: int | None = None):
    from peft import get_peft_model

    try:
        model = get_peft_model(model, peft_config(config, total_steps, model))
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        raise StudioError(f"cannot attach the {config.method} adapter: {exc}",
                          "check lora.target_modules against the model's module names, or use all-linear",
                          kind="config") from exc
    attach_hooks(model, config)
    if config.distributed.layer_split:
        from studio.train.model.layersplit import materialize_offloaded_adapters

        materialize_offloaded_adapters(model)
    return model


def adapted_module_names(model) -> list[str]:
    """The distinct leaf names that received an adapter (e.g. q_proj, c_attn), for the log.

    An adapted parameter (peft's ParamWrapper: a mixture of experts' router and experts) is named by its module
    and, unless it is the module's weight, the parameter (``experts.gate_up_proj``). Prefix and prompt tuning
    adapt no layer: they train ``prompt_encoder`` (the virtual tokens).
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    names = set()
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            leaf = name.replace(".base_layer", "").rsplit(".", 1)[-1]  # wrapped parameters nest their wrappers
            parameter = getattr(module, "parameter_name", "weight")
            names.add(leaf if parameter == "weight" else f"{leaf}.{parameter}")
    if not names and getattr(model, "prompt_encoder", None) is not None:
        names = {"prompt_encoder"}
    return sorted(names)


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit weights count as their element count."""
    trainable = total = 0
    for param in model.parameters():
        n = getattr(param, "ds_numel", param.numel())  # a ZeRO-3 shard counts as the whole parameter
        if getattr(param, "quant_state", None) is not None or param.dtype == torch.uint8:
            n *= 2  # bitsandbytes packs two 4-bit values per byte
        total += n
        trainable += n if param.requires_grad else 0
    return trainable, total


def trainable_state_dict(model) -> dict[str, torch.Tensor]:
    """Only the trained tensors: what a checkpoint needs to restore the model, with what its method keeps
    beside them (AdaLoRA's importance scores; studio.train.model.methods)."""
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in model.named_parameters() if p.requires_grad}
    return {**tensors, **hooks_of(model).checkpoint_state(model)}


def load_trainable_state_dict(model, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = [name for name, p in params.items() if p.requires_grad and name not in tensors]
    if missing:
        raise StudioError(f"the checkpoint lacks {len(missing)} trained tensors (e.g. {missing[0]})",
                          "it was written by a different config; start a new run", kind="checkpoint")
    with torch.no_grad():
        for name, value in hooks_of(model).restore_checkpoint_state(model, tensors).items():
            with whole(params[name]):  # a collective under ZeRO-3: every rank loads the same tensors in order
                params[name].copy_(value.to(params[name].device, params[name].dtype))


def whole(param: torch.nn.Parameter):
    """Around a write to a parameter that ZeRO-3 may hold in shards (built under zero.Init): gathered, and
    rank 0's value shared out again afterwards; nothing for any other parameter."""
    if not hasattr(param, "ds_id"):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([param], modifier_rank=0)
