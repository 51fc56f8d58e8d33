"""Image rows for vision-language models: their images as the model's inputs, their image tokens in the ids.

A row is rendered by the tokenizer's chat template as any chat row (one image placeholder per image part); the
image processor turns the images into pixel values and grid sizes, and each placeholder becomes as many image
tokens as its image has features (the family's rule, ``studio.core.model.vision``), as the family's processor
expands them. The image tokens sit in the prompt: never learned. The split keeps each row's pixel values
(``pixel_values``: one list per patch) and grids (``image_grid_thw``) beside its ids; text rows of the same run
keep empty ones. Image rows train in padded micro-batches: packing would need the vision positions (Qwen2-VL's
multimodal rotary positions) of every example in a row, not done yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import torch

from studio.core.config import RunConfig
from studio.core.data.row_formats import DataError, Example
from studio.core.data.templates import Segment
from studio.core.model.info import load_model_config
from studio.core.model.vision import VisionFamily, vision_family

IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
"""What a micro-batch hands the model beside the ids, and the split's columns for them (``mm_token_type_ids``: 1 at
an image token, 0 elsewhere, as the processor marks them: Qwen2-VL's multimodal positions need them)."""
IMAGE_COLUMN_TYPES = {"pixel_values": pa.list_(pa.list_(pa.float32())), "image_grid_thw": pa.list_(pa.list_(pa.int32()))}
NO_IMAGES: dict[str, list] = {name: [] for name in IMAGE_INPUTS}


class ImageRows:
    """What turns a run's image rows into model inputs: its family's rules, image processor and image token."""

    def __init__(self, family: VisionFamily, image_processor: Any, tokenizer: Any):
        self.family, self.image_processor = family, image_processor
        self.image_token_id = tokenizer.convert_tokens_to_ids(family.image_token)

    @classmethod
    def for_run(cls, config: RunConfig, tokenizer: Any) -> "ImageRows | None":
        """The run's, or None for a text model. The PIL image processor: the fast one needs torchvision; the run's
        vision.max_pixels (if set) replaces its pixel limit."""
        family = vision_family(load_model_config(config.model.name_or_path, config.model.revision))
        if family is None:
            return None
        from transformers import AutoImageProcessor

        limit = {"max_pixels": config.vision.max_pixels} if config.vision.max_pixels else {}

        processor = AutoImageProcessor.from_pretrained(config.model.name_or_path, backend="pil",
                                                       revision=config.model.revision or None,
                                                       trust_remote_code=config.model.trust_remote_code,
                                                       **limit)
        return cls(family, processor, tokenizer)

    def inputs(self, example: Example) -> tuple[dict[str, list], list[int]]:
        """The row's pixel values and grids, and how many image tokens each image becomes."""
        processed = self.image_processor(images=[self._open(example, index) for index in range(len(example.images))])
        grids = [list(map(int, grid)) for grid in processed["image_grid_thw"]]
        merged = self.image_processor.merge_size ** 2
        counts = [grid[0] * grid[1] * grid[2] // merged for grid in grids]
        return {"pixel_values": [list(map(float, patch)) for patch in processed["pixel_values"]],
                "image_grid_thw": grids}, counts

    def expand(self, segments: Sequence[Segment], counts: list[int], location: str) -> list[Segment]:
        """The segments with each image's placeholder repeated to its count of image tokens, in order."""
        token, pending, expanded = self.family.image_token, iter(counts), []
        for text, trainable in segments:
            pieces = text.split(token)
            out = pieces[0]
            for piece in pieces[1:]:
                count = next(pending, None)
                if count is None:
                    raise DataError(location, f"the chat template writes more image placeholders ({token}) than the "
                                    f"row has images ({len(counts)})", "give each image placeholder its image")
                out += token * count + piece
            expanded.append((out, trainable))
        if next(pending, None) is not None:
            raise DataError(location, f"the chat template renders fewer image placeholders ({token}) than the row "
                            f"has images ({len(counts)})", "use the model's own chat template: it renders image parts")
        return expanded

    def masked(self, encoded: dict[str, Any], counts: list[int], max_length: int, location: str) -> dict[str, Any]:
        """The encoded row with its image tokens never learned; refused when max_length cuts into its images."""
        ids = encoded["input_ids"]
        if sum(token == self.image_token_id for token in ids) != sum(counts):
            raise DataError(location, f"data.max_length {max_length:,} cuts into the row's images: the images alone "
                            f"are {sum(counts):,} tokens", "raise data.max_length, or use smaller images")
        encoded["labels"] = [-100 if token == self.image_token_id else label
                             for token, label in zip(ids, encoded["labels"])]
        encoded["mm_token_type_ids"] = [int(token == self.image_token_id) for token in ids]
        return encoded

    def _open(self, example: Example, index: int):
        from PIL import Image, UnidentifiedImageError

        path = example.images[index]
        try:
            with Image.open(path) as image:
                return image.convert("RGB")
        except (OSError, UnidentifiedImageError, ValueError) as exc:
            raise DataError(example.location, f"image {index} ({path}) cannot be read as an image: {exc}",
                            "give a PNG, JPEG or another image file PIL reads") from None


def image_batch(features: list[dict[str, Any]], width: int) -> dict[str, torch.Tensor]:
    """A right-padded micro-batch's images, every row's in order (the model matches them to its image tokens in
    order), and where its image tokens are; none when no row holds an image."""
    pixels = [patch for feature in features for patch in feature.get("pixel_values") or ()]
    if not pixels:
        return {}
    grids = [grid for feature in features for grid in feature["image_grid_thw"]]
    types = [list(feature["mm_token_type_ids"]) for feature in features]
    return {"pixel_values": torch.tensor(pixels, dtype=torch.float32),
            "image_grid_thw": torch.tensor(grids, dtype=torch.long),
            "mm_token_type_ids": torch.tensor([row + [0] * (width - len(row)) for row in types], dtype=torch.long)}
