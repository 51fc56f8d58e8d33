"""The preference objectives equal TRL's trainers: on the same tiny model, pairs and settings, the loss, every
trained parameter's gradient (1e-5) and the metrics TRL logs; and the pairs are TRL's very tokens.

DPO is compared with TRL's DPOTrainer as a whole (its tokenizing, collator, reference and compute_loss). ORPO and
SimPO are compared with TRL's ORPOTrainer and CPOTrainer (loss_type simpo, cpo_alpha our sft_weight) in
trl.experimental: their get_batch_loss_metrics on a batch in their layout made of our tokens (their own tokenizing is
TRL's older one, with its prompt truncation, which the DPO trainer replaced).

Pairs whose prompt holds images (the tiny Qwen2-VL, and a tiny Gemma 3: its token_type_ids): DPO is compared with
DPOTrainer's vision path as a whole (its collator given the model's processor, the images repeated for the rejected
sequences); SimPO, which TRL's CPOTrainer does not train on images, with its SimPO loss on DPOTrainer's vision
forward."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import with_demo_tokenizer
from model_factory import make_tiny_model
from studio.core.presets import demo_config
from studio.train.data.images import TOKEN_INPUTS, ImageRows, row_image_inputs
from studio.train.data.packed_attention import attend_packed
from studio.train.data.prepare import prepare_data
from studio.train.model.build import build_model, load_base_model, load_tokenizer
from studio.train.objectives import objective_for

trl = pytest.importorskip("trl")

PAIRS = [
    {"prompt": "What color is the sky?", "chosen": " Blue, mostly.", "rejected": " Green."},
    {"prompt": "Name a fruit:", "chosen": " apple", "rejected": " a chair, of course"},
    {"prompt": [{"role": "user", "content": "Hi there"}], "chosen": [{"role": "assistant", "content": "Hello!"}],
     "rejected": [{"role": "assistant", "content": "Go away, now."}]},
]
PLAIN, CONVERSATIONAL = PAIRS[:2], PAIRS[2:] * 2
UNPAIRED = [  # KTO's rows: both labels, plain and conversational
    {"prompt": "What color is the sky?", "completion": " Blue, mostly.", "label": True},
    {"prompt": "Name a fruit:", "completion": " a chair, of course", "label": False},
    {"prompt": "Two and two make", "completion": " four", "label": True},
    {"prompt": "Say hello:", "completion": " Go away, now.", "label": False},
]
UNPAIRED_CONVERSATIONAL = [{"prompt": [{"role": "user", "content": row["prompt"]}],
                            "completion": [{"role": "assistant", "content": row["completion"].strip()}],
                            "label": row["label"]} for row in UNPAIRED]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return with_demo_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp("tiny"), vocab_size=1200))


def _config(folder, data_file, objective, method, max_length=24, **preference):
    return demo_config().replace(
        model={"name_or_path": str(folder)}, method=method, objective=objective, preference=preference,
        data={"train_files": (str(data_file),), "eval_files": (), "max_length": max_length},
        # a micro-batch holds every row: KTO pairs its mismatched completions within it, as TRL within its batch
        training={"precision": "fp32", "gradient_checkpointing": False, "micro_batch_size": 8},
        lora={"dropout": 0.0})


def _write(rows, path):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _policy(config, seed=1):
    """The trained model, its adapter (or weights) moved off the start (by a seeded random step), so that it differs
    from its reference."""
    torch.manual_seed(0)
    model = build_model(config, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                parameter += 0.05 * torch.randn(parameter.shape, generator=generator)
    return model


def _ours(config, seed=1, packed=False):
    """Our loss, gradients and metrics on the whole data as one micro-batch: padded as TRL pads, or packed (the
    model attending per sequence, as the worker switches it)."""
    tokenizer = load_tokenizer(config)
    rows = prepare_data(config, tokenizer, image_rows=ImageRows.for_run(config, tokenizer)).train
    model = _policy(config, seed)
    if packed:
        attend_packed(model)
    frozen = None
    if not config.uses_adapter and config.uses_reference:
        frozen = load_base_model(config, torch.device("cpu")).requires_grad_(False).eval()
    objective = objective_for(config, model, tokenizer.pad_token_id, frozen)
    model.train()
    batch = objective.batch([rows[i] for i in range(len(rows))], packed=packed)
    loss = objective.loss_sum(model, batch) / objective.units(batch)
    loss.backward()
    metrics = objective.metrics(objective.take_metric_sums(), objective.units(batch))
    return rows, loss.detach(), _grads(model), metrics


def _grads(model):
    return {name.replace(".default", ""): p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def _close(ours, theirs):
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "robust", "hinge"])
@pytest.mark.parametrize("method", ["lora", "full"])
def test_dpo_equals_trl(model_folder, tmp_path, method, loss_type):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    smoothing = 0.2 if loss_type == "robust" else 0.0
    rows = PLAIN if loss_type != "ipo" else CONVERSATIONAL
    config = _config(model_folder, _write(rows, tmp_path / "pairs.jsonl"), "dpo", method, beta=0.5,
                     dpo_loss=loss_type, label_smoothing=smoothing)
    tokenized, loss, grads, metrics = _ours(config)

    model = _policy(config)
    reference = None if config.uses_adapter else load_base_model(config, torch.device("cpu"))
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.5, loss_type=[loss_type], label_smoothing=smoothing,
                     max_length=24, report_to=[], bf16=False, gradient_checkpointing=False,
                     per_device_train_batch_size=len(rows), use_cpu=True)
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=load_tokenizer(config))
    if "ref" in getattr(trainer.model, "peft_config", {}):
        # TRL copies an adapter it is given as the reference ("ref"); a new adapter's reference is the base with the
        # adapter off, TRL's own path without that copy, and ours (the moved adapter makes the two differ)
        trainer.model.delete_adapter("ref")
    examples = [trainer.train_dataset[i] for i in range(len(rows))]
    for ours, theirs in zip(tokenized, examples):  # TRL's very tokens, cut as its collator cuts them (keep_start)
        assert ours["input_ids"] == (theirs["prompt_ids"] + theirs["chosen_ids"])[:24]
        assert ours["rejected_input_ids"] == (theirs["prompt_ids"] + theirs["rejected_ids"])[:24]
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, trainer.data_collator(examples))
    trl_loss.backward()

    torch.testing.assert_close(loss, trl_loss.detach(), atol=1e-5, rtol=1e-5)
    _close(grads, _grads(model))
    _same_metrics(metrics, {name: values[-1] for name, values in trainer._metrics["train"].items()})


def _same_metrics(ours, logged):
    for name, value in ours.items():
        assert value == pytest.approx(logged[name], abs=1e-5), name


def _trl_pair_batch(tokenized, pad_token_id):
    """Our pairs in the layout of TRL's ORPO and CPO trainers: each side padded on the right, response labels."""
    from torch.nn.utils.rnn import pad_sequence

    batch = {}
    for side, prefix in (("chosen", ""), ("rejected", "rejected_")):
        padded = lambda key, fill: pad_sequence([torch.tensor(r[key]) for r in tokenized],  # noqa: E731
                                                batch_first=True, padding_value=fill)
        batch[f"{side}_input_ids"] = padded(f"{prefix}input_ids", pad_token_id)
        batch[f"{side}_labels"] = padded(f"{prefix}labels", -100)
        batch[f"{side}_attention_mask"] = pad_sequence(
            [torch.ones(len(r[f"{prefix}input_ids"]), dtype=torch.long) for r in tokenized], batch_first=True)
    return batch


