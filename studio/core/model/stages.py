"""What a pipeline needs of a model family that its config.json says: read before anything loads (validation),
and again by the worker on the loaded model's config (studio.train.distributed.pipeline), which also checks the
modules themselves."""

from __future__ import annotations

from typing import Any

# config.json keys of a mixture of experts: its router's auxiliary loss needs every block's router logits
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "output_router_logits")
PIPELINE_OFF_HINT = "set distributed.pipeline_stages to 0 (a layer split or ZeRO-3 holds this model too)"


def pipeline_family_refusal(decoder_config: dict[str, Any]) -> str | None:
    """Why a pipeline cannot cut a model of this decoder config (a multimodal model's text config), or None."""
    if experts := [key for key in EXPERT_KEYS if decoder_config.get(key)]:
        return f"a mixture of experts ({experts[0]}): its router's auxiliary loss needs every block"
    windowed = decoder_config.get("sliding_window") and decoder_config.get("use_sliding_window", True)
    if windowed or any(kind != "full_attention" for kind in decoder_config.get("layer_types") or ()):
        return "some blocks attend through a sliding window, which needs a mask of its own"
    return None


def pipeline_refusal_message(family: str, reason: str) -> str:
    return f"a pipeline cannot cut {family} models: {reason}"
