"""Build the tiny vision-language model and its demo data of Finetune Studio.

    python resources/build_vision_assets.py      # seconds

writes ``resources/models/studio-tiny-vl/``: a random Qwen2-VL (hidden 32, 2 layers, a vision tower of depth 1
with 4-pixel patches) with the text demo's tokenizer plus Qwen2-VL's special tokens and a chat template that
renders image parts, and ``resources/datasets/colours/``: 16x16 squares of one colour each, and chat rows asking
their colour (TRL's vision format: an ``images`` column, ``{"type": "image"}`` parts), paths relative to the jsonl.

The weights are random: the model is for tests and for trying the pipeline, not for answers. Seeded.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
from PIL import Image

HERE = Path(__file__).resolve().parent
TEXT_MODEL = HERE / "models" / "studio-tiny"
MODEL_DIR = HERE / "models" / "studio-tiny-vl"
DATA_DIR = HERE / "datasets" / "colours"
SEED = 7
IMAGE_SIDE = 16
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
IMAGE_PART = "<|vision_start|><|image_pad|><|vision_end|>"


def chat_template(image_part: str) -> str:
    """The text demo's chat format, an image part written as ``image_part`` (the family's placeholder)."""
    return ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
            f"{{% if part['type'] == 'image' %}}{image_part}"
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (240, 220, 40),
           "black": (10, 10, 10), "white": (245, 245, 245)}
ROWS_PER_COLOUR = 4
# 16x16 images in 4-pixel patches merged 2x2: 4 image tokens each (the processor's pixel bounds allow exactly that)
IMAGE_PROCESSOR = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2,
                   "min_pixels": IMAGE_SIDE * IMAGE_SIDE, "max_pixels": IMAGE_SIDE * IMAGE_SIDE}


def build_tokenizer(tokens: list[str] = VISION_TOKENS, image_part: str = IMAGE_PART, named: dict | None = None):
    """The text demo's tokenizer with a vision family's special tokens (``named``: those its processor reads by
    name, Gemma 3's boi_token...) and a chat template writing image parts as ``image_part``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TEXT_MODEL, **({"extra_special_tokens": named} if named else {}))
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    tokenizer.chat_template = chat_template(image_part)
    return tokenizer


def build_model(tokenizer):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    config = Qwen2VLConfig(
        text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "vocab_size": len(tokenizer), "max_position_embeddings": 512,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                         "mrope_section": [2, 3, 3]},
                     "tie_word_embeddings": True, "pad_token_id": tokenizer.pad_token_id,
                     "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id},
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2,
                       "patch_size": IMAGE_PROCESSOR["patch_size"], "spatial_merge_size": IMAGE_PROCESSOR["merge_size"],
                       "temporal_patch_size": IMAGE_PROCESSOR["temporal_patch_size"], "in_channels": 3},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(SEED)
    return Qwen2VLForConditionalGeneration(config)


def build_image_processor():
    """The PIL image processor: Qwen2VLProcessor itself wants a video processor, which needs torchvision."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR)


def write_dataset() -> None:
    shutil.rmtree(DATA_DIR, ignore_errors=True)
    (DATA_DIR / "images").mkdir(parents=True)
    rng = random.Random(SEED)
    rows = []
    for colour, rgb in COLOURS.items():
        for index in range(ROWS_PER_COLOUR):
            shade = tuple(max(0, min(255, value + rng.randint(-15, 15))) for value in rgb)
            name = f"images/{colour}-{index}.png"
            Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), shade).save(DATA_DIR / name)
            rows.append({"images": [name], "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this square?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": colour}]}]})
    rng.shuffle(rows)
    with open(DATA_DIR / "colours_chat.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)


def main() -> None:
    tokenizer = build_tokenizer()
    shutil.rmtree(MODEL_DIR, ignore_errors=True)
    build_model(tokenizer).save_pretrained(MODEL_DIR)
    tokenizer.save_pretrained(MODEL_DIR)
    build_image_processor().save_pretrained(MODEL_DIR)
    write_dataset()
    print(f"wrote {MODEL_DIR} and {DATA_DIR}")


if __name__ == "__main__":
    main()