@pytest.mark.parametrize("objective", ["orpo", "simpo"])
@pytest.mark.parametrize("method", ["lora", "full"])
def test_orpo_and_simpo_equal_trl(model_folder, tmp_path, method, objective):
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    simpo = {"simpo_gamma": 0.4, "label_smoothing": 0.1, "sft_weight": 0.3}
    config = _config(model_folder, _write(PLAIN, tmp_path / "pairs.jsonl"), objective, method, beta=0.5,
                     **(simpo if objective == "simpo" else {}))
    tokenized, loss, grads, metrics = _ours(config)

    model, tokenizer = _policy(config), load_tokenizer(config)
    common = dict(output_dir=str(tmp_path / "trl"), beta=0.5, max_length=24, report_to=[], bf16=False,
                  use_cpu=True, per_device_train_batch_size=len(PLAIN))
    if objective == "orpo":
        trainer_class, args = ORPOTrainer, ORPOConfig(**common)
    else:
        trainer_class, args = CPOTrainer, CPOConfig(loss_type="simpo", simpo_gamma=0.4, label_smoothing=0.1,
                                                    cpo_alpha=0.3, **common)
    trainer = trainer_class(model=model, args=args, train_dataset=Dataset.from_list(PLAIN),
                            processing_class=tokenizer)
    trainer.model.train()
    trl_loss, logged = trainer.get_batch_loss_metrics(trainer.model, _trl_pair_batch(tokenized, tokenizer.pad_token_id))
    trl_loss.backward()

    torch.testing.assert_close(loss, trl_loss.detach(), atol=1e-5, rtol=1e-5)
    _close(grads, _grads(model))
    _same_metrics(metrics, logged)


