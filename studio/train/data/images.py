"""Image rows for vision-language models: their images as the model's inputs, their image tokens in the ids.

A row is rendered by the tokenizer's chat template as any chat row: one placeholder per image part (the family's
``placeholder``, studio.core.model.vision). The model's own processor (transformers', its family's) turns each
placeholder with its image into the image's tokens and the image inputs the model's forward takes (pixel_values,
image_grid_thw, pixel_attention_mask, image_sizes; token_type_ids or mm_token_type_ids where the family marks its
image tokens); the text between is tokenized as any chat row's. A family reading its images through
cross-attention (mllama) keeps each placeholder as one image token: its image processor tiles the row's images
together (pixel_values, aspect_ratio_ids, aspect_ratio_mask: one row of images) and the row's cross_attention_mask,
which image and tiles each token sees, follows its ids as trained (after the chat template and the cut). The tokens
an image becomes are never learned, even with data.train_on_prompt; the prompt is not learned either, as for text.
The split keeps each row's image inputs in one column (``IMAGE_COLUMN``: its arrays as .npz bytes) beside its ids;
text rows of the same run keep an empty one. Image rows train in padded micro-batches: packing would need the vision
positions (Qwen2-VL's multimodal rotary positions) of every example in a row, not done yet.
"""

from __future__ import annotations

import functools
import inspect
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from studio.core.config import RunConfig
from studio.core.data.row_formats import DataError, Example
from studio.core.data.templates import Segment
from studio.core.errors import StudioError
from studio.core.memory.parts.vision import (LlavaNextImages, image_processor_limit, image_rule,
                                             load_preprocessor_config)
from studio.core.model.info import load_model_config
from studio.core.model.vision import VisionFamily, vision_family

TOKEN_INPUTS = ("token_type_ids", "mm_token_type_ids")
"""The processors' per-token image inputs (1 at an image token, 0 elsewhere): Gemma 3 attends over an image both
ways by them, Qwen2-VL places its multimodal positions by them."""
CROSS_ATTENTION_INPUTS = ("aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask")
"""mllama's image inputs beside its pixel_values: each a row's, its images along the second axis (the mask's tokens
along the first)."""
TILED_IMAGES = ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", *TOKEN_INPUTS,
                *CROSS_ATTENTION_INPUTS)
"""What a micro-batch may hand the model beside the ids: the processors' image inputs (one entry per image along
their first axis; mllama's one row each), their per-token ones and mllama's cross-attention mask."""
IMAGE_COLUMN = "image_inputs"
REJECTED_IMAGE_COLUMN = "rejected_image_inputs"
"""A preference pair's rejected sequence's image inputs along its own ids (its per-token ones); its images' inputs
are the chosen sequence's (``IMAGE_COLUMN``), the pair's prompt holding them, and are stored once."""
SEQUENCE_INPUTS = "sequence_image_inputs"
"""A micro-batch feature's own per-token image inputs, replacing those of its ``IMAGE_COLUMN`` (a rejected
sequence's, from ``REJECTED_IMAGE_COLUMN``)."""
IMAGE_COLUMN_TYPES = {IMAGE_COLUMN: pa.binary(), REJECTED_IMAGE_COLUMN: pa.binary()}
NO_IMAGES: dict[str, bytes] = {IMAGE_COLUMN: b""}


