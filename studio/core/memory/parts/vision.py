"""The images of a vision-language model's step: their patches and tokens at the processor's resolution, and what
the vision tower holds for them.

Each family studio estimates on images has an ``ImageRule`` in ``IMAGE_RULES`` (by model_type), made for the
model's config.json mapping: how its processor sizes an image and how many patches and language-model tokens it
becomes, and what its tower's blocks and its projector keep for backward. Qwen2-VL's resizes each image within
pixel limits read from ``preprocessor_config.json``, as Qwen2.5-VL's and Qwen3-VL's do (their towers' blocks their
own); Gemma 3's (SigLIP) and LLaVA's (CLIP) resize every image to the tower's one size
(``FixedResolutionImages``, their blocks counted by ``VitEncoder``); Idefics3's (shared by SmolVLM) splits an
image, scaled to a longest edge, in tiles of the tower's size; LLaVA-Next's tiles it at the best of the model's
grid pinpoints, the whole image one tile more; mllama's makes every image its tower's most tiles, whose features
reach the language model through cross-attention layers (``cross_attention_bytes``). A rule also says how the
run's vision.max_pixels reaches the worker's image processor (``image_processor_limit``), so that the run's images are sized as the
estimate sizes them.

What the estimate counts for a micro-batch's images (``vision_memory``):

* inputs: the pixel values (fp32, one row per patch), Qwen2-VL's grids, Idefics3's pixel mask and the image-token
  marks of every row;
* saved: what the trained parts keep for backward (measured on the CPU with autograd's saved-tensor hooks: a
  block keeps its norms' inputs and statistics, its linears' inputs, q, k and v, the attention's output and
  log-sum-exp, and its MLP's activation; a projector its norm's and its linears' inputs). A frozen tower (no
  adapter in it: LoRA adapts the language model alone) runs without a graph and keeps nothing, nor does a frozen
  projector: only their output, the language model's input, stays;
* transient: a frozen tower's largest moment in its forward pass (the residual stream, one block's MLP; LLaVA's
  tower beside every hidden state it returns);
* sequence: what the language model holds more for (padded) image rows than for the text step it is estimated
  from.

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


@dataclass(frozen=True, eq=False)
class ImageRule:
    """What the estimate asks of a family's images, answered from the model's config.json mapping
    (``model_config``) and its preprocessor_config.json (``preprocessor``)."""

    model_config: dict

    fixed_resolution = False
    """Whether the processor resizes every image to the tower's one size (vision.max_pixels changes nothing)."""
    token_marks = True
    """Whether the processor marks the image tokens of each row (an int64 per token beside the ids)."""
    position_axes = 0
    """The language model's positions per token beside the text step's (Qwen2-VL's 3-D rotary ones)."""
    mask_kinds = 1
    """The attention masks the language model builds for a padded batch (Gemma 3: a full and a sliding one)."""
    scatters = True
    """Whether the image features are scattered into a copy of the text's embeddings (not mllama's: its language
    model reads them through cross-attention)."""

    def size(self, preprocessor: dict, height: int, width: int, max_pixels: int = 0) -> ImageSize:
        raise NotImplementedError

    def largest(self, preprocessor: dict, max_pixels: int = 0) -> ImageSize:
        raise NotImplementedError

    def worst_case_patches(self, preprocessor: dict, max_pixels: int, max_tokens: int) -> int:
        """The patches of the largest image (``largest``), its tokens no more than ``max_tokens``."""
        largest = self.largest(preprocessor, max_pixels)
        return min(largest.tokens, max_tokens) * (largest.patches // largest.tokens)

    def pixel_elements(self) -> int:
        """Pixel values per patch (fp32 in the micro-batch)."""
        raise NotImplementedError

    def tokens(self, images: tuple[int, ...]) -> int:
        """The language-model tokens of ``images`` (each one's patches)."""
        raise NotImplementedError

    def saved(self, images: tuple[int, ...], tower: bool, projector: bool, compute: int) -> int:
        """Bytes the trained parts keep for backward on ``images`` (``compute``: the compute dtype's bytes)."""
        raise NotImplementedError

    def transient(self, images: tuple[int, ...], compute: int) -> int:
        """A frozen tower's largest moment in its forward pass on ``images``."""
        raise NotImplementedError

    def parameters(self, tower: bool, projector: bool) -> int:
        """The parameters of the tower and of the projector, as asked."""
        raise NotImplementedError

    def grid_bytes(self, images: int) -> int:
        """The processor's per-image inputs beside the pixel values (Qwen2-VL's grids)."""
        return 0

    def pixel_mask_bytes(self) -> int:
        """The processor's pixel mask per patch beside the pixel values (Idefics3's)."""
        return 0

    def processor_limit(self, preprocessor: dict, max_pixels: int) -> dict:
        """The image processor's arguments that put the run's vision.max_pixels in effect (Qwen2-VL's resize)."""
        return {"max_pixels": max_pixels}

    def cross_attention_bytes(self, images: tuple[int, ...], config: RunConfig, width: int) -> int:
        """What the language model's cross-attention layers keep for ``images`` beside the traced text step (none
        but mllama's)."""
        return 0


@dataclass(frozen=True)
class VitEncoder:
    """A ViT tower's blocks as SigLIP's and CLIP's run them (pre-norm LayerNorms, SDPA, fc1, activation, fc2): what
    one block keeps for backward per position, measured on the CPU."""

    width: int
    mlp: int
    heads: int
    activation: str

    @classmethod
    def of(cls, vision_config: dict, defaults: dict) -> "VitEncoder":
        v = {**defaults, **vision_config}
        return cls(v["hidden_size"], v["intermediate_size"], v["num_attention_heads"], v["hidden_act"])

    @property
    def activation_saves(self) -> int:
        """MLP-wide tensors its activation keeps beside fc1's output: quick_gelu (x * sigmoid(1.702 x)) its sigmoid
        and the product; a GELU its output (fc2's input) alone."""
        return 2 if self.activation == "quick_gelu" else 1

    def saved_per_position(self, compute: int) -> int:
        """norm1's input and output (q, k and v's input), q, k, v, the attention's output (out_proj's input, the
        same storage), norm2's input and output (fc1's input); fc1's output and what the activation keeps; the
        attention's fp32 log-sum-exp per head and the norms' fp32 mean and reciprocal deviation."""
        elements = 8 * self.width + (1 + self.activation_saves) * self.mlp
        return elements * compute + (self.heads + 4) * STAT_BYTES

    def transient_per_position(self, compute: int) -> int:
        """A frozen block's largest moment: the residual stream, the norm's output, fc1's output and what the
        activation makes of it."""
        return (2 * self.width + (1 + self.activation_saves) * self.mlp) * compute

    def block_parameters(self) -> int:
        """Two LayerNorms, q, k, v and out_proj, fc1 and fc2, with their biases."""
        w, m = self.width, self.mlp
        return 4 * w * w + 2 * w * m + 9 * w + m


class Qwen2VLImages(ImageRule):
    """Qwen2-VL's processor (smart_resize) and vision tower."""

    position_axes = 3
    defaults: dict = {}  # the vision config's defaults (transformers'), for the rules of its successors

    def _vision(self) -> dict:
        return {**self.defaults, **self.model_config["vision_config"]}

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

    def pixel_elements(self) -> int:
        """Channels x temporal patch x patch²."""
        vision_config = self.model_config["vision_config"]
        return (vision_config.get("in_channels", 3) * vision_config.get("temporal_patch_size", 2)
                * vision_config.get("patch_size", 14) ** 2)

    def tokens(self, images: tuple[int, ...]) -> int:
        return sum(images) // self.model_config["vision_config"].get("spatial_merge_size", 2) ** 2

    def grid_bytes(self, images: int) -> int:
        return 8 * 3 * images  # each image's (t, h, w) grid, int64

    def saved(self, images: tuple[int, ...], tower: bool, projector: bool, compute: int) -> int:
        """Per patch. A trained tower's gradient reaches the projector's input, which then keeps what a trained
        projector does."""
        vision_config = self.model_config["vision_config"]
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
        return sum(images) * (elements * compute + stats * STAT_BYTES)

    def parameters(self, tower: bool, projector: bool) -> int:
        """The patch embedding (no bias) and the blocks; the projector: ln_q and the merged MLP into the language
        model's width."""
        vision_config = self.model_config["vision_config"]
        embed = vision_config.get("embed_dim") or vision_config["hidden_size"]
        mlp = int(embed * vision_config.get("mlp_ratio", 4))
        merged = embed * vision_config.get("spatial_merge_size", 2) ** 2
        count = 0
        if tower:  # each block's two LayerNorms, qkv, proj, fc1 and fc2
            count += self.pixel_elements() * embed
            count += vision_config.get("depth", 32) * (4 * embed * embed + 2 * embed * mlp + 9 * embed + mlp)
        if projector:
            count += 2 * embed + merged * merged + merged + (merged + 1) * vision_config["hidden_size"]
        return count

    def transient(self, images: tuple[int, ...], compute: int) -> int:
        """Per patch: the residual stream, the norm's output, the MLP's hidden and activation."""
        vision_config = self.model_config["vision_config"]
        embed = vision_config.get("embed_dim") or vision_config["hidden_size"]
        return sum(images) * (2 * embed + 2 * int(embed * vision_config.get("mlp_ratio", 4))) * compute


class Qwen25VLImages(Qwen2VLImages):
    """Qwen2.5-VL: Qwen2-VL's resize, a tower of RMSNorm and SwiGLU blocks (windowed attention in most of them,
    which keeps what full attention does), its merger into out_hidden_size."""

    defaults = {"depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16, "spatial_merge_size": 2,
                "out_hidden_size": 3584}

    def _widths(self) -> tuple[int, int, int]:
        """The tower's width, its MLP's and its heads."""
        v = self._vision()
        return v["hidden_size"], v["intermediate_size"], v["num_heads"]

    def saved(self, images: tuple[int, ...], tower: bool, projector: bool, compute: int) -> int:
        """Per patch, as saved-tensor hooks show: an RMSNorm keeps an fp32 copy of its input, its reciprocal
        deviation and the normed value in the compute dtype (its weight's gradient); a block, its two norms, qkv's
        output, q and k roped, the attention's output and log-sum-exp, proj's input (its output copied out of the
        heads), the norms' outputs (qkv's and the MLP's input), and gate, up, their activation and their product;
        the rotary cos and sin (fp32) once. The merger's norm, its MLP's two inputs and its GELU's; the windows'
        order (an int64 per token) to put its output back."""
        width, mlp, heads = self._widths()
        per_patch = 0
        if tower:
            norm = 4 * width + STAT_BYTES
            block = 2 * norm + (11 * width + 4 * mlp) * compute + heads * STAT_BYTES
            per_patch += self._vision()["depth"] * block + 2 * (width // heads) * 4
            per_patch += 4 * width + STAT_BYTES  # the merger's norm, its input needing a gradient
        if tower or projector:
            per_patch += 4 * width * compute + 8 / self._vision()["spatial_merge_size"] ** 2
        return int(sum(images) * per_patch)

    def transient(self, images: tuple[int, ...], compute: int) -> int:
        """Per patch: the residual stream, the norm's output, gate's and up's outputs and the activation."""
        width, mlp, _ = self._widths()
        return sum(images) * (2 * width + 3 * mlp) * compute

    def parameters(self, tower: bool, projector: bool) -> int:
        """The patch embedding (no bias) and the blocks (two RMSNorms, qkv and proj, gate, up and down with their
        biases); the projector: its RMSNorm and the merged MLP into out_hidden_size."""
        v = self._vision()
        width, mlp, _ = self._widths()
        merged = width * v["spatial_merge_size"] ** 2
        count = 0
        if tower:
            count += self.pixel_elements() * width
            count += v["depth"] * (4 * width * width + 3 * width * mlp + 7 * width + 2 * mlp)
        if projector:
            count += width + merged * merged + merged + (merged + 1) * v["out_hidden_size"]
        return count


class Qwen3VLImages(Qwen2VLImages):
    """Qwen3-VL: Qwen2-VL's resize, a tower of ViT blocks (LayerNorms, a GELU MLP) whose learned position
    embeddings are interpolated to each image's grid, its merger into out_hidden_size, and one deepstack merger
    per deepstack_visual_indexes block, each of whose features joins a language-model layer."""

    defaults = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "spatial_merge_size": 2,
                "hidden_act": "gelu_pytorch_tanh", "out_hidden_size": 3584, "num_position_embeddings": 2304,
                "deepstack_visual_indexes": (8, 16, 24)}
    interpolation_bytes = 4 * 8 + 4 * 4  # a patch's four neighbouring positions (int64) and their weights (fp32)

    def encoder(self) -> VitEncoder:
        v = self._vision()
        return VitEncoder(v["hidden_size"], v["intermediate_size"], v["num_heads"], v["hidden_act"])

    def saved(self, images: tuple[int, ...], tower: bool, projector: bool, compute: int) -> int:
        """Per patch, as saved-tensor hooks show: a ViT block keeps qkv's fused output, q and k roped and proj's
        input (copied out of the heads) beside what VitEncoder counts; the rotary cos and sin (fp32) and the
        position interpolation once. The merger keeps its norm's input and statistics, its MLP's two inputs and
        its GELU's; a deepstack merger the same after the pixel shuffle, its norm's input (the block's output)
        already kept where the tower trains."""
        v, encoder = self._vision(), self.encoder()
        width = encoder.width
        per_patch = 0.0
        if tower:
            block = encoder.saved_per_position(compute) + 3 * width * compute
            per_patch += v["depth"] * block + 2 * (width // encoder.heads) * 4 + self.interpolation_bytes
        if tower or projector:
            merger = 4 * width * compute + 2 * STAT_BYTES
            deepstack = (3 if tower else 4) * width * compute + 2 * STAT_BYTES / v["spatial_merge_size"] ** 2
            per_patch += merger + len(v["deepstack_visual_indexes"]) * deepstack
        return int(sum(images) * per_patch)

    def transient(self, images: tuple[int, ...], compute: int) -> int:
        return sum(images) * self.encoder().transient_per_position(compute)

    def parameters(self, tower: bool, projector: bool) -> int:
        """The patch embedding (with its bias), the position embeddings and the blocks; the projector: the merger
        (its LayerNorm before the pixel shuffle) and the deepstack mergers (theirs after it)."""
        v, encoder = self._vision(), self.encoder()
        width = encoder.width
        merged = width * v["spatial_merge_size"] ** 2
        count = 0
        if tower:
            count += (self.pixel_elements() + 1 + v["num_position_embeddings"]) * width
            count += v["depth"] * encoder.block_parameters()
        if projector:
            mlp = merged * merged + merged + (merged + 1) * v["out_hidden_size"]
            count += 2 * width + mlp + len(v["deepstack_visual_indexes"]) * (2 * merged + mlp)
        return count


class FixedResolutionImages(ImageRule):
    """A family whose processor resizes every image to the tower's ``image_size`` square (SigLIP's, CLIP's): each
    image the same patches, whatever its size; vision.max_pixels changes nothing."""

    fixed_resolution = True
    defaults: dict = {}  # the vision config's defaults (transformers')
    resolution_note = "the processor resizes every image to the vision tower's size"  # why max_pixels does nothing
    largest_label = "an image"

    def encoder(self) -> VitEncoder:
        return VitEncoder.of(self.model_config.get("vision_config") or {}, self.defaults)

    def _vision(self) -> dict:
        return {**self.defaults, **(self.model_config.get("vision_config") or {})}

    def patches_per_image(self) -> int:
        v = self._vision()
        return (v["image_size"] // v["patch_size"]) ** 2

    def tokens_per_image(self) -> int:
        raise NotImplementedError

    def size(self, preprocessor: dict, height: int, width: int, max_pixels: int = 0) -> ImageSize:
        return self.largest(preprocessor)

    def largest(self, preprocessor: dict, max_pixels: int = 0) -> ImageSize:
        return ImageSize(self.patches_per_image(), self.tokens_per_image())

    def tokens(self, images: tuple[int, ...]) -> int:
        return len(images) * self.tokens_per_image()

    def pixel_elements(self) -> int:
        v = self._vision()
        return v.get("num_channels", 3) * v["patch_size"] ** 2

    def _tower_parameters(self, positions: int) -> int:
        """The patch embedding, the position embedding and the blocks."""
        v, encoder = self._vision(), self.encoder()
        return (self.pixel_elements() * encoder.width + positions * encoder.width
                + v["num_hidden_layers"] * encoder.block_parameters())


class Gemma3Images(FixedResolutionImages):
    """Gemma 3: a SigLIP tower at its one resolution, its last hidden state (after post_layernorm) average-pooled
    to mm_tokens_per_image tokens, RMS-normed and projected by one matrix into the language model's width."""

    defaults = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh"}
    mask_kinds = 2  # its layers alternate sliding-window and full attention

    def tokens_per_image(self) -> int:
        return self.model_config.get("mm_tokens_per_image", 256)

    def saved(self, images: tuple[int, ...], tower: bool, projector: bool, compute: int) -> int:
        """The tower: every block, post_layernorm's input and the pooling's (contiguous) input, per patch. The
        projector per token, as its fp32 RMSNorm keeps them: its input and reciprocal deviation where the gradient
        goes on to the tower, the normed product (the weight's) and its scaled copy (the projection's)."""
        encoder, v = self.encoder(), self._vision()
        patches, tokens = sum(images), self.tokens(images)
        saved = 0
        if tower:
            block = v["num_hidden_layers"] * encoder.saved_per_position(compute)
            saved += patches * (block + 2 * encoder.width * compute + 2 * STAT_BYTES)
        norm = (encoder.width + 1) * 4 if tower else 0
        saved += tokens * (norm + (2 * encoder.width * 4 if projector else 0))
        return saved

    def transient(self, images: tuple[int, ...], compute: int) -> int:
        return sum(images) * self.encoder().transient_per_position(compute)

    def parameters(self, tower: bool, projector: bool) -> int:
        """The tower with its patch embedding's bias and its post_layernorm (a pooling head, where SigLIP's config
        has one, gets no gradient: Gemma 3 reads the last hidden state); the projector: its RMSNorm and its
        projection matrix."""
        width = self.encoder().width
        text = (self.model_config.get("text_config") or {}).get("hidden_size", 2304)
        count = self._tower_parameters(self.patches_per_image()) + 3 * width if tower else 0
        return count + ((width + width * text) if projector else 0)


class LlavaImages(FixedResolutionImages):
    """LLaVA: a CLIP tower at its one resolution (its patches and a CLS position), the hidden state of
    vision_feature_layer (the CLS dropped by the "default" select strategy) into a two-linear GELU MLP. The blocks
    after that layer run without being kept: nothing reads their output."""

    token_marks = False
    defaults = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                "image_size": 336, "patch_size": 14, "hidden_act": "quick_gelu"}

    def _layers(self) -> tuple[int, ...]:
        layer = self.model_config.get("vision_feature_layer", -2)
        return tuple(layer) if isinstance(layer, list) else (layer,)

    def kept_blocks(self) -> int:
        """The blocks up to the deepest selected layer's (hidden state 0 is the embeddings')."""
        depth = self._vision()["num_hidden_layers"]
        return max(layer if layer >= 0 else depth + 1 + layer for layer in self._layers())

    def tokens_per_image(self) -> int:
        full = self.model_config.get("vision_feature_select_strategy", "default") == "full"
        return self.patches_per_image() + full

    def sequences(self, images: tuple[int, ...]) -> int:
        """The tower's sequences on ``images`` (each one CLS position beside its patches): one an image."""
        return len(images)

    def projected(self, images: tuple[int, ...]) -> int:
        """The selected features the projector maps: the images' tokens."""
        return self.tokens(images)

    def saved(self, images: tuple[int, ...], tower: bool, projector: bool, compute: int) -> int:
        """The tower per position (its patches and the CLS): pre_layrnorm's input and statistics, the kept blocks.
        The projector per token: linear_1's input (the selected features, a copy) and its GELU's and linear_2's
        where it trains; the GELU's input alone where only the tower's gradient passes through it."""
        encoder = self.encoder()
        text = (self.model_config.get("text_config") or {}).get("hidden_size", 4096)
        features = encoder.width * len(self._layers())
        positions, tokens = sum(images) + self.sequences(images), self.projected(images)
        saved = 0
        if tower:
            block = self.kept_blocks() * encoder.saved_per_position(compute)
            saved += positions * (block + encoder.width * compute + 2 * STAT_BYTES)
        if projector:
            return saved + tokens * (features + 2 * text) * compute
        return saved + (tokens * text * compute if tower else 0)

    def transient(self, images: tuple[int, ...], compute: int) -> int:
        """A block's moment beside every hidden state so far (the tower returns them all: LLaVA selects one)."""
        encoder = self.encoder()
        depth = self._vision()["num_hidden_layers"]
        positions = sum(images) + self.sequences(images)
        return positions * (encoder.transient_per_position(compute) + depth * encoder.width * compute)

    def parameters(self, tower: bool, projector: bool) -> int:
        """The tower (its class embedding, pre_layrnorm and post_layernorm beside the blocks); the projector's two
        linears with their biases."""
        width = self.encoder().width
        text = (self.model_config.get("text_config") or {}).get("hidden_size", 4096)
        features = width * len(self._layers())
        count = self._tower_parameters(self.patches_per_image() + 1) + 5 * width if tower else 0
        return count + ((features * text + text + text * text + text) if projector else 0)


class Idefics3Images(FixedResolutionImages):
    """Idefics3 and SmolVLM: the processor scales an image so its longest edge is ``size.longest_edge`` (the run's
    vision.max_pixels lowers it), rounds both sides up to tiles of ``max_image_size.longest_edge`` and, where it
    then has more than one, splits it in them beside the whole image downscaled to one (the global tile). Each tile
    is a fixed-resolution image of the SigLIP tower; its last hidden state (after post_layernorm) is pixel-shuffled
    by scale_factor into fewer, wider positions and projected by one matrix (no bias): patches / scale_factor²
    tokens a tile, between tile markers (text tokens, counted in the row's length)."""

    fixed_resolution = False  # an image's tiles follow its size and aspect under the longest edge
    token_marks = False
    defaults = {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 16,
                "image_size": 224, "patch_size": 32, "hidden_act": "gelu_pytorch_tanh"}
    processor_defaults = {"size": {"longest_edge": 4 * 364}, "max_image_size": {"longest_edge": 364},
                          "do_image_splitting": True}  # transformers' Idefics3ImageProcessor's
    largest_side = 4096  # the processor's MAX_IMAGE_SIZE: no image is scaled beyond it

    def _processor(self, preprocessor: dict) -> tuple[int, int, bool]:
        """(the longest edge an image is scaled to, a tile's side, whether images are split in tiles)."""
        p = {**self.processor_defaults, **preprocessor}
        return int(p["size"]["longest_edge"]), int(p["max_image_size"]["longest_edge"]), bool(p["do_image_splitting"])

    def longest_edge(self, preprocessor: dict, max_pixels: int = 0) -> int:
        """The longest edge under ``max_pixels`` (0: the processor's own): the largest multiple of a tile's side
        whose square is within the limit (the processor rounds an image up to whole tiles), one tile at the least."""
        longest, tile, _ = self._processor(preprocessor)
        return max(tile, math.isqrt(max_pixels) // tile * tile) if max_pixels else longest

    def pixel_limits(self, preprocessor: dict) -> tuple[int, int]:
        """(one tile's pixels, the processor's own longest edge squared)."""
        longest, tile, _ = self._processor(preprocessor)
        return tile * tile, longest * longest

    def processor_limit(self, preprocessor: dict, max_pixels: int) -> dict:
        return {"size": {"longest_edge": self.longest_edge(preprocessor, max_pixels)}}

    def tiles(self, preprocessor: dict, height: int, width: int, max_pixels: int = 0) -> int:
        """The tiles the processor makes of an image: scaled to the longest edge, kept under ``largest_side``, both
        sides rounded up to whole tiles; more than one and the global tile joins them."""
        _, tile, split = self._processor(preprocessor)
        if not split:
            return 1
        height, width = _longest_edge_to(height, width, self.longest_edge(preprocessor, max_pixels), even=True)
        if max(height, width) > self.largest_side:
            height, width = _longest_edge_to(height, width, self.largest_side, even=False)
        height, width = _whole_tiles(height, width, tile)
        count = (height // tile) * (width // tile)
        return count + 1 if count > 1 else 1

    def _tile_size(self, preprocessor: dict, tiles: int) -> ImageSize:
        tile = self._processor(preprocessor)[1]
        patches = tiles * (tile // self._vision()["patch_size"]) ** 2
        return ImageSize(patches, patches // self._scale() ** 2)

    def _scale(self) -> int:
        return int(self.model_config.get("scale_factor", 2))

    def size(self, preprocessor: dict, height: int, width: int, max_pixels: int = 0) -> ImageSize:
        return self._tile_size(preprocessor, self.tiles(preprocessor, height, width, max_pixels))

    def largest(self, preprocessor: dict, max_pixels: int = 0) -> ImageSize:
        """A square image: the most tiles the longest edge gives."""
        side = self.longest_edge(preprocessor, max_pixels)
        return self.size(preprocessor, side, side, max_pixels)

    def tokens(self, images: tuple[int, ...]) -> int:
        return sum(images) // self._scale() ** 2

    def pixel_mask_bytes(self) -> int:
        return 8 * self._vision()["patch_size"] ** 2  # pixel_attention_mask: an int64 per pixel

    def saved(self, images: tuple[int, ...], tower: bool, projector: bool, compute: int) -> int:
        """Per patch, as the CPU's saved tensors show. The tower: the patch embedding's input (the real tiles'
        pixel values, a copy), the position ids (int64), every block and post_layernorm's input and statistics. The
        projector: its input (the shuffled features, as wide per token as its patches together); a frozen one keeps
        nothing, the tower's gradient passing through its matrix."""
        encoder, v = self.encoder(), self._vision()
        per_patch = encoder.width * compute if projector else 0
        if tower:
            block = v["num_hidden_layers"] * encoder.saved_per_position(compute)
            per_patch += (block + (self.pixel_elements() + encoder.width) * compute + 8 + 2 * STAT_BYTES)
        return sum(images) * per_patch

    def transient(self, images: tuple[int, ...], compute: int) -> int:
        """A block's moment beside the copies of the real tiles' pixel values and pixel mask the model makes
        before the tower (dropping the padded tiles), which live until the features are out."""
        per_patch = self.encoder().transient_per_position(compute) + self.pixel_elements() * compute
        return sum(images) * (per_patch + self.pixel_mask_bytes())

    def parameters(self, tower: bool, projector: bool) -> int:
        """The tower (its patch embedding's bias and post_layernorm beside the blocks); the projector's matrix from
        scale_factor² tower positions into the language model's width."""
        width = self.encoder().width
        text = (self.model_config.get("text_config") or {}).get("hidden_size", 4096)
        count = self._tower_parameters(self.patches_per_image()) + 3 * width if tower else 0
        return count + (width * self._scale() ** 2 * text if projector else 0)


def _aspect_ratios(tiles: int) -> list[tuple[int, int]]:
    """mllama's supported aspect ratios: every (width, height) in tiles of at most ``tiles`` tiles."""
    return [(w, h) for w in range(1, tiles + 1) for h in range(1, tiles + 1) if w * h <= tiles]


def _adapts(config: RunConfig, name: str) -> bool:
    """Whether the run's adapter wraps the linear layers named ``name`` (peft's rule: a name, or a dotted path's
    end); full fine-tuning trains them all."""
    if not config.uses_adapter:
        return False
    targets = config.lora.target_modules if config.adapts_linears else ()
    return "all-linear" in targets or any(t == name or t.endswith("." + name) for t in targets)


def _longest_edge_to(height: int, width: int, longest: int, even: bool) -> tuple[int, int]:
    """An image's sides with its longest edge at ``longest``, the aspect kept (the other side truncated, then made
    even where ``even``), as Idefics3's processor computes them."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2 if even else 0
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2 if even else 0
    return max(height, 1), max(width, 1)


def _whole_tiles(height: int, width: int, tile: int) -> tuple[int, int]:
    """Idefics3's resize for its tower: the longest side rounded up to whole tiles, the other side from the aspect,
    rounded up too."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        return math.ceil(int(width / aspect) / tile) * tile, width
    height = math.ceil(height / tile) * tile
    return height, math.ceil(int(height * aspect) / tile) * tile


class LlavaNextImages(LlavaImages):
    """LLaVA-Next ("anyres"): each image resized into the best of image_grid_pinpoints (config.json's, which the
    model reads to split its features back), cut into tiles of the tower's size, and the whole image resized to
    one more tile; every tile goes through LLaVA's CLIP tower and projector. The model then unpads the grid's
    features to the image's aspect and ends each of their rows with image_newline, the base tile's before them
    (transformers' pack_image_features; its processor counts the tokens alike). An image's patches are its tiles'
    (its tiles: its patches over a tile's)."""

    PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))  # LlavaNextConfig's default
    resolution_note = ("the processor tiles every image at the best of image_grid_pinpoints, which the model reads "
                       "from its config.json to split the features back, so its tiles cannot be capped alone")
    largest_label = "at most an image"

    def processor_limit(self, preprocessor: dict, max_pixels: int) -> dict:
        """Nothing: the pinpoints are the model's as much as the processor's."""
        return {}

    def _pinpoints(self) -> list[tuple[int, int]]:
        return [(int(h), int(w)) for h, w in self.model_config.get("image_grid_pinpoints") or self.PINPOINTS]

    def _grid(self, height: int, width: int) -> tuple[int, int]:
        """The tiles (rows, columns) of the pinpoint the processor picks for an image (select_best_resolution: the
        most of the image's pixels kept, then the least padding)."""
        best, kept, wasted = self._pinpoints()[0], 0, math.inf
        for target_height, target_width in self._pinpoints():
            scale = min(target_width / width, target_height / height)
            effective = min(int(width * scale) * int(height * scale), width * height)
            waste = target_width * target_height - effective
            if effective > kept or (effective == kept and waste < wasted):
                best, kept, wasted = (target_height, target_width), effective, waste
        tile = self._vision()["image_size"]
        return best[0] // tile, best[1] // tile

    def _side(self) -> int:
        """A tile's patches along each side."""
        v = self._vision()
        return v["image_size"] // v["patch_size"]

    def tiles(self, height: int, width: int) -> int:
        """The tower's tiles for an image: its grid's and the base tile."""
        rows, columns = self._grid(height, width)
        return rows * columns + 1

    def _packed_tokens(self, rows: int, columns: int, height: int, width: int) -> int:
        """The grid's features unpadded to the image's aspect (unpad_image), a newline after each of their rows,
        and the base tile's tokens."""
        tall, wide = rows * self._side(), columns * self._side()
        if width / height > wide / tall:
            tall -= 2 * ((tall - int(round(height * (wide / width), 7))) // 2)
        else:
            wide -= 2 * ((wide - int(round(width * (tall / height), 7))) // 2)
        return tall * wide + tall + self.tokens_per_image()

    def size(self, preprocessor: dict, height: int, width: int, max_pixels: int = 0) -> ImageSize:
        rows, columns = self._grid(height, width)
        return ImageSize((rows * columns + 1) * self.patches_per_image(),
                         self._packed_tokens(rows, columns, height, width))

    def _pinpoint_sizes(self) -> list[ImageSize]:
        """Each pinpoint's image at its own size: nothing unpadded, the most tokens its tiles give."""
        tile = self._vision()["image_size"]
        return [self.size({}, height // tile * tile, width // tile * tile) for height, width in self._pinpoints()]

    def largest(self, preprocessor: dict, max_pixels: int = 0) -> ImageSize:
        """The pinpoint with the most tiles, at its own aspect."""
        return max(self._pinpoint_sizes(), key=lambda size: (size.patches, size.tokens))

    def worst_case_patches(self, preprocessor: dict, max_pixels: int, max_tokens: int) -> int:
        """The most patches an image of at most ``max_tokens`` tokens has (the fewest tiles' where none is as
        short)."""
        sizes = self._pinpoint_sizes()
        within = [size for size in sizes if size.tokens <= max_tokens]
        return max(within or [min(sizes, key=lambda size: size.tokens)], key=lambda size: size.patches).patches

    def sequences(self, images: tuple[int, ...]) -> int:
        """One an image's tile."""
        return sum(images) // self.patches_per_image()

    def projected(self, images: tuple[int, ...]) -> int:
        """Every tile's selected features, before they are unpadded."""
        return self.sequences(images) * self.tokens_per_image()

    def tokens(self, images: tuple[int, ...]) -> int:
        """At most: each image's tiles as the pinpoint of as many that gives the most tokens (an image of its
        aspect: unpadding only takes away)."""
        most: dict[int, int] = {}
        for size in self._pinpoint_sizes():
            most[size.patches] = max(most.get(size.patches, 0), size.tokens)
        return sum(most.get(patches, self.projected((patches,))) for patches in images)

    def grid_bytes(self, images: int) -> int:
        return 8 * 2 * images  # each image's size (height, width), int64


class MllamaImages(FixedResolutionImages):
    """Llama 3.2 Vision (mllama): every image becomes max_num_tiles tiles of the tower's image_size (the processor
    pads an image's unused tiles, and they run through the tower too), each its patches and a CLS position padded
    to a multiple of 8; the tower attends across an image's tiles under a square mask of them all, keeps every
    local layer's output (some of them feed the projector beside the global layers' output), and its projected
    features reach the language model through cross-attention layers, not as tokens: an image is one token of the
    text (its placeholder). A micro-batch gives every row as many image slots as the row with the most."""

    token_marks = False
    scatters = False
    text_defaults = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38]}
    defaults = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_global_layers": 8,
                "hidden_act": "gelu",
                "attention_heads": 16, "image_size": 560, "patch_size": 14, "max_num_tiles": 4,
                "intermediate_layers_indices": [3, 7, 15, 23, 30], "vision_output_dim": 7680, "num_channels": 3}
    resolution_note = "the processor makes every image max_num_tiles tiles of the vision tower's size"

    def _tiles(self) -> int:
        return self._vision()["max_num_tiles"]

    def _tile_patches(self) -> int:
        v = self._vision()
        return (v["image_size"] // v["patch_size"]) ** 2

    def patches_per_image(self) -> int:
        return self._tiles() * self._tile_patches()

    def tokens_per_image(self) -> int:
        return 1

    def _positions(self) -> tuple[int, int]:
        """(an image's positions in the tower: its tiles' patches and CLS, padded to a multiple of 8; the features
        it gives the language model: its tiles' patches and CLS)."""
        per_tile = self._tile_patches() + 1
        return self._tiles() * -(-per_tile // 8) * 8, self._tiles() * per_tile

    def grid_bytes(self, images: int) -> int:
        return 8 * images * (1 + self._tiles())  # aspect_ratio_ids and aspect_ratio_mask, int64

    def transient(self, images: tuple[int, ...], compute: int) -> int:
        """Per image, the largest of the frozen tower's moments (measured with the CPU's tensor tracker): the tile
        mask made (two of its squares), a local layer's and a global layer's (the mask, every local layer's output,
        the patch embedding's output, the layer's own tensors) and the features gathered at the end (the selected
        local outputs stacked and cut, beside the last output and their concatenation)."""
        v = self._vision()
        positions, features = self._positions()
        stream, mask = positions * v["hidden_size"] * compute, positions * positions * compute
        embedded = self.patches_per_image() * v["hidden_size"] * compute  # the patch embedding's output, kept
        local, global_ = v["num_hidden_layers"], v["num_global_layers"]
        selected, cut = len(v["intermediate_layers_indices"]), features * v["hidden_size"] * compute
        made = 2 * mask + stream + embedded + positions * compute
        layer = mask + embedded + self._layer_moment(positions, compute)
        in_local, in_global = layer + (local - 1) * stream, layer + (local + global_ - 1) * stream
        gathered = (mask + embedded + (local + global_) * stream + (1 + selected) * cut
                    + max(selected * stream, (1 + selected) * cut))
        return len(images) * max(made, in_local, in_global, gathered)

    def _layer_moment(self, positions: int, compute: int) -> int:
        """A layer's largest moment with its input: its attention (the input, the norm's output, q, k, v, the
        attention's output and o_proj's) or its MLP (the input, the attention's sum, the norm's output and fc1's,
        its activation or fc2's output)."""
        v = self._vision()
        stream, mlp = positions * v["hidden_size"] * compute, positions * v["intermediate_size"] * compute
        return max(7 * stream, 3 * stream + 2 * mlp, 4 * stream + mlp)

    def encoder(self) -> VitEncoder:
        v = self._vision()
        return VitEncoder(v["hidden_size"], v["intermediate_size"], v["attention_heads"], v["hidden_act"])

    def saved(self, images: tuple[int, ...], tower: bool, projector: bool, compute: int) -> int:
        """Per image, as saved-tensor hooks show. The tower: every layer what VitEncoder counts per position (the
        global ones also their gates' inputs, the attention's and the MLP's outputs), the tile mask once for them
        all, the gated position embedding's and layernorm_pre's inputs (its tiles unpadded), layernorm_post's
        input, and the tile embeddings' per-tile outputs. The projector: its input, every selected layer's output
        beside the last."""
        v, encoder = self._vision(), self.encoder()
        positions, features = self._positions()
        width, tiles = encoder.width, self._tiles()
        per_image = features * v["vision_output_dim"] * compute if projector else 0
        if tower:
            layer = encoder.saved_per_position(compute)
            layers = v["num_hidden_layers"] * layer + v["num_global_layers"] * (layer + 2 * width * compute)
            per_image += positions * (layers + width * compute + 2 * STAT_BYTES) + positions * positions * compute
            per_image += features * (2 * width * compute + 2 * STAT_BYTES) + 2 * tiles * width * compute
        return len(images) * per_image

    def parameters(self, tower: bool, projector: bool) -> int:
        """The tower: the patch embedding (no bias), the class embedding, the gated position embedding (a tile's
        positions, and for each aspect ratio one per tile position), the two gated tile embeddings, layernorm_pre
        and layernorm_post, the local layers and the gated global ones (their q, k, v and o without biases); the
        projector: one linear with its bias into the language model's width."""
        v, encoder = self._vision(), self.encoder()
        width, tiles, per_tile = encoder.width, self._tiles(), self._tile_patches() + 1
        ratios = len(v.get("supported_aspect_ratios") or _aspect_ratios(tiles)) + 1
        count = 0
        if tower:
            layer = encoder.block_parameters() - 4 * width  # VitEncoder's, less the attention's biases
            count += v.get("num_channels", 3) * v["patch_size"] ** 2 * width + width
            count += 1 + per_tile * width + ratios * tiles * per_tile * width + 2 * (ratios * tiles * width + 1)
            count += 4 * width + v["num_hidden_layers"] * layer + v["num_global_layers"] * (layer + 2)
        if projector:
            text = {**self.text_defaults, **(self.model_config.get("text_config") or {})}["hidden_size"]
            count += (v["vision_output_dim"] + 1) * text
        return count

    def cross_attention_bytes(self, images: tuple[int, ...], config: RunConfig, width: int) -> int:
        """Per image feature (every tile's patches and CLS), as saved-tensor hooks show: in each cross-attention
        layer the keys and values SDPA keeps (as many heads as the queries), k_norm's fp32 input and statistics
        where the keys need a gradient, and an adapted k_proj's or v_proj's adapter input (its dropout's output,
        or without dropout the projected features themselves, kept once) and its rank-wide output; once, the
        cross-attention mask over every row's features, per text position in the compute dtype."""
        text = {**self.text_defaults, **(self.model_config.get("text_config") or {})}
        hidden, heads = text["hidden_size"], text["num_attention_heads"]
        kv_heads = text.get("num_key_value_heads") or heads
        head = text.get("head_dim") or hidden // heads
        adapted = [name for name in ("k_proj", "v_proj") if _adapts(config, name)]
        per_layer = 2 * heads * head * width
        if "k_proj" in adapted or not config.uses_adapter:
            per_layer += kv_heads * (head + 1) * STAT_BYTES
        dropout = config.lora.dropout > 0
        per_layer += len(adapted) * (config.lora.r + hidden * dropout) * width
        kept = not config.uses_adapter or bool(adapted and not dropout)  # the projected features, k_proj's input
        once = hidden * width * kept + config.data.max_length * width
        layers = len(text["cross_attention_layers"])
        _, features = self._positions()
        return len(images) * features * (layers * per_layer + once)


IMAGE_RULES: dict[str, type[ImageRule]] = {"qwen2_vl": Qwen2VLImages, "qwen2_5_vl": Qwen25VLImages,
                                           "qwen3_vl": Qwen3VLImages, "gemma3": Gemma3Images, "llava": LlavaImages,
                                           "idefics3": Idefics3Images, "smolvlm": Idefics3Images,
                                           "llava_next": LlavaNextImages, "mllama": MllamaImages}


def image_rule(model_config: dict) -> ImageRule | None:
    """The image rule of a config.json mapping's family; None for a text model or a family without one."""
    rule = IMAGE_RULES.get(str(model_config.get("model_type", ""))) if "vision_config" in model_config else None
    return None if rule is None else rule(model_config)



def image_processor_limit(model_config: dict, max_pixels: int, preprocessor: dict) -> dict:
    """The image processor's arguments for the run's vision.max_pixels ({} for 0: the processor's own), as the
    family's rule reads the limit (``max_pixels`` for a family without one)."""
    if not max_pixels:
        return {}
    rule = image_rule(model_config)
    return {"max_pixels": max_pixels} if rule is None else rule.processor_limit(preprocessor, max_pixels)

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
    rows = config.training.micro_batch_size * config.sequences_per_row
    return (rule.worst_case_patches(preprocessor, config.vision.max_pixels, config.data.max_length),) * rows


def vision_memory(model_config: dict, config: RunConfig, images: tuple[int, ...]) -> VisionMemory | None:
    """What ``images`` (each one's patches, one micro-batch's) hold; None for a model without an image rule."""
    rule = image_rule(model_config)
    if rule is None:
        return None
    patches = sum(images)
    rows = config.training.micro_batch_size * config.sequences_per_row
    # fp32 pixel values (and a pixel mask), the processor's per-image inputs, the image-token marks (int64 each)
    inputs = patches * (4 * rule.pixel_elements() + rule.pixel_mask_bytes()) + rule.grid_bytes(len(images))
    inputs += 8 * rows * config.data.max_length if images and rule.token_marks else 0
    precision = config.training.precision  # autocast's dtype, or the weights' without it
    width = DTYPE_BYTES[precision if precision != "fp32" else weight_dtype_name(config)]
    v = config.vision
    images = tuple(images)
    transient = 0 if v.train_vision_tower else rule.transient(images, width)
    return VisionMemory(images=images, tokens=rule.tokens(images),
                        inputs=inputs * config.training.gradient_accumulation_steps,
                        saved=rule.saved(images, v.train_vision_tower, v.train_projector, width), transient=transient,
                        sequence=_sequence_bytes(rule, config, images, rows, width) if images else 0)


def _sequence_bytes(rule: ImageRule, config: RunConfig, images: tuple[int, ...], rows: int, width: int) -> int:
    """What the language model holds more for a micro-batch of image rows than the traced text step: the embeddings
    with the image features scattered in (a copy), the multimodal rotary positions (int64, Qwen2-VL's), the padded
    batch's bool attention masks (image rows are not packed), and in every layer SDPA's copy of its mask in the
    compute dtype, kept for backward (measured on the CPU); where the tower or projector trains, the first block's
    input needs a gradient and its norm keeps an fp32 copy of it."""
    length = config.data.max_length
    text = rule.model_config.get("text_config") or rule.model_config
    hidden, layers = text.get("hidden_size", 0), text.get("num_hidden_layers", 0)
    sequence = rows * length * (hidden * width * rule.scatters + 8 * rule.position_axes)
    sequence += rows * length * length * (rule.mask_kinds + layers * width)
    if config.vision.train_vision_tower or config.vision.train_projector:
        sequence += 4 * rows * length * hidden
    return sequence + rule.cross_attention_bytes(images, config, width)


def with_images(phases: dict, vision: VisionMemory, states: dict) -> dict:
    """The phases of a text step with the images' inputs throughout and the trained parts' saved tensors from the
    tower's forward to its backward; two moments of the tower join them: a frozen tower's forward (before the
    language model's), and a trained one's backward (the last: every other gradient is there). ``states``: the
    persistent parts and every gradient."""
    phases = {name: {**parts, "activations": parts["activations"] + vision.inputs
                     + (vision.saved + vision.sequence if name != "optimizer" else 0)}
              for name, parts in phases.items()}
    tower_forward = {**phases["forward"], "activations": phases["optimizer"]["activations"] + vision.transient,
                     "logits_loss": 0, "gradients": phases["forward"]["gradients"]}
    tower_backward = {**states, "activations": phases["optimizer"]["activations"] + vision.saved}
    phases["forward"] = max(phases["forward"], tower_forward, key=lambda parts: sum(parts.values()))
    phases["backward"] = max(phases["backward"], tower_backward, key=lambda parts: sum(parts.values()))
    return phases
