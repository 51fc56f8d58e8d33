"""GRPO's completions sampled by vLLM (``grpo.generation_backend: vllm``), for an NVIDIA GPU where vllm is installed.

vLLM holds its own copy of the base model and a KV cache pool (``grpo.vllm_memory_fraction`` of the GPU, taken when
it starts) beside the training in the same process; after every optimizer step the run's LoRA adapter is saved as
peft saves it and handed to vLLM as a new LoRA request, so each generation batch samples with the weights of its
step. Each prompt's request carries its own seed (the step's, as HF generate's), so a resumed run samples the same
completions; vLLM's kernels are not HF's, so the completions are not HF generate's.

Validation keeps vLLM to plain LoRA in one process (studio.core.validation); this module says, before any work, when
vllm or the GPU is missing.
"""

from __future__ import annotations

import importlib.util
import tempfile
from itertools import count
from typing import Any

from studio.core.config import RunConfig
from studio.core.errors import StudioError

VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def check_vllm_available(cuda: bool) -> None:
    """Refuse, in words, a vllm run where it cannot sample: vllm not installed, or no NVIDIA GPU."""
    if importlib.util.find_spec("vllm") is None:
        raise StudioError("grpo.generation_backend is vllm, and the Python package vllm is not installed",
                          "pip install vllm into the Python that trains (Linux with an NVIDIA GPU), or set "
                          "grpo.generation_backend to hf", kind="runtime")
    if not cuda:
        raise StudioError("grpo.generation_backend is vllm, which samples on an NVIDIA GPU only, and this machine has "
                          "none", "set grpo.generation_backend to hf, or train on a machine with an NVIDIA GPU",
                          kind="runtime")


class VllmGenerate:
    """Samples the groups of a generation batch with vLLM, the run's adapter as of the last optimizer step."""

    def __init__(self, config: RunConfig, eos_ids: list[int]):
        from vllm import LLM, SamplingParams  # only here: vllm is optional, and CUDA only

        self.settings, self.eos_ids, self._params = config.grpo, eos_ids, SamplingParams
        model = config.model
        self.llm = LLM(model=model.name_or_path, revision=model.revision, trust_remote_code=model.trust_remote_code,
                       dtype=_vllm_dtype(config), enable_lora=True, max_lora_rank=_lora_rank(config.lora.r),
                       max_loras=1, gpu_memory_utilization=config.grpo.vllm_memory_fraction,
                       max_model_len=config.data.max_length, seed=config.training.seed, enforce_eager=True)
        self._adapter_ids = count(1)

    def groups(self, model: Any, prompts: list[list[int]], seeds: list[int]) -> list[list[list[int]]]:
        """Each prompt's group of completions (token ids, an end token kept where it ended) by ``model``'s adapter."""
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        requests = [self._params(n=self.settings.group_size, temperature=self.settings.temperature,
                                 top_p=self.settings.top_p, max_tokens=self.settings.max_completion_length,
                                 seed=seed, stop_token_ids=self.eos_ids, detokenize=False) for seed in seeds]
        with tempfile.TemporaryDirectory(prefix="studio-vllm-adapter-") as folder:
            model.save_pretrained(folder)  # peft's adapter_config.json and adapter_model.safetensors
            number = next(self._adapter_ids)
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], requests,
                                        lora_request=LoRARequest(f"step-{number}", number, folder), use_tqdm=False)
        return [[self._with_end(completion) for completion in output.outputs] for output in outputs]

    def _with_end(self, completion: Any) -> list[int]:
        """A completion's ids with the end token it stopped at (vLLM reports a stop token apart from the ids)."""
        ids = list(completion.token_ids)
        stopped_at = completion.stop_reason
        if completion.finish_reason == "stop" and isinstance(stopped_at, int) and ids[-1:] != [stopped_at]:
            ids.append(stopped_at)
        return ids


def _lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds the run's rank."""
    return next((allowed for allowed in VLLM_LORA_RANKS if allowed >= rank), rank)


def _vllm_dtype(config: RunConfig) -> str:
    """The dtype vLLM computes in: the run's 16-bit precision, else the weights' own."""
    precision = config.training.precision
    return {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "auto")
