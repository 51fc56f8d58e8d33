"""Vision-language families beyond the demo's Qwen2-VL (issue 30): tiny random Qwen3-VL, Gemma 3, Idefics3, LLaVA,
LLaVA-Next and Llama 3.2 Vision (mllama) models built here, their rows expanded by their own processors, the answer
alone learned, LoRA on the language model alone, the vision tower frozen and the projector trained when asked."""

import importlib.util
import json
from pathlib import Path

import pytest

from helpers import quick_config

RESOURCES = Path(__file__).resolve().parent.parent / "resources"
COLOURS = RESOURCES / "datasets" / "colours" / "colours_chat.jsonl"
ANSWERS = {"red", "green", "blue", "yellow", "black", "white"}
TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 512}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
          "image_size": 16, "patch_size": 4}


def vision_assets():
    spec = importlib.util.spec_from_file_location("build_vision_assets", RESOURCES / "build_vision_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


QWEN_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
               "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 32}


def qwen_vl(assets, config_class, model_class, vision: dict, side: int):
    """A tiny Qwen-VL family's model (``config_class``'s, ``vision``: its tower's config) with the demo tokenizer,
    and a PIL image processor keeping ``side`` x ``side`` pixels an image."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = assets.build_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in assets.VISION_TOKENS}
    config = config_class(
        text_config={**TEXT, "vocab_size": len(tokenizer),
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        vision_config=vision, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True)
    processor = Qwen2VLImageProcessorPil(patch_size=vision["patch_size"], merge_size=vision["spatial_merge_size"],
                                         temporal_patch_size=vision["temporal_patch_size"],
                                         size={"shortest_edge": side * side, "longest_edge": side * side})
    return model_class(config), tokenizer, processor, {}


def qwen3_vl(assets, vision=None, side=16):
    """Qwen3-VL: learned positions on a 4x4 grid (interpolated per image), block 0's features into the deepstack."""
    import transformers

    vision = {**QWEN_VISION, "num_position_embeddings": 16, "deepstack_visual_indexes": [0], **(vision or {})}
    return qwen_vl(assets, transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration, vision, side)


def qwen2_5_vl(assets, vision=None, side=16):
    """Qwen2.5-VL: windows of 16 pixels (2x2 merged patches), its last block attending to the whole image."""
    import transformers

    depth = (vision or {}).get("depth", 1)
    vision = {**QWEN_VISION, "window_size": 16, "fullatt_block_indexes": [depth - 1], **(vision or {})}
    return qwen_vl(assets, transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration, vision,
                   side)


def gemma3(assets, vision=VISION, tokens=4):
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    named = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tokenizer = assets.build_tokenizer(list(named.values()), named["boi_token"], named)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in named.items()}
    config = transformers.Gemma3Config(
        text_config={**TEXT, "vocab_size": len(tokenizer), "sliding_window": 16},
        vision_config={**vision, "model_type": "siglip_vision_model"}, mm_tokens_per_image=tokens,
        image_token_index=ids["image_token"], boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"])
    side = vision["image_size"]
    processor = Gemma3ImageProcessorPil(size={"height": side, "width": side})
    return transformers.Gemma3ForConditionalGeneration(config), tokenizer, processor, {"image_seq_length": tokens}


def idefics3(assets, vision=VISION, longest_edge=32, config_class="Idefics3Config",
             model_class="Idefics3ForConditionalGeneration"):
    """Idefics3 (or SmolVLM, by its classes): images scaled to ``longest_edge`` and split in tiles of the tower's
    image_size beside the whole; each tile's patches pixel-shuffled by 2."""
    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tile = vision["image_size"]
    tiles = [f"<row_{row}_col_{col}>" for row in range(1, longest_edge // tile + 1)
             for col in range(1, longest_edge // tile + 1)]
    tokenizer = assets.build_tokenizer(["<image>", "<fake_token_around_image>", "<global-img>", *tiles], "<image>")
    config = getattr(transformers, config_class)(
        text_config={**TEXT, "model_type": "llama", "vocab_size": len(tokenizer)}, vision_config=vision,
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    # the default: 16-pixel squares scaled to 32 and split in four 16-pixel tiles beside the whole, 4 tokens each
    processor = Idefics3ImageProcessorPil(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": tile})
    tokens = (tile // vision["patch_size"]) ** 2 // 4
    return getattr(transformers, model_class)(config), tokenizer, processor, {"image_seq_len": tokens}


def llava(assets, vision=VISION):
    import transformers
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = assets.build_tokenizer(["<image>"], "<image>")
    config = transformers.LlavaConfig(
        text_config={**TEXT, "model_type": "llama", "vocab_size": len(tokenizer)},
        vision_config={**vision, "model_type": "clip_vision_model", "projection_dim": 32},
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
        vision_feature_select_strategy="default")
    side = vision["image_size"]
    processor = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return transformers.LlavaForConditionalGeneration(config), tokenizer, processor, {
        "patch_size": 4, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}


def llava_next(assets, vision=VISION, grids=((1, 1), (1, 2), (2, 1))):
    """``grids``: its pinpoints in tiles (rows, columns) of the tower's size; by default a square stays one tile,
    beside the whole."""
    import transformers
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tokenizer = assets.build_tokenizer(["<image>"], "<image>")
    side = vision["image_size"]
    pinpoints = [[rows * side, columns * side] for rows, columns in grids]
    config = transformers.LlavaNextConfig(
        text_config={**TEXT, "model_type": "llama", "vocab_size": len(tokenizer)},
        vision_config={**vision, "model_type": "clip_vision_model", "projection_dim": 32},
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
        vision_feature_select_strategy="default", image_grid_pinpoints=pinpoints)
    processor = LlavaNextImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                                           image_grid_pinpoints=pinpoints)
    return transformers.LlavaNextForConditionalGeneration(config), tokenizer, processor, {
        "patch_size": 4, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}


MLLAMA_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_global_layers": 1,
                 "attention_heads": 2, "image_size": 16, "patch_size": 4, "max_num_tiles": 4,
                 "intermediate_layers_indices": [0], "vision_output_dim": 64}


def mllama(assets, vision=MLLAMA_VISION):
    """Llama 3.2 Vision: 16-pixel tiles, up to 4 an image; one cross-attention layer between two self-attention
    ones, its gates opened (they start closed: the images would change nothing)."""
    import torch
    import transformers
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    tokenizer = assets.build_tokenizer(["<|image|>"], "<|image|>")
    config = transformers.MllamaConfig(
        text_config={**TEXT, "num_hidden_layers": 3, "cross_attention_layers": [1], "vocab_size": len(tokenizer),
                     "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                     "eos_token_id": tokenizer.eos_token_id},
        vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids("<|image|>"))
    model = transformers.MllamaForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                param.fill_(0.7)
    side, tiles = vision["image_size"], vision["max_num_tiles"]
    return model, tokenizer, MllamaImageProcessorPil(size={"height": side, "width": side}, max_image_tiles=tiles), {}


# each family: its builder, a module of its vision tower and one of its projector (as named in the model)
FAMILIES = {"qwen3_vl": (qwen3_vl, ".visual.blocks.", ".visual.deepstack_merger_list."),
            "qwen2_5_vl": (qwen2_5_vl, ".visual.blocks.", ".visual.merger."),
            "gemma3": (gemma3, ".vision_tower.", ".multi_modal_projector."),
            "idefics3": (idefics3, ".vision_model.", ".connector."),
            "llava": (llava, ".vision_tower.", ".multi_modal_projector."),
            "llava_next": (llava_next, ".vision_tower.", ".multi_modal_projector."),
            "mllama": (mllama, ".vision_model.", ".multi_modal_projector.")}


def saved_family(name: str, folder: Path, **sizes) -> Path:
    """``folder`` with a random tiny model of the family ``name``: the demo tokenizer with the family's image tokens,
    its image processor and processor settings; ``sizes``: the builder's own (its tower's config, Gemma 3's tokens
    per image, the Qwen families' image side, LLaVA-Next's pinpoints)."""
    import torch

    torch.manual_seed(0)
    model, tokenizer, image_processor, settings = FAMILIES[name][0](vision_assets(), **sizes)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    if settings:
        (folder / "processor_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return folder


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(the family's model folder, its tower's and its projector's module names)."""
    _, tower, projector = FAMILIES[request.param]
    return saved_family(request.param, tmp_path_factory.mktemp(request.param)), tower, projector


def family_config(folder: Path, **sections):
    return quick_config(COLOURS, model={"name_or_path": str(folder)}).replace(
        data={"train_files": (str(COLOURS),), "eval_files": (), "max_length": 96, "eval_fraction": 0.0}, **sections)


def prepared(config):
    from studio.train.data.images import ImageRows
    from studio.train.data.prepare import prepare_data
    from studio.train.model.build import load_tokenizer

    tokenizer = load_tokenizer(config)
    image_rows = ImageRows.for_run(config, tokenizer)
    return prepare_data(config, tokenizer, image_rows=image_rows), tokenizer, image_rows


def test_rows_learn_the_answer_alone_never_the_image_or_the_prompt(family):
    data, tokenizer, image_rows = prepared(family_config(family[0]))
    image_token = tokenizer.convert_tokens_to_ids(image_rows.processor.image_token)
    for row in data.train:
        ids, labels = row["input_ids"], row["labels"]
        learned = [token for token, label in zip(ids, labels) if label != -100]
        assert tokenizer.decode(learned).split("<|im_end|>")[0] in ANSWERS
        last_image = len(ids) - ids[::-1].index(image_token)
        assert labels[:last_image] == [-100] * last_image  # the prompt and its image tokens
        assert learned == ids[len(ids) - len(learned):]  # the answer closes the row


def test_lora_trains_the_language_model_alone_and_its_loss_falls(family):
    import torch

    from studio.train.data.prepare import collate
    from studio.train.model.build import build_model
    from studio.train.objectives.next_token import token_loss_sum

    folder, tower, projector = family
    config = family_config(folder)
    data, tokenizer, _ = prepared(config)
    torch.manual_seed(0)
    model = build_model(config, torch.device("cpu"))
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trained and all("lora_" in name and tower not in name and projector not in name for name in trained)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], lr=1e-2)
    model.train()
    batch = collate([data.train[index] for index in range(8)], tokenizer.pad_token_id)
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        loss = token_loss_sum(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    changed = {name for name, param in model.named_parameters() if not torch.equal(param, before[name])}
    assert changed and changed <= trained
    assert not any(tower in name or projector in name for name in changed)


def test_the_projector_trains_whole_beside_lora_when_asked_the_tower_stays(family):
    import torch

    from studio.train.model.build import build_model

    folder, tower, projector = family
    model = build_model(family_config(folder, vision={"train_projector": True}), torch.device("cpu"))
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    assert any(projector in name and "lora_" not in name for name in trained)
    assert not any(tower in name for name in trained)
    assert any("lora_" in name and projector not in name for name in trained)


def test_rows_of_differently_sized_images_give_in_a_batch_the_logits_they_give_alone(family, tmp_path):
    """The micro-batch joins its rows' images however many tiles or patches each has (Idefics3's tiles, LLaVA-Next's
    patches: zero-padded, the model drops or slices the padding)."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from studio.train.data.prepare import collate
    from studio.train.data.packing import model_inputs

    rows = []
    for index, size in enumerate([(16, 16), (32, 16)]):
        Image.new("RGB", size, (40 * index, 120, 200)).save(tmp_path / f"{index}.png")
        rows.append({"images": [f"{index}.png"], "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "blue"}]}]})
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    config = family_config(family[0]).replace(data={"train_files": (str(path),), "max_length": 128})
    data, tokenizer, _ = prepared(config)
    model = AutoModelForImageTextToText.from_pretrained(family[0]).eval()
    both = collate([data.train[0], data.train[1]], tokenizer.pad_token_id)
    with torch.no_grad():
        batched = model(**model_inputs(both)).logits
        for index in range(2):
            alone = model(**model_inputs(collate([data.train[index]], tokenizer.pad_token_id))).logits[0]
            torch.testing.assert_close(batched[index, :len(alone)], alone, atol=1e-4, rtol=1e-4)


def test_an_export_carries_the_image_processor_and_the_processor_settings(family, tmp_path):
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

    from studio.train.model.build import hub_config

    config = family_config(family[0])
    _, _, image_rows = prepared(config)
    image_rows.save(tmp_path)
    assert (tmp_path / "preprocessor_config.json").is_file()
    saved = PROCESSOR_MAPPING[type(hub_config(config))].get_processor_dict(str(tmp_path))[0]
    assert saved == image_rows.settings and (bool(saved) == (family[0] / "processor_config.json").is_file())