@pytest.mark.parametrize("rows", [UNPAIRED, UNPAIRED_CONVERSATIONAL], ids=["plain", "conversational"])
@pytest.mark.parametrize("method", ["lora", "full"])
def test_kto_equals_trl(model_folder, tmp_path, method, rows):
    """KTO, its KL term from mismatched completions included: TRL rotates the completions by one within each batch of
    its data's order (per_device_train_batch_size), we within each group of micro_batch_size rows of ours; with every
    row in one batch (and one micro-batch), both pair each prompt with the completion of the row before it."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    settings = {"beta": 0.5, "desirable_weight": 0.8, "undesirable_weight": 1.3}
    config = _config(model_folder, _write(rows, tmp_path / "unpaired.jsonl"), "kto", method, **settings)
    seed = 5  # a step after which the plain rows' KL estimate is above 0 (not clamped) for both methods
    tokenized, loss, grads, metrics = _ours(config, seed)

    model = _policy(config, seed)
    reference = None if config.uses_adapter else load_base_model(config, torch.device("cpu"))
    args = KTOConfig(output_dir=str(tmp_path / "trl"), max_length=24, report_to=[], bf16=False, use_cpu=True,
                     gradient_checkpointing=False, per_device_train_batch_size=len(rows), **settings)
    trainer = KTOTrainer(model=model, ref_model=reference, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=load_tokenizer(config))
    if "ref" in getattr(trainer.model, "peft_config", {}):  # as for DPO: the reference is the adapter off
        trainer.model.delete_adapter("ref")
    examples = [trainer.train_dataset[i] for i in range(len(rows))]
    for ours, theirs in zip(tokenized, examples):  # TRL's very tokens, its mismatched completions too
        assert ours["input_ids"] == (theirs["prompt_ids"] + theirs["completion_ids"])[:24]
        assert ours["kl_completion_ids"] == theirs["KL_completion_ids"][:24]
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, trainer.data_collator(examples))
    trl_loss.backward()

    torch.testing.assert_close(loss, trl_loss.detach(), atol=1e-5, rtol=1e-5)
    _close(grads, _grads(model))
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    assert metrics["kl"] > 0 or rows is UNPAIRED_CONVERSATIONAL  # plain rows: the KL term is in the loss
    _same_metrics(metrics, logged)


@pytest.mark.parametrize("objective", ["dpo", "orpo", "simpo", "kto"])
def test_a_packed_batch_gives_the_padded_loss_gradients_and_metrics(model_folder, tmp_path, objective):
    rows = UNPAIRED if objective == "kto" else PAIRS  # rows of several lengths, plain and conversational pairs
    config = _config(model_folder, _write(rows, tmp_path / "rows.jsonl"), objective, "lora", beta=0.5)
    _, padded_loss, padded_grads, padded_metrics = _ours(config, seed=5)
    _, packed_loss, packed_grads, packed_metrics = _ours(config, seed=5, packed=True)
    torch.testing.assert_close(packed_loss, padded_loss, atol=1e-5, rtol=1e-5)
    _close(packed_grads, padded_grads)
    assert packed_metrics.keys() == padded_metrics.keys()
    _same_metrics(packed_metrics, padded_metrics)


TINY_VL = Path(__file__).resolve().parent.parent / "resources" / "models" / "studio-tiny-vl"  # Qwen2-VL


def _image_pairs(folder):
    """TRL's vision preference rows: the prompt's image parts, their files in the images column (two generated
    images of different sizes, so of different token counts), and plain-text answers."""
    import numpy as np
    from PIL import Image

    generator = np.random.default_rng(0)
    for name, (height, width) in (("noise.png", (16, 16)), ("wide.png", (16, 32))):
        Image.fromarray(generator.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(folder / name)

    def pair(image, question, chosen, rejected):
        return {"images": [image],
                "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                "chosen": [{"role": "assistant", "content": [{"type": "text", "text": chosen}]}],
                "rejected": [{"role": "assistant", "content": [{"type": "text", "text": rejected}]}]}
    return [pair("noise.png", "What is in the picture?", "Noise.", "A red square, I think."),
            pair("wide.png", "Describe it", "A wide, noisy picture.", "Blue.")]


def _trl_vision(config, rows, folder, model, **settings):
    """TRL's DPOTrainer on its vision path (processing_class the model's processor, its
    DataCollatorForVisionPreference) over the image pairs, and its batch of them, checked to be our tokens and image
    inputs (``tokenized``), each pair's images in both of its sequences."""
    from datasets import Dataset
    from PIL import Image
    from trl import DPOConfig, DPOTrainer

    tokenizer = load_tokenizer(config)
    processor = ImageRows.for_run(config, tokenizer).processor
    processor.chat_template = tokenizer.chat_template  # TRL renders the rows through the processor
    args = DPOConfig(output_dir=str(folder / "trl"), max_length=config.data.max_length, report_to=[], bf16=False,
                     gradient_checkpointing=False, per_device_train_batch_size=len(rows), use_cpu=True, **settings)
    with_images = [{**row, "images": [Image.open(folder / name) for name in row["images"]]} for row in rows]
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(with_images),
                         processing_class=processor)
    if "ref" in getattr(trainer.model, "peft_config", {}):  # as for text: the reference is the adapter off
        trainer.model.delete_adapter("ref")
    trainer.model.train()
    return trainer, trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])


