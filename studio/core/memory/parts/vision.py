"""The images of a vision-language model's step: their patches and tokens at the processor's resolution, and what
the vision tower holds for them.

Each family studio trains on images has an ``ImageRule`` in ``IMAGE_RULES`` (by model_type): how its processor
resizes an image and how many patches and language-model tokens it becomes, read from the model's
``preprocessor_config.json``, and what its tower's blocks keep for backward per patch. A family joins with its
rule (Qwen2-VL's is the only one so far, shared by Qwen2.5-VL).

What the estimate counts for a micro-batch's images (``vision_memory``):

* inputs: the pixel values (fp32, one row per patch), the grids and the image-token marks of every row;
* saved: what the trained parts keep for backward, per patch (measured on the CPU: Qwen2-VL's block keeps its
  norms' inputs and statistics, its linears' inputs, q and k after the rotary embedding, the qkv output that v
  views, the attention's output and log-sum-exp, and the MLP's activation; the projector its norm's input and
  its MLP's). A frozen tower runs without a graph and keeps nothing;
* transient: a frozen tower's largest moment in its forward pass (the residual stream, one block's MLP);
* sequence: what the language model holds more for image rows than for the text step the estimate traced.

The image tokens themselves are language-model tokens: the rows' lengths (and ``data.max_length``) count them.

Pure Python: no torch, no transformers, no PIL.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory.regime import DTYPE_BYTES, weight_dtype_name
from studio.core.model.info import cached_config, looks_like_path

PREPROCESSOR_FILE = "preprocessor_config.json"
STAT_BYTES = 4  # a norm's mean and reciprocal deviation, fp32


@dataclass(frozen=True)
class ImageSize:
    """One image as the model sees it: its patches (the vision tower's sequence) and its language-model tokens."""

    patches: int
    tokens: int


@dataclass(frozen=True)
class Qwen2VLImages:
    """Qwen2-VL's processor (smart_resize) and vision tower; Qwen2.5-VL resizes alike and is counted alike."""

    def pixel_limits(self, preprocessor: dict) -> tuple[int, int]:
        """(min_pixels, max_pixels) of the processor's resize."""
        size = preprocessor.get("size") or {}
        low = preprocessor.get("min_pixels") or size.get("shortest_edge") or 56 * 56
        high = preprocessor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
        return int(low), int(high)

    def _factors(self, preprocessor: dict) -> tuple[int, int]:
        return int(preprocessor.get("patch_size", 14)), int(preprocessor.get("merge_size", 2))

    def size(self, preprocessor: dict, height: int, width: int, max_pixels: int = 0) -> ImageSize:
        """An image of ``height`` x ``width`` pixels after the processor's resize (``max_pixels``: the run's
        limit, 0 for the processor's own): both sides a multiple of patch x merge, the area within the limits."""
        patch, merge = self._factors(preprocessor)
        factor = patch * merge
        low, high = self.pixel_limits(preprocessor)
        high = max_pixels or high
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > high:
            beta = math.sqrt(height * width / high)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < low:
            beta = math.sqrt(low / (height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        patches = (h // patch) * (w // patch)
        return ImageSize(patches, patches // merge ** 2)

    def largest(self, preprocessor: dict, max_pixels: int = 0) -> ImageSize:
        """The most patches and tokens an image can become under the pixel limit (a square one)."""
        patch, merge = self._factors(preprocessor)
        high = max_pixels or self.pixel_limits(preprocessor)[1]
        tokens = max(1, high // (patch * merge) ** 2)
        return ImageSize(tokens * merge ** 2, tokens)

    def pixel_elements(self, vision_config: dict) -> int:
        """Pixel values per patch: channels x temporal patch x patch²."""
        return (vision_config.get("in_channels", 3) * vision_config.get("temporal_patch_size", 2)
                * vision_config.get("patch_size", 14) ** 2)

    def saved_per_patch(self, vision_config: dict, tower: bool, projector: bool, compute: int) -> int:
        """Bytes the trained parts keep for backward per patch (``compute``: the compute dtype's bytes). A
        trained tower's gradient reaches the projector's input, which then keeps what a trained projector does."""
        embed = vision_config.get("embed_dim") or vision_config["hidden_size"]
        heads = vision_config.get("num_heads", 16)
        mlp = int(embed * vision_config.get("mlp_ratio", 4))
        elements = stats = 0
        if tower:
            depth = vision_config.get("depth", 32)
            # norm1's input, qkv's input and output, q and k roped, attention out, proj's input, norm2's input,
            # fc1's input; the activation's input, its gate and fc2's input; the attention's log-sum-exp
            elements += depth * (11 * embed + 3 * mlp + heads) + 2 * (embed // heads)  # rotary cos and sin, once
            stats += depth * 4
        if tower or projector:
            elements += 4 * embed  # ln_q's input, the merged MLP's two inputs and its GELU's
            stats += 2
        return elements * compute + stats * STAT_BYTES

    def parameters(self, vision_config: dict, tower: bool, projector: bool) -> int:
        """The parameters of the tower (the patch embedding and the blocks) and of the projector, as asked."""
        embed = vision_config.get("embed_dim") or vision_config["hidden_size"]
        mlp = int(embed * vision_config.get("mlp_ratio", 4))
        merged = embed * vision_config.get("spatial_merge_size", 2) ** 2
        count = 0
        if tower:  # the patch embedding (no bias); each block's two LayerNorms, qkv, proj, fc1 and fc2
            count += self.pixel_elements(vision_config) * embed
            count += vision_config.get("depth", 32) * (4 * embed * embed + 2 * embed * mlp + 9 * embed + mlp)
        if projector:  # ln_q, and the merged MLP into the language model's width
            count += 2 * embed + merged * merged + merged + (merged + 1) * vision_config["hidden_size"]
        return count

    def transient_per_patch(self, vision_config: dict, compute: int) -> int:
        """A frozen block's largest moment per patch: the residual stream, the norm's output, the MLP's hidden
        and activation."""
        embed = vision_config.get("embed_dim") or vision_config["hidden_size"]
        return (2 * embed + 2 * int(embed * vision_config.get("mlp_ratio", 4))) * compute


IMAGE_RULES = {"qwen2_vl": Qwen2VLImages(), "qwen2_5_vl": Qwen2VLImages()}


def image_rule(model_config: dict) -> Qwen2VLImages | None:
    """The image rule of a config.json mapping's family; None for a text model or a family without one."""
    return IMAGE_RULES.get(str(model_config.get("model_type", ""))) if "vision_config" in model_config else None


def load_preprocessor_config(name_or_path: str, revision: str = "") -> dict:
    """The model's preprocessor_config.json, from its folder or the Hugging Face cache ({} where there is none:
    the processor's defaults apply)."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        path = local / PREPROCESSOR_FILE
    elif looks_like_path(name_or_path):
        return {}
    else:
        path = cached_config(name_or_path, revision, PREPROCESSOR_FILE)
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StudioError(f"cannot read {path}: {exc}", "check the model folder", kind="model") from exc


@dataclass(frozen=True)
class VisionMemory:
    """What a micro-batch's images hold during a step, in bytes (see the module doc)."""

    images: tuple[int, ...]  # each image's patches
    tokens: int  # their language-model tokens
    inputs: int
    saved: int
    transient: int
    sequence: int  # what the language model holds more for image rows (``_sequence_bytes``)


def worst_case_images(model_config: dict, config: RunConfig) -> tuple[int, ...]:
    """Each row's image at the largest resolution the processor gives (the run's vision.max_pixels), its tokens
    no more than the row holds: the worst case beside rows of ``data.max_length``."""
    rule = image_rule(model_config)
    if rule is None:
        return ()
    preprocessor = load_preprocessor_config(config.model.name_or_path, config.model.revision)
    largest = rule.largest(preprocessor, config.vision.max_pixels)
    merged = largest.patches // largest.tokens
    rows = config.training.micro_batch_size * config.sequences_per_row
    return (min(largest.tokens, config.data.max_length) * merged,) * rows


def vision_memory(model_config: dict, config: RunConfig, images: tuple[int, ...]) -> VisionMemory | None:
    """What ``images`` (each one's patches, one micro-batch's) hold; None for a model without an image rule."""
    rule = image_rule(model_config)
    if rule is None:
        return None
    vision_config = model_config["vision_config"]
    merge = vision_config.get("spatial_merge_size", 2)
    patches = sum(images)
    rows = config.training.micro_batch_size * config.sequences_per_row
    # fp32 pixel values, the (t, h, w) grids, the image-token marks (int64 each)
    inputs = 4 * patches * rule.pixel_elements(vision_config) + 8 * 3 * len(images)
    inputs += 8 * rows * config.data.max_length if images else 0
    precision = config.training.precision  # autocast's dtype, or the weights' without it
    width = DTYPE_BYTES[precision if precision != "fp32" else weight_dtype_name(config)]
    v = config.vision
    saved = patches * rule.saved_per_patch(vision_config, v.train_vision_tower, v.train_projector, width)
    transient = 0 if v.train_vision_tower else patches * rule.transient_per_patch(vision_config, width)
    return VisionMemory(images=tuple(images), tokens=patches // merge ** 2,
                        inputs=inputs * config.training.gradient_accumulation_steps, saved=saved, transient=transient,
                        sequence=_sequence_bytes(model_config, config, rows, width) if images else 0)


def _sequence_bytes(model_config: dict, config: RunConfig, rows: int, width: int) -> int:
    """What the language model holds more for a micro-batch of image rows than the traced text step: the embeddings
    with the image features scattered in (a copy), the 3-D rotary positions (int64), the padded batch's attention
    mask (image rows are not packed); where the tower or projector trains, the first block's input needs a gradient
    and its norm keeps an fp32 copy of it."""
    length = config.data.max_length
    hidden = (model_config.get("text_config") or model_config).get("hidden_size", 0)
    sequence = rows * length * (hidden * width + 3 * 8) + rows * length * length
    if config.vision.train_vision_tower or config.vision.train_projector:
        sequence += 4 * rows * length * hidden
    return sequence
