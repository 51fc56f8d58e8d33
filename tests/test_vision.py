"""Vision-language models (issue 30): chat rows with images read and refused by row and image, the tiny Qwen2-VL
trained with LoRA on its language model alone, its image and prompt tokens never learned."""

import json
import shutil
from pathlib import Path

import pytest

from helpers import losses, quick_config
from studio.core.data.dataset import inspect_files
from studio.core.errors import ProblemsError, StudioError
from studio.core.run.events import read_events

RESOURCES = Path(__file__).resolve().parent.parent / "resources"
TINY_VL = RESOURCES / "models" / "studio-tiny-vl"
COLOURS = RESOURCES / "datasets" / "colours" / "colours_chat.jsonl"
QUESTION = {"type": "text", "text": "What colour is this square?"}


def chat_row(user_content, answer="red", **fields):
    return {**fields, "messages": [{"role": "user", "content": user_content},
                                   {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}


def write_rows(folder: Path, rows: list[dict], image: str = "red.png") -> Path:
    """A jsonl of ``rows`` beside a copy of a demo image named ``image``."""
    shutil.copy(COLOURS.parent / "images" / "red-0.png", folder / image)
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def vision_config(data_file: Path, data: dict | None = None, **sections):
    return quick_config(data_file, model={"name_or_path": str(TINY_VL)}).replace(
        data={"train_files": (str(data_file),), "eval_files": (), "max_length": 64, "eval_fraction": 0.0,
              **(data or {})}, **sections)


def test_rows_with_images_read_as_chat_with_their_files():
    report = inspect_files([COLOURS], keep=1)
    example = report.examples[0]
    assert report.format == "chat" and report.rows == 24
    assert [part["type"] for part in example.messages[0]["content"]] == ["image", "text"]
    assert example.messages[1]["content"] in {"red", "green", "blue", "yellow", "black", "white"}
    assert len(example.images) == 1 and Path(example.images[0]).is_file()


def test_an_image_part_may_name_its_own_file(tmp_path):
    path = write_rows(tmp_path, [chat_row([{"type": "image", "path": "red.png"}, QUESTION])])
    assert inspect_files([path], keep=1).examples[0].images == (str(tmp_path / "red.png"),)


def test_text_only_content_lists_read_as_text(tmp_path):
    path = write_rows(tmp_path, [chat_row([QUESTION])])
    example = inspect_files([path], keep=1).examples[0]
    assert example.images == () and example.messages[0]["content"] == QUESTION["text"]


@pytest.mark.parametrize("row, expected", [
    (chat_row([{"type": "image"}, {"type": "image"}, QUESTION], images=["red.png", "missing.png"]),
     "rows.jsonl:2: image 1 (missing.png) does not exist"),
    (chat_row([{"type": "image", "image": "https://example.com/red.png"}, QUESTION]),
     "rows.jsonl:2: image 0 (messages[0].content[0]) is a URL ('https://example.com/red.png'): studio reads local "
     "image files only (offline)"),
    (chat_row([{"type": "image"}, QUESTION]),
     "rows.jsonl:2: messages[0].content[0] is image 0, but field 'images' lists 0"),
    (chat_row([QUESTION], images=["red.png"]),
     "rows.jsonl:2: field 'images' lists 1 image(s), but the messages' image parts take 0"),
    ({"messages": [{"role": "user", "content": "Draw red."},
                   {"role": "assistant", "content": [{"type": "image", "path": "red.png"}]}]},
     "rows.jsonl:2: messages[1].content[0] is an image in the assistant's turn"),
])
def test_bad_images_are_refused_naming_the_row_and_the_image(tmp_path, row, expected):
    good = chat_row([{"type": "image"}, QUESTION], images=["red.png"])
    path = write_rows(tmp_path, [good, row])
    with pytest.raises(ProblemsError) as raised:
        inspect_files([path])
    assert str(raised.value).splitlines()[1].strip().startswith(f"- {expected}"), str(raised.value)


def prepared(config):
    from studio.train.data.images import ImageRows
    from studio.train.data.prepare import prepare_data
    from studio.train.model.build import load_tokenizer

    tokenizer = load_tokenizer(config)
    return prepare_data(config, tokenizer, image_rows=ImageRows.for_run(config, tokenizer)), tokenizer


def test_an_unreadable_image_is_refused_naming_the_row_and_the_image(tmp_path):
    path = write_rows(tmp_path, [chat_row([{"type": "image"}, QUESTION], images=["broken.png"])], image="red.png")
    (tmp_path / "broken.png").write_text("not an image", encoding="utf-8")
    with pytest.raises(ProblemsError, match=r"rows.jsonl:1: image 0 \(.*broken.png\) cannot be read as an image"):
        prepared(vision_config(path))


def test_a_row_cut_into_its_images_or_writing_their_tokens_in_its_text_is_refused_saying_which(tmp_path):
    path = write_rows(tmp_path, [chat_row([{"type": "image"}, QUESTION], images=["red.png"])])
    with pytest.raises(ProblemsError, match=r"rows.jsonl:1: data.max_length 8 cuts into the row's images: the "
                       r"images alone are \d+ tokens"):
        prepared(vision_config(path, {"max_length": 8}))
    from test_vision_families import saved_family

    gemma = saved_family("gemma3", tmp_path / "gemma3")  # its image becomes <image_soft_token>s between frames
    typed = write_rows(tmp_path, [chat_row([{"type": "image"}, {"type": "text", "text": "<image_soft_token>?"}],
                                           images=["red.png"])])
    with pytest.raises(ProblemsError, match=r"rows.jsonl:1: the row's text holds the images' own tokens "
                       r"\(.*<image_soft_token>.*\) beside its image parts: 1 more than its images make"):
        prepared(vision_config(typed, {"max_length": 256}, model={"name_or_path": str(gemma)}))


def test_a_built_in_template_refuses_rows_with_images(tmp_path):
    path = write_rows(tmp_path, [chat_row([{"type": "image"}, QUESTION], images=["red.png"])])
    with pytest.raises(ProblemsError, match="rows.jsonl:1: a row with images needs the model's own chat template, "
                                            "not chatml"):
        prepared(vision_config(path, data={"template": "chatml"}))


def test_a_text_model_refuses_rows_with_images(tmp_path):
    path = write_rows(tmp_path, [chat_row([{"type": "image"}, QUESTION], images=["red.png"])])
    with pytest.raises(ProblemsError, match="rows.jsonl:1: the row holds 1 image.*but the model is a text model"):
        prepared(vision_config(path, model={"name_or_path": str(RESOURCES / "models" / "studio-tiny")}))


def test_labels_learn_the_answer_alone_never_the_image_or_the_prompt():
    from studio.train.data.images import row_image_inputs

    data, tokenizer = prepared(vision_config(COLOURS))
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for row in data.train:
        ids, labels = row["input_ids"], row["labels"]
        learned = [token for token, label in zip(ids, labels) if label != -100]
        answer = tokenizer.decode(learned).split("<|im_end|>")[0]
        assert answer in {"red", "green", "blue", "yellow", "black", "white"}
        assert ids.count(image_token) == 4  # a 16x16 image: 4x4 patches merged 2x2
        assert all(label == -100 for token, label in zip(ids, labels) if token == image_token)
        assert labels[:ids.index(image_token) + 4] == [-100] * (ids.index(image_token) + 4)  # the prompt
        assert row_image_inputs(row)["image_grid_thw"].tolist() == [[1, 4, 4]]


@pytest.mark.parametrize("model_type, name, reason", [
    ("fuyu", "fuyu", "studio does not train it on images yet"),
])
def test_other_vision_families_are_refused_images_by_name(model_type, name, reason):
    from studio.core.model.vision import image_training_refusal, vision_family

    config = {"model_type": model_type, "vision_config": {"hidden_size": 8}, "text_config": {}}
    assert vision_family(config) is None  # their language model still trains on text, as before
    refusal = image_training_refusal(config)
    assert refusal is not None and refusal.message.startswith(f"{name} is a vision-language model that studio does "
                                                              f"not train on images: {reason}")
    assert "it trains Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3, Idefics3" in refusal.message


def test_images_on_a_text_model_are_refused_before_anything_loads(tmp_path):
    from studio.train import worker

    path = write_rows(tmp_path, [chat_row([{"type": "image"}, QUESTION], images=["red.png"])] * 8)
    config = vision_config(path, model={"name_or_path": str(RESOURCES / "models" / "studio-tiny")})
    code, run_dir = worker.run(config, tmp_path / "run", watch_stdin=False)
    failed = [event for event in read_events(run_dir.events) if event["type"] == "error"]
    assert code != 0 and "the data holds images, but the model is a text model" in failed[0]["message"]
    assert not any(event["type"] == "step" for event in read_events(run_dir.events))


def trained_names(config) -> set[str]:
    import torch

    from studio.train.model.build import build_model

    return {name for name, param in build_model(config, torch.device("cpu")).named_parameters() if param.requires_grad}


def test_full_fine_tuning_trains_the_language_model_and_the_parts_asked_for():
    config = vision_config(COLOURS, method="full")
    assert not any(".visual." in name for name in trained_names(config))
    with_projector = trained_names(config.replace(vision={"train_projector": True}))
    assert any(".visual.merger." in name for name in with_projector)
    assert not any(".visual.blocks." in name for name in with_projector)


def test_lora_beside_a_projector_trained_whole():
    trained = trained_names(vision_config(COLOURS, vision={"train_projector": True}))
    assert {name for name in trained if ".visual." in name} == {name for name in trained if ".visual.merger." in name}
    assert any(".visual.merger." in name and "lora_" not in name for name in trained)
    assert any("lora_" in name and ".language_model." in name for name in trained)


def test_lora_steps_train_the_language_model_alone_and_leave_the_vision_tower():
    import torch

    from studio.train.data.prepare import collate
    from studio.train.model.build import build_model
    from studio.train.objectives.next_token import token_loss_sum

    config = vision_config(COLOURS, training={"gradient_checkpointing": True})
    data, tokenizer = prepared(config)
    torch.manual_seed(0)
    model = build_model(config, torch.device("cpu"))
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trained and all("lora_" in name and ".language_model." in name for name in trained)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], lr=1e-2)
    model.train()
    batch = collate([data.train[index] for index in range(8)], tokenizer.pad_token_id)
    for _ in range(3):
        optimizer.zero_grad()
        token_loss_sum(model, batch).backward()
        optimizer.step()
    changed = {name for name, param in model.named_parameters() if not torch.equal(param, before[name])}
    assert changed and changed <= trained
    assert not any(".visual." in name for name in changed)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    from studio.train import worker

    config = vision_config(COLOURS, training={"micro_batch_size": 4, "max_steps": 8, "learning_rate": 1e-2,
                                              "warmup_ratio": 0.0, "lr_scheduler": "constant",
                                              "gradient_checkpointing": True})
    code, run_dir = worker.run(config, tmp_path_factory.mktemp("vision") / "run", watch_stdin=False)
    assert code == 0
    return config, run_dir