def load_processor(config: RunConfig, tokenizer: Any) -> tuple[Any, dict[str, Any]]:
    """The model's processor, with the run's tokenizer and the PIL image processor (the fast one needs torchvision;
    the run's vision.max_pixels, if set, replaces its pixel limit as the estimate reads it: Qwen2-VL's max_pixels,
    Idefics3's longest edge), and its processor_config.json settings ({} without one).

    Built from its parts as ``AutoProcessor`` would, with those settings: a family whose
    processor also reads videos (Qwen2-VL, SmolVLM) gets a blank video part, as rows hold images alone; transformers
    offers video processors only with torchvision, and checks the part's class by a name it then does not export.
    """
    from transformers import AutoConfig, AutoImageProcessor, processing_utils
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING
    from transformers.video_processing_utils import VideoProcessorMixin

    path, revision = config.model.name_or_path, config.model.revision or None
    trust = config.model.trust_remote_code
    try:
        processor_class = PROCESSOR_MAPPING[type(AutoConfig.from_pretrained(path, revision=revision,
                                                                              trust_remote_code=trust))]
        found = processor_class.get_processor_dict(path, revision=revision)[0]
        settings = {key: value for key, value in found.items() if key != "chat_template"}  # the tokenizer's is used
        limit = image_processor_limit(load_model_config(path, config.model.revision), config.vision.max_pixels,
                                      load_preprocessor_config(path, config.model.revision))
        parts = {"image_processor": AutoImageProcessor.from_pretrained(path, backend="pil", revision=revision,
                                                                       trust_remote_code=trust, **limit),
                 "tokenizer": tokenizer}
        if "video_processor" in processor_class.get_attributes():
            if not hasattr(processing_utils.transformers_module, "VideoProcessorMixin"):
                processing_utils.transformers_module.VideoProcessorMixin = VideoProcessorMixin
            parts["video_processor"] = VideoProcessorMixin()
        accepted = inspect.signature(processor_class.__init__).parameters
        return processor_class(**parts, **{key: value for key, value in settings.items()
                                           if key in accepted and key not in parts}), settings
    except (ImportError, KeyError, OSError, ValueError) as exc:
        raise StudioError(f"the processor of {path} (which turns images into the model's inputs) does not load: "
                          f"{exc}", "give the model folder its preprocessor_config.json (and processor_config.json), "
                          "and install what the message names", kind="model") from exc


@dataclass
class ImageInputs:
    """A row's images as the processor gave them: their inputs, one image after the other (``arrays``), the token
    ids its per-token inputs mark (name: {token id: mark}), how many tokens the images became and those of them
    that are the tokenizer's added tokens (the image tokens and their frames: text around them has none)."""

    arrays: dict[str, np.ndarray]
    marks: dict[str, dict[int, int]]
    length: int
    added: list[int]