def _same_image_batch(tokenized, batch):
    """TRL's batch holds our pairs' tokens (chosen sequences, then rejected) and their images, repeated for the
    rejected sequences."""
    sequences = [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
    assert sequences == [r["input_ids"] for r in tokenized] + [r["rejected_input_ids"] for r in tokenized]
    ours = [row_image_inputs(r) for r in tokenized]
    for name in set(ours[0]) - set(TOKEN_INPUTS):  # pixel_values, and image_grid_thw for Qwen2-VL
        torch.testing.assert_close(batch[name], torch.from_numpy(np.concatenate([r[name] for r in ours * 2])))


def _vision_model(family, folder):
    """The tiny Qwen2-VL of the resources, or a tiny random model of another family (its processor's per-token
    image inputs TRL's collator handles: Gemma 3's token_type_ids)."""
    if family == "qwen2_vl":
        return TINY_VL
    from test_vision_families import saved_family

    return saved_family(family, folder / family)


@pytest.mark.parametrize("family, loss_type", [("qwen2_vl", "sigmoid"), ("qwen2_vl", "ipo"), ("gemma3", "sigmoid")])
def test_dpo_with_image_prompts_equals_trl(tmp_path, family, loss_type):
    """DPO on rows with images equals TRL's DPOTrainer on its vision path: the same tokens and image inputs, and the
    loss, the LoRA gradients and the rewards TRL logs."""
    rows = _image_pairs(tmp_path)
    config = _config(_vision_model(family, tmp_path), _write(rows, tmp_path / "pairs.jsonl"), "dpo", "lora",
                     max_length=96, beta=0.5, dpo_loss=loss_type)
    tokenized, loss, grads, metrics = _ours(config)

    model = _policy(config)
    trainer, batch = _trl_vision(config, rows, tmp_path, model, beta=0.5, loss_type=[loss_type])
    _same_image_batch(tokenized, batch)
    trl_loss = trainer.compute_loss(trainer.model, batch)
    trl_loss.backward()

    torch.testing.assert_close(loss, trl_loss.detach(), atol=1e-5, rtol=1e-5)
    _close(grads, _grads(model))
    _same_metrics(metrics, {name: values[-1] for name, values in trainer._metrics["train"].items()})


def test_simpo_with_image_prompts_equals_trls_loss_on_its_vision_forward(tmp_path):
    """SimPO on rows with images: TRL's CPOTrainer has no vision path (it never hands the model pixel_values), so our
    loss, gradients and rewards are compared with its SimPO loss (``cpo_loss``, loss_type simpo) on the per-token
    log-probabilities of DPOTrainer's vision forward (its collator, its model call), averaged as CPO averages them."""
    from types import SimpleNamespace

    from trl.experimental.cpo import CPOTrainer

    simpo = {"beta": 0.5, "simpo_gamma": 0.4, "label_smoothing": 0.1}
    rows = _image_pairs(tmp_path)
    config = _config(TINY_VL, _write(rows, tmp_path / "pairs.jsonl"), "simpo", "lora", max_length=64, **simpo)
    tokenized, loss, grads, metrics = _ours(config)

    model = _policy(config)
    trainer, batch = _trl_vision(config, rows, tmp_path, model)
    _same_image_batch(tokenized, batch)
    completion = batch.pop("completion_mask")
    labels = batch["input_ids"].masked_fill(completion == 0, -100)
    token_logps = trainer.model(**batch, use_cache=False, labels=labels, fused_lm_head=True).log_probs
    mask = completion[:, 1:]
    chosen, rejected = ((token_logps * mask).sum(1) / mask.sum(1)).chunk(2)
    cpo = SimpleNamespace(alpha=0.0, loss_type="simpo", accelerator=SimpleNamespace(device="cpu"), **simpo)
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(cpo, chosen, rejected)
    losses.mean().backward()

    torch.testing.assert_close(loss, losses.mean().detach(), atol=1e-5, rtol=1e-5)
    _close(grads, _grads(model))
    logged = {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
              "rewards/margins": chosen_rewards - rejected_rewards, "logps/chosen": chosen, "logps/rejected": rejected,
              "rewards/accuracies": (chosen_rewards > rejected_rewards).float()}  # as CPOTrainer logs them: means
    _same_metrics(metrics, {name: values.mean().item() for name, values in logged.items()})