def test_a_short_run_on_images_lowers_the_loss(trained_run):
    config, run_dir = trained_run
    run_losses = losses(run_dir)
    assert len(run_losses) == 8 and run_losses[-1] < run_losses[0] - 0.2
    assert "plain padded micro-batches" in (run_dir.path / "train.log").read_text(encoding="utf-8")
    assert config.data.packing == "padding_free"  # asked for, and visibly not done for rows with images
    warnings = [event["message"] for event in read_events(run_dir.events) if event["type"] == "warning"]
    assert any(message.startswith("rows with images are not packed yet") for message in warnings)


def test_the_run_estimates_its_memory_and_says_what_it_counts_for_the_images(trained_run):
    _, run_dir = trained_run
    estimates = [event for event in read_events(run_dir.events) if event["type"] == "estimate"]
    assert estimates and estimates[0]["peak_bytes"] > 0
    note = next(note for note in estimates[0]["notes"] if note.startswith("vision-language model"))
    assert "4 image(s) a micro-batch, 64 patches, 16 image tokens" in note  # 16x16 images: 4x4 patches each
    assert "are frozen: no gradients, no optimizer state, nothing kept for backward" in note


def test_exports_reload_in_plain_transformers_with_the_trained_logits_on_image_rows(trained_run, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from studio.train.export.hf_format import export_run, verification_inputs
    from studio.train.model.build import load_tokenizer

    config, run_dir = trained_run
    folders = {kind: export_run(run_dir.path, kind, tmp_path / kind)[0] for kind in ("adapter", "merged")}
    inputs = verification_inputs(config, load_tokenizer(config), torch.device("cpu"))
    assert inputs["pixel_values"].shape[0] == 4 * 16  # four rows, 16 patches each
    assert AutoImageProcessor.from_pretrained(folders["merged"], backend="pil").merge_size == 2
    merged = AutoModelForImageTextToText.from_pretrained(folders["merged"]).eval()
    adapted = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(TINY_VL), folders["adapter"]).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).logits, adapted(**inputs).logits, atol=1e-4, rtol=1e-4)
        base = AutoModelForImageTextToText.from_pretrained(TINY_VL).eval()(**inputs).logits
    assert not torch.allclose(base, merged(**inputs).logits, atol=1e-3)  # the export carries the training


def test_a_gguf_export_is_refused_before_any_work_saying_the_vision_projector_is_not_written(trained_run):
    from studio.train.export.gguf import check_gguf

    _, run_dir = trained_run
    with pytest.raises(StudioError, match="mmproj") as refused:
        check_gguf(run_dir.path)
    assert "--merged" in refused.value.hint and not (run_dir.exports_dir / "gguf").exists()
