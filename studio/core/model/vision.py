"""Vision-language models: which families studio trains on images and text, and how their parts are named.

A model is a vision-language one when its ``config.json`` has a ``vision_config``. Each family is an entry of
``VISION_FAMILIES``: the module paths of its vision tower and projector (everything else is the language model,
the only part LoRA adapts and, by default, the only part that trains) and the placeholder its chat template writes
for an image, which the family's own processor (transformers') expands into the image's tokens (or, for a family
reading its images through cross-attention, Llama 3.2 Vision's, which stays one token per image). Rows with images on
a family not supported (listed with the reason, or absent) are refused, the family named, before anything loads;
such a model still trains on text, as before, through its causal-LM class.
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
    placeholder: str = ""
    """What its chat template writes for an image, which its processor replaces with the image's tokens; "" for a
    family not supported."""
    unsupported: str = "studio does not train it on images yet"
    """Why a family without a placeholder is not supported."""
    cross_attention: bool = False
    """Whether its language model reads the images through cross-attention layers (mllama): each placeholder stays
    one image token, and a mask over the row's tokens says which image each sees."""

    @property
    def supported(self) -> bool:
        return bool(self.placeholder)

    @property
    def vision_parts(self) -> str:
        """One regular expression for the tower and the projector: what LoRA leaves alone."""
        return f"(?:{self.tower})|(?:{self.projector})"


_QWEN_PROJECTORS = r"(?:merger|deepstack_merger_list)"  # Qwen3-VL adds the deepstack mergers to the merger
_QWEN_TOWER = rf".*\bvisual\.(?!{_QWEN_PROJECTORS}\b).*"
_QWEN_PROJECTOR = rf".*\bvisual\.{_QWEN_PROJECTORS}\b.*"
_QWEN_IMAGE = "<|image_pad|>"
_IDEFICS3 = (r".*\bvision_model\..*", r".*\bconnector\..*", "<image>")
_LLAVA = (r".*\bvision_tower\..*", r".*\bmulti_modal_projector\..*", "<image>")
VISION_FAMILIES = {
    "qwen2_vl": VisionFamily("Qwen2-VL", _QWEN_TOWER, _QWEN_PROJECTOR, _QWEN_IMAGE),
    "qwen2_5_vl": VisionFamily("Qwen2.5-VL", _QWEN_TOWER, _QWEN_PROJECTOR, _QWEN_IMAGE),
    "qwen3_vl": VisionFamily("Qwen3-VL", _QWEN_TOWER, _QWEN_PROJECTOR, _QWEN_IMAGE),
    "gemma3": VisionFamily("Gemma 3", r".*\bvision_tower\..*", r".*\bmulti_modal_projector\..*", "<start_of_image>"),
    "idefics3": VisionFamily("Idefics3", *_IDEFICS3),
    "smolvlm": VisionFamily("SmolVLM", *_IDEFICS3),
    "llava": VisionFamily("LLaVA", *_LLAVA),
    "llava_next": VisionFamily("LLaVA-Next", *_LLAVA),
    "mllama": VisionFamily("Llama 3.2 Vision (mllama)", r".*\bvision_model\..*", r".*\bmulti_modal_projector\b.*",
                           "<|image|>", cross_attention=True),  # its projector is one linear, named without a dot
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
    supported = ", ".join(SUPPORTED_VISION)
    hint = f"choose a {supported} model, or remove the images from the rows"
    if not is_vision_language(config):
        return StudioError(f"the data holds images, but the model is a text model: studio trains {supported} on "
                           "images and text", hint, kind="model")
    model_type = str(config.get("model_type", ""))
    family = VISION_FAMILIES.get(model_type, VisionFamily(model_type or "an unnamed family", "", ""))
    return StudioError(f"{family.name} is a vision-language model that studio does not train on images: "
                       f"{family.unsupported}; it trains {supported} on images and text", hint, kind="model")
