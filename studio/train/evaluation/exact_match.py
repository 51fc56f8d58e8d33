"""Generation-based evaluation: does the model answer held-out prompts exactly right, or (grpo) how do the run's
rewards score its answers?"""

from __future__ import annotations

import json
from typing import Any, Sequence

import torch

from studio.core.rewards import Rewards, Scores
from studio.train.data.images import image_batch
from studio.train.data.prepare import encode_prompt


@torch.no_grad()
def exact_match(model, tokenizer, examples, template: str, max_new_tokens: int = 24, batch_size: int = 32) -> float:
    """Fraction of examples whose greedy answer equals the expected response (stripped)."""
    model.eval()
    prompts = [encode_prompt(example, tokenizer, template) for example in examples]
    correct = 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        answers = generate_answers(model, tokenizer, [ids for ids, _ in chunk], max_new_tokens)
        correct += sum(answer.strip() == expected.strip() for answer, (_, expected) in zip(answers, chunk))
    return correct / max(len(prompts), 1)


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[list[int]], max_new_tokens: int,
                     images: Sequence[dict[str, bytes]] = ()) -> list[str]:
    """Greedy answers for a batch of token prompts (left-padded so all end together), with each prompt's images
    (``encode_image_prompt``'s) when given."""
    device = next(model.parameters()).device
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, length - len(prompt):] = torch.tensor(prompt)
        mask[i, length - len(prompt):] = 1
    pixels = {name: value.to(device) for name, value in image_batch(list(images), length, left=True).items()}
    output = model.generate(
        input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **pixels,
    )
    return tokenizer.batch_decode(output[:, length:], skip_special_tokens=True)


@torch.no_grad()
def rewarded_answers(model, tokenizer, prompts: Sequence[dict[str, Any]], rewards: Rewards, max_new_tokens: int,
                     batch_size: int) -> list[tuple[str, Scores]]:
    """Each prompt's greedy answer and its scores by the run's rewards, ``batch_size`` prompts at a time. The prompts
    are rows of grpo's prompt-only split (``input_ids``, ``row``, ``location``): the held-out reward of a run's eval
    events and of ``studio eval``, measured alike."""
    answered = []
    for start in range(0, len(prompts), batch_size):
        batch = [prompts[i] for i in range(start, min(start + batch_size, len(prompts)))]
        answers = generate_answers(model, tokenizer, [list(p["input_ids"]) for p in batch], max_new_tokens)
        answered += [(answer, rewards.score(answer, json.loads(p["row"]), p["location"]))
                     for answer, p in zip(answers, batch)]
    return answered
