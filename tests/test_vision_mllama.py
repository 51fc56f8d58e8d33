"""Llama 3.2 Vision (mllama, issue 30): a tiny random MllamaForConditionalGeneration whose images reach its language
model through cross-attention. A row keeps one <|image|> token per image; its inputs are those transformers' own
processor gives; rows of one and two images, of different sizes, batch as they run alone; LoRA adapts the
cross-attention layers too, the tower untouched; text rows train beside image rows; the adapter export reloads in
plain transformers and peft; prompts with images are answered in a left-padded batch as alone."""

import json

import pytest

from helpers import losses
from test_vision_families import COLOURS, family_config, prepared, saved_family

QUESTION = {"type": "text", "text": "What colour is this?"}


@pytest.fixture(scope="module")
def mllama(tmp_path_factory):
    return saved_family("mllama", tmp_path_factory.mktemp("mllama"))


def write_rows(folder, rows: list[tuple[list[tuple[int, int]], str]]):
    """A jsonl of chat rows, each (its images' sizes, its answer): the images in one user turn, a question after
    each; a row of no image is a text row."""
    from PIL import Image

    lines = []
    for row, (sizes, answer) in enumerate(rows):
        names = [f"{row}-{index}.png" for index in range(len(sizes))]
        for index, (name, size) in enumerate(zip(names, sizes)):
            Image.new("RGB", size, (60 * index, 40 * row, 200)).save(folder / name)
        content = [part for _ in names for part in ({"type": "image"}, QUESTION)] or "What colour is the sky?"
        messages = [{"role": "user", "content": content},
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        lines.append(json.dumps({**({"images": names} if names else {}), "messages": messages}))
    path = folder / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def rows_config(folder, path, **sections):
    return family_config(folder, **sections).replace(data={"train_files": (str(path),), "max_length": 128})


def test_a_row_holds_one_image_token_and_the_inputs_transformers_processor_gives(mllama):
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor, MllamaProcessor

    from studio.core.data.dataset import inspect_files
    from studio.train.data.images import row_image_inputs

    data, tokenizer, image_rows = prepared(family_config(mllama))
    row, example = data.train[0], inspect_files([COLOURS], keep=1).examples[0]
    image_token = tokenizer.convert_tokens_to_ids("<|image|>")
    assert row["input_ids"].count(image_token) == 1  # no tokens of its own: the image is read by cross-attention
    processor = MllamaProcessor(AutoImageProcessor.from_pretrained(mllama, backend="pil"), tokenizer)
    text = tokenizer.apply_chat_template([dict(message) for message in example.messages], tokenize=False)
    expected = processor(text=text, images=[Image.open(example.images[0]).convert("RGB")], add_special_tokens=False,
                         return_tensors="np")
    # the processor puts a bos first; studio, where its tokenizer does (as for text rows)
    start = len(expected["input_ids"][0]) - len(row["input_ids"])
    assert list(expected["input_ids"][0][start:]) == row["input_ids"]
    inputs = row_image_inputs(row)
    for name in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"):
        np.testing.assert_array_equal(inputs[name], expected[name])
    np.testing.assert_array_equal(inputs["cross_attention_mask"], expected["cross_attention_mask"][:, start:])
    seen, image = inputs["cross_attention_mask"][0, :, 0].sum(-1), row["input_ids"].index(image_token)
    assert set(seen[:image]) == {0} and set(seen[image:]) == {1}  # the tiles each token sees: one 16x16 tile


def test_rows_of_one_and_of_two_images_of_different_sizes_give_in_a_batch_the_logits_they_give_alone(mllama, tmp_path):
    """The row of one image fills its second slot with its own image again: the tokens before its image, which see
    none, attend evenly over its slots (transformers' mllama), as they do alone."""
    import torch
    from transformers import AutoModelForImageTextToText

    from studio.train.data.packing import model_inputs
    from studio.train.data.prepare import collate

    path = write_rows(tmp_path, [([(16, 16)], "blue"), ([(32, 16), (16, 32)], "green"), ([], "blue")])
    data, tokenizer, _ = prepared(rows_config(mllama, path))
    model = AutoModelForImageTextToText.from_pretrained(mllama).eval()
    both = collate([data.train[0], data.train[1]], tokenizer.pad_token_id)
    assert both["pixel_values"].shape[:3] == (2, 2, 4) and both["cross_attention_mask"].shape[2:] == (2, 4)
    assert both["aspect_ratio_mask"][:, :, :2].sum(-1).tolist() == [[1, 1], [2, 2]]  # tiles: 1; 2 and 2
    with torch.no_grad():
        batched = model(**model_inputs(both)).logits
        for index in range(2):
            alone = model(**model_inputs(collate([data.train[index]], tokenizer.pad_token_id))).logits[0]
            torch.testing.assert_close(batched[index, :len(alone)], alone, atol=1e-5, rtol=1e-5)
        text_alone = collate([data.train[2]], tokenizer.pad_token_id)
        assert "pixel_values" not in text_alone  # a text micro-batch runs the language model's text layers alone
        beside_text = collate([data.train[0], data.train[2]], tokenizer.pad_token_id)
        assert not beside_text["cross_attention_mask"][1].any()  # the text row sees no image
        alone = model(**model_inputs(collate([data.train[0]], tokenizer.pad_token_id))).logits[0]
        torch.testing.assert_close(model(**model_inputs(beside_text)).logits[0, :len(alone)], alone,
                                   atol=1e-5, rtol=1e-5)


def test_lora_adapts_the_cross_attention_layers_and_its_loss_falls_on_image_and_text_rows(mllama, tmp_path):
    import torch

    from studio.train.data.prepare import collate
    from studio.train.model.build import build_model
    from studio.train.objectives.next_token import token_loss_sum

    path = write_rows(tmp_path, [([(16, 16)], "blue"), ([(32, 16), (16, 32)], "green"), ([], "blue")] * 2)
    config = rows_config(mllama, path)
    data, tokenizer, _ = prepared(config)
    torch.manual_seed(0)
    model = build_model(config, torch.device("cpu"))
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    cross = {name for name in trained if ".cross_attn." in name}
    assert {name.split(".cross_attn.")[1].split(".")[0] for name in cross} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert all("lora_" in name and "vision_model" not in name and "multi_modal_projector" not in name
               for name in trained)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], lr=1e-2)
    model.train()
    batches = [collate([data.train[index] for index in rows], tokenizer.pad_token_id) for rows in ([0, 1, 2], [5])]
    steps = []
    for _ in range(6):
        optimizer.zero_grad()
        loss = sum(token_loss_sum(model, batch) for batch in batches)
        loss.backward()
        optimizer.step()
        steps.append(float(loss))
    assert steps[-1] < steps[0]
    changed = {name for name, param in model.named_parameters() if not torch.equal(param, before[name])}
    assert changed <= trained and changed & cross  # the cross-attention's adapters learned from the images


