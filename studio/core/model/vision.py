"""Vision-language models: which families studio trains on images and text, and how their parts are named.

A model is a vision-language one when its ``config.json`` has a ``vision_config``. Each family is an entry of
``VISION_FAMILIES``: the module paths of its vision tower and projector (everything else is the language model,
the only part LoRA adapts and, by default, the only part that trains) and the token its images become. Rows with
images on a family not supported yet (listed without its image token, or absent) are refused, the family named,
before anything loads; such a model still trains on text, as before, through its causal-LM class.
"""

from __future__ import annotations

from dataclasses import dataclass

from studio.core.errors import StudioError


@dataclass(frozen=True)
class VisionFamily:
    name: str
    tower: str
    """A regular expression (peft's full-match style) for the vision tower's modules, the projector's excluded."""
    projector: str
    """A regular expression for the projector's modules (image features into the language model's width)."""
    image_token: str = ""
    """The placeholder its chat template writes for an image, repeated once per image feature (as its processor
    does: an image of ``image_grid_thw`` (t, h, w) patches is t·h·w / merge_size² tokens, Qwen2-VL's rule, the
    only one so far); "" for a family not supported yet."""

    @property
    def supported(self) -> bool:
        return bool(self.image_token)

    @property
    def vision_parts(self) -> str:
        """One regular expression for the tower and the projector: what LoRA leaves alone."""
        return f"(?:{self.tower})|(?:{self.projector})"


_QWEN2_VL_TOWER = r".*\bvisual\.(?!merger\b).*"
_QWEN2_VL_PROJECTOR = r".*\bvisual\.merger\b.*"
VISION_FAMILIES = {
    "qwen2_vl": VisionFamily("Qwen2-VL", _QWEN2_VL_TOWER, _QWEN2_VL_PROJECTOR, "<|image_pad|>"),
    "qwen2_5_vl": VisionFamily("Qwen2.5-VL", _QWEN2_VL_TOWER, _QWEN2_VL_PROJECTOR, "<|image_pad|>"),
    # Known, not yet supported: each needs its image token and its processor's token count (and tests) to join.
    "idefics3": VisionFamily("Idefics3", r".*\bvision_model\..*", r".*\bconnector\..*"),
    "smolvlm": VisionFamily("SmolVLM", r".*\bvision_model\..*", r".*\bconnector\..*"),
    "llava": VisionFamily("LLaVA", r".*\bvision_tower\..*", r".*\bmulti_modal_projector\..*"),
    "gemma3": VisionFamily("Gemma 3", r".*\bvision_tower\..*", r".*\bmulti_modal_projector\..*"),
    "mllama": VisionFamily("Llama 3.2 Vision (mllama)", r".*\bvision_model\..*", r".*\bmulti_modal_projector\..*"),
}
SUPPORTED_VISION = tuple(family.name for family in VISION_FAMILIES.values() if family.supported)


def is_vision_language(config: dict) -> bool:
    """Whether a config.json mapping describes a vision-language model (it has a vision tower's config)."""
    return isinstance(config.get("vision_config"), dict)


def vision_family(config: dict) -> VisionFamily | None:
    """The vision-language family of a config.json mapping that studio trains on images; None for a text model and
    for the families not supported yet (their language model trains on text as any causal LM's)."""
    family = VISION_FAMILIES.get(str(config.get("model_type", ""))) if is_vision_language(config) else None
    return family if family is not None and family.supported else None


def image_training_refusal(config: dict) -> StudioError | None:
    """Why the model of a config.json mapping cannot train on rows with images (its family is not supported yet, or
    it is a text model); None when it can."""
    if vision_family(config) is not None:
        return None
    hint = "choose a Qwen2-VL or Qwen2.5-VL model, or remove the images from the rows"
    supported = " and ".join(SUPPORTED_VISION)
    if not is_vision_language(config):
        return StudioError(f"the data holds images, but the model is a text model: studio trains {supported} on "
                           "images and text", hint, kind="model")
    model_type = str(config.get("model_type", ""))
    name = VISION_FAMILIES[model_type].name if model_type in VISION_FAMILIES else model_type or "an unnamed family"
    return StudioError(f"{name} is a vision-language model that studio does not train on images yet: it trains "
                       f"{supported} on images and text", hint, kind="model")