class ImageRows:
    """What turns a run's image rows into model inputs: its family and its processor, loaded when a row first
    needs it (a vision-language model trained on text alone needs no image processor, nor its files)."""

    def __init__(self, family: VisionFamily, config: RunConfig, tokenizer: Any):
        self.family, self.config, self.tokenizer = family, config, tokenizer

    @classmethod
    def for_run(cls, config: RunConfig, tokenizer: Any) -> "ImageRows | None":
        """The run's, or None for a text model."""
        family = vision_family(load_model_config(config.model.name_or_path, config.model.revision))
        return None if family is None else cls(family, config, tokenizer)

    @functools.cached_property
    def _loaded(self) -> tuple[Any, dict[str, Any]]:
        return load_processor(self.config, self.tokenizer)

    @property
    def processor(self) -> Any:
        return self._loaded[0]

    @property
    def settings(self) -> dict[str, Any]:
        return self._loaded[1]

    def save(self, folder: Path) -> None:
        """What turns images into the model's inputs, beside an export: the image processor and the processor's
        settings (Idefics3's tokens per image...), as the model had them; nothing for a model folder without an
        image processor's file (a vision architecture trained as a text model)."""
        if not load_preprocessor_config(self.config.model.name_or_path, self.config.model.revision):
            return
        self.processor.image_processor.save_pretrained(folder)
        if self.settings:
            (folder / "processor_config.json").write_text(json.dumps(self.settings, indent=2), encoding="utf-8")

    def expand(self, segments: Sequence[Segment], example: Example) -> tuple[list, ImageInputs]:
        """The segments with each image's placeholder replaced by its tokens as the processor writes them
        (``(ids, False)``: pre-tokenized, never learned), in order; and the row's image inputs."""
        (expanded,), inputs = self.expand_renderings([segments], example)
        return expanded, inputs

    def expand_renderings(self, renderings: Sequence[Sequence[Segment]],
                          example: Example) -> tuple[list[list], ImageInputs]:
        """``expand`` of several renderings of one row, each holding all its images (a preference pair's prompt,
        prompt+chosen and prompt+rejected): the images opened and processed once."""
        processed = [self._expanded_image(self._open(example, index)) for index in range(len(example.images))]
        tokens, made = [tokens for tokens, _ in processed], [source for _, source in processed]
        expanded = [self._placed(segments, tokens, example) for segments in renderings]
        return expanded, self._tiled_inputs(made) if self.family.cross_attention else self._inputs(made,
                                                                                                  example.location)

    def _placed(self, segments: Sequence[Segment], images: list[list[int]], example: Example) -> list:
        """The segments with the n-th image placeholder replaced by ``images[n]`` (its tokens); refused unless the
        template writes one placeholder per image."""
        placeholder, pending, expanded = self.family.placeholder, iter(images), []
        for text, trainable in segments:
            pieces = text.split(placeholder)
            expanded.append((pieces[0], trainable))
            for piece in pieces[1:]:
                tokens = next(pending, None)
                if tokens is None:
                    raise DataError(example.location, f"the chat template writes more image placeholders "
                                    f"({placeholder}) than the row has images ({len(example.images)})",
                                    "give each image placeholder its image")
                expanded += [(tokens, False), (piece, trainable)]
        if next(pending, None) is not None:
            raise DataError(example.location, f"the chat template renders fewer image placeholders ({placeholder}) "
                            f"than the row has images ({len(example.images)})",
                            "use the model's own chat template: it renders image parts")
        return expanded

    def _expanded_image(self, image: Any) -> tuple[list[int], Any]:
        """An image's tokens in the ids and what its inputs come from: mllama's one image token and the image itself
        (its processor, called on the text, would add a bos after each image token); the others' tokens and inputs
        as their processor gives them for the placeholder."""
        if self.family.cross_attention:
            return [self.processor.image_token_id], image
        output = self.processor(text=self.family.placeholder, images=[image], add_special_tokens=False)
        return [int(token) for token in output["input_ids"][0]], output

    def _tiled_inputs(self, images: list[Any]) -> ImageInputs:
        """mllama's: the row's images tiled together by the image processor (one row: ``[1, images, tiles, ...]``),
        each one image token."""
        output = self.processor.image_processor([images], return_tensors="np")
        token = self.processor.image_token_id
        return ImageInputs({name: np.asarray(output[name]) for name in TILED_IMAGES}, {}, len(images),
                           [token] * len(images))

    def _inputs(self, processed: list[dict[str, Any]], location: str) -> ImageInputs:
        names = [name for name in processed[0] if name not in ("input_ids", "attention_mask")]
        unknown = [name for name in names if name not in IMAGE_INPUTS]
        if unknown:
            raise DataError(location, f"{self.family.name}'s processor gives model inputs studio does not batch "
                            f"yet: {', '.join(unknown)}", "train this family on text, or report it")
        arrays = {name: stacked([np.asarray(output[name]) for output in processed])
                  for name in names if name not in TOKEN_INPUTS}
        marks = {name: {int(token): int(mark) for output in processed
                        for token, mark in zip(output["input_ids"][0], output[name][0]) if mark}
                 for name in names if name in TOKEN_INPUTS}
        tokens = [int(token) for output in processed for token in output["input_ids"][0]]
        added = self.processor.tokenizer.added_tokens_decoder
        return ImageInputs(arrays, marks, len(tokens), [token for token in tokens if token in added])

    def masked(self, encoded: dict[str, Any], inputs: ImageInputs, max_length: int, location: str) -> dict[str, Any]:
        """The encoded row with its image inputs (its per-token ones along its ids, mllama's cross-attention mask
        too); refused when max_length cuts into its images (or its text holds the images' tokens too)."""
        row = {**inputs.arrays, **self.token_inputs(encoded["input_ids"], inputs, max_length, location)}
        return {**encoded, IMAGE_COLUMN: npz_bytes(row)}

    def token_inputs(self, ids: Sequence[int], inputs: ImageInputs, max_length: int,
                     location: str) -> dict[str, np.ndarray]:
        """The image inputs along a sequence's ``ids`` (``masked`` says which, and when they are refused)."""
        image_ids = set(inputs.added)
        found = sum(token in image_ids for token in ids)
        if found > len(inputs.added):
            written = self.processor.tokenizer.convert_ids_to_tokens(sorted(image_ids))
            raise DataError(location, f"the row's text holds the images' own tokens ({', '.join(written)}) beside "
                            f"its image parts: {found - len(inputs.added):,} more than its images make",
                            "give each image as an image part, not as its tokens in the text")
        if found < len(inputs.added):
            raise DataError(location, f"data.max_length {max_length:,} cuts into the row's images: the images alone "
                            f"are {inputs.length:,} tokens", "raise data.max_length, or use smaller images")
        row = {name: np.asarray([mark_of.get(token, 0) for token in ids], np.int64)
               for name, mark_of in inputs.marks.items()}
        if self.family.cross_attention:
            row["cross_attention_mask"] = cross_attention_mask(ids, self.processor.image_token_id,
                                                               inputs.arrays["aspect_ratio_mask"])
        return row

    def _open(self, example: Example, index: int):
        from PIL import Image, UnidentifiedImageError

        path = example.images[index]
        try:
            with Image.open(path) as image:
                return image.convert("RGB")
        except (OSError, UnidentifiedImageError, ValueError) as exc:
            raise DataError(example.location, f"image {index} ({path}) cannot be read as an image: {exc}",
                            "give a PNG, JPEG or another image file PIL reads") from None


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """Arrays as the bytes of one .npz file: a split row's image column."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def cross_attention_mask(ids: Sequence[int], image_token: int, aspect_ratio_mask: np.ndarray) -> np.ndarray:
    """mllama's mask of the images (and their tiles) each token of a row sees, ``[1, tokens, images, tiles]``, as
    transformers' processor builds it: a token sees the nearest image before it (all of a run of adjacent ones)."""
    from transformers.models.mllama.processing_mllama import (convert_sparse_cross_attention_mask_to_dense,
                                                              get_cross_attention_token_mask)

    tiles = aspect_ratio_mask.sum(-1).tolist()  # [1, images]: the tiles each image uses
    return convert_sparse_cross_attention_mask_to_dense([get_cross_attention_token_mask(list(ids), image_token)],
                                                        tiles, aspect_ratio_mask.shape[-1], len(ids))