def test_an_adapter_export_reloads_in_plain_transformers_and_peft_with_the_trained_logits(mllama, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from studio.train import worker
    from studio.train.export.hf_format import export_run, verification_inputs
    from studio.train.model.build import load_tokenizer

    config = family_config(mllama, training={"micro_batch_size": 4, "max_steps": 4, "learning_rate": 1e-2,
                                             "warmup_ratio": 0.0, "lr_scheduler": "constant",
                                             "gradient_checkpointing": True})
    code, run_dir = worker.run(config, tmp_path / "run", watch_stdin=False)
    assert code == 0 and len(losses(run_dir)) == 4
    folders, checks = {}, {}
    for kind in ("adapter", "merged"):
        folders[kind], checks[kind] = export_run(run_dir.path, kind, tmp_path / kind)
    assert all(check.passed for check in checks.values())
    inputs = verification_inputs(config, load_tokenizer(config), torch.device("cpu"))
    assert inputs["cross_attention_mask"].any()
    adapted = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(mllama), folders["adapter"]).eval()
    merged = AutoModelForImageTextToText.from_pretrained(folders["merged"]).eval()
    with torch.no_grad():
        logits = adapted(**inputs).logits
        torch.testing.assert_close(logits, merged(**inputs).logits, atol=1e-5, rtol=1e-5)
        base = AutoModelForImageTextToText.from_pretrained(mllama).eval()(**inputs).logits
    assert not torch.allclose(base, logits, atol=1e-3)  # the export carries the training


def test_prompts_with_images_are_answered_left_padded_in_a_batch_as_alone(mllama, tmp_path):
    """What studio eval and Try it do: greedy answers to prompts of one and two images, of different lengths, the
    cross-attention mask left-padded as the ids."""
    import torch
    from transformers import AutoModelForImageTextToText

    from studio.core.data.dataset import inspect_files
    from studio.train.data.images import image_batch
    from studio.train.data.prepare import encode_image_prompt
    from studio.train.evaluation.exact_match import generate_answers

    path = write_rows(tmp_path, [([(16, 16)], "blue"), ([(32, 16), (16, 32)], "green")])
    config = rows_config(mllama, path)
    _, tokenizer, image_rows = prepared(config)
    prompts = [encode_image_prompt(example, tokenizer, config.data.template, image_rows)[:2]
               for example in inspect_files([path]).examples]
    model = AutoModelForImageTextToText.from_pretrained(mllama).eval()

    def next_token_logits(chosen):  # of the prompts' last tokens, left-padded as generate_answers pads them
        width = max(len(ids) for ids, _ in chosen)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(row)) + row for row, _ in chosen])
        mask = (ids != tokenizer.pad_token_id).long()
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                         **image_batch([images for _, images in chosen], width, left=True)).logits[:, -1]

    assert len(prompts[0][0]) != len(prompts[1][0]) and tokenizer.pad_token_id not in prompts[0][0] + prompts[1][0]
    together = next_token_logits(prompts)
    for index, prompt in enumerate(prompts):
        torch.testing.assert_close(together[index], next_token_logits([prompt])[0], atol=1e-5, rtol=1e-5)
    answers = generate_answers(model, tokenizer, [ids for ids, _ in prompts], 6, [images for _, images in prompts])
    assert answers == [generate_answers(model, tokenizer, [ids], 6, [images])[0] for ids, images in prompts]