def stacked(arrays: list[np.ndarray]) -> np.ndarray:
    """Arrays joined along their first axis, their other axes zero-padded to the largest (Idefics3's tiles,
    LLaVA-Next's patches differ between images: the model drops or slices the padding)."""
    shape = np.max([array.shape for array in arrays], axis=0)
    return np.concatenate([np.pad(array, [(0, 0)] + [(0, int(size) - length) for size, length
                                                     in zip(shape[1:], array.shape[1:])]) for array in arrays])


def row_image_inputs(feature: dict[str, Any]) -> dict[str, np.ndarray]:
    """A split row's image inputs (none for a row without images); a feature's ``SEQUENCE_INPUTS`` replace its
    per-token ones."""
    if not feature.get(IMAGE_COLUMN):
        return {}
    return {**_arrays(feature[IMAGE_COLUMN]), **_arrays(feature.get(SEQUENCE_INPUTS))}


def _arrays(data: bytes | None) -> dict[str, np.ndarray]:
    if not data:
        return {}
    with np.load(io.BytesIO(data)) as arrays:
        return {name: arrays[name] for name in arrays.files}


def row_image_patches(feature: dict[str, Any], patch_size: int = 0,
                      tiles: Callable[[int, int], int] | None = None) -> tuple[int, ...]:
    """Each image's patches in a split row: from its grids (a (t, h, w) grid is t x h x w patches: Qwen2-VL's), or
    for a family without grids (Gemma 3, LLaVA: one fixed-size image along the pixel values' first axis; Idefics3:
    an image's real tiles of one size along the second; LLaVA-Next: each image's ``tiles`` at its size, from the
    row's image sizes, its tiles zero-padded to the row's most along the second; mllama: the row's images along the
    second, each every tile along the third, the padded ones included: they run through the tower too) from the
    pixel values' height and width in patches of ``patch_size`` (0: none counted); none for a row without images.
    Reads the grids, the image sizes, the pixel values' header and a pixel of each tile's mask, never the pixel
    values."""
    data = feature.get(IMAGE_COLUMN)
    if not data:
        return ()
    with np.load(io.BytesIO(data)) as arrays:
        if "image_grid_thw" in arrays.files:
            return tuple(int(np.prod(grid)) for grid in arrays["image_grid_thw"])
        if not patch_size or "pixel_values" not in arrays.files:
            return ()
        with arrays.zip.open("pixel_values.npy") as array:
            shape = _npy_header(array)[0]
        images, *_, height, width = shape
        if tiles is not None and "image_sizes" in arrays.files:
            counts = tuple(tiles(int(h), int(w)) for h, w in arrays["image_sizes"])
        elif len(shape) == 6:  # mllama's
            counts = (shape[2],) * shape[1]
        elif len(shape) == 5:
            counts = _real_tiles(arrays)
        else:
            counts = (1,) * images
        return tuple(count * (height // patch_size) * (width // patch_size) for count in counts)


def _npy_header(array) -> tuple:
    """An .npy stream's (shape, fortran order, dtype), the stream left at its data."""
    version = np.lib.format.read_magic(array)
    header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    return header(array)


def _real_tiles(arrays) -> tuple[int, ...]:
    """Each image's tiles that are not padding (Idefics3's: ``[images, tiles, channels, height, width]`` pixel
    values, each image's tiles zero-padded to the row's most): a real tile's pixel_attention_mask is 1 at its first
    pixel, a padded one's 0 throughout. Reads that pixel of each tile alone."""
    with arrays.zip.open("pixel_attention_mask.npy") as mask:
        (images, tiles, height, width), _, dtype = _npy_header(mask)
        start, corners = mask.tell(), []
        for index in range(images * tiles):
            mask.seek(start + index * height * width * dtype.itemsize)
            corners.append(np.frombuffer(mask.read(dtype.itemsize), dtype)[0] != 0)
    return tuple(int(count) for count in np.reshape(corners, (images, tiles)).sum(axis=1))


def tower_patch_size(model_config: dict) -> int:
    """The vision tower's patch side in pixels of a config.json mapping (0 for a text model)."""
    vision = model_config.get("vision_config")
    return int(vision.get("patch_size", 0)) if isinstance(vision, dict) else 0


def image_tiles(model_config: dict) -> Callable[[int, int], int] | None:
    """The tower's tiles for an image of a height and width, for a family that tiles each image by its size
    (LLaVA-Next's pinpoints, as its model splits the features back); None where an image is one."""
    rule = image_rule(model_config)
    return rule.tiles if isinstance(rule, LlavaNextImages) else None


def fills_image_slots(model_config: dict) -> bool:
    """Whether the model's micro-batches give every row as many image slots as the row with the most (mllama's
    cross-attention inputs, ``_cross_attention_batch``)."""
    family = vision_family(model_config)
    return family is not None and family.cross_attention


def image_batch(features: list[dict[str, Any]], width: int, left: bool = False) -> dict[str, torch.Tensor]:
    """A right-padded (``left``: left-padded, as prompts to generate from) micro-batch's image inputs, every row's
    images in order (the model matches them to its image tokens in order) and its per-token marks padded to
    ``width``; none when no row holds an image."""
    rows = [row_image_inputs(feature) for feature in features]
    names = {name for row in rows for name in row}
    if not names:
        return {}
    if "cross_attention_mask" in names:
        return _cross_attention_batch(rows, width, left)
    batch = {}
    for name in names:
        if name in TOKEN_INPUTS:
            marks = [_padded_tokens(row[name], width, left) if name in row else np.zeros(width, np.int64)
                     for row in rows]
            batch[name] = torch.from_numpy(np.stack(marks)).long()
        else:
            batch[name] = torch.from_numpy(stacked([row[name] for row in rows if name in row]))
    return batch


def _padded_tokens(array: np.ndarray, width: int, left: bool) -> np.ndarray:
    """A per-token array zero-padded along its first axis to ``width``: before its tokens when ``left``."""
    padding = width - len(array)
    return np.pad(array, [(padding, 0) if left else (0, padding)] + [(0, 0)] * (array.ndim - 1))


def _cross_attention_batch(rows: list[dict[str, np.ndarray]], width: int, left: bool) -> dict[str, torch.Tensor]:
    """mllama's micro-batch: one row of images per row, as many image slots as the most any row has. A row of fewer
    fills the slots left with its own images again, in turn, which none of its tokens sees: transformers' mllama lets
    a token that sees no image (those before the row's first one) attend evenly over every slot of its row, so the
    repeats keep that the average over its own images whenever their count divides the batch's (always for one
    image). A text row gets blank slots and a cross-attention mask of zeros."""
    count = max(row["aspect_ratio_ids"].shape[1] for row in rows if row)
    filled = [_filled_slots(row, count, width, left) if row else None for row in rows]
    blank = {name: np.zeros_like(array) for name, array in next(row for row in filled if row).items()}
    return {name: torch.from_numpy(np.concatenate([(row or blank)[name] for row in filled])) for name in blank}


def _filled_slots(row: dict[str, np.ndarray], count: int, width: int, left: bool) -> dict[str, np.ndarray]:
    """An mllama row's image inputs with ``count`` image slots, its images and then its images again in turn (its
    mask zero there), the mask padded to ``width`` tokens as the ids are."""
    images = row["aspect_ratio_ids"].shape[1]
    mask = np.pad(row["cross_attention_mask"][0], [(0, 0), (0, count - images), (0, 0)])
    return {**{name: row[name][:, np.arange(count) % images] for name in TILED_IMAGES},
            "cross_attention_mask": _padded_tokens(mask, width, left)[None]}
