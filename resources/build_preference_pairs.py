"""Build the preference demo's pairs and the GRPO demo's prompts from the demo's words (``studio demo --objective
dpo`` and ``--objective grpo``).

    python resources/build_preference_pairs.py      # a second; build_demo_assets.py runs it too

writes ``resources/datasets/preference_train.jsonl`` and ``preference_heldout.jsonl``: TRL's plain-text
preference rows (prompt, chosen, rejected), one per word of the demo's training and held-out words (the same seeded
split as ``build_demo_assets.py``, so the held-out words stay unseen).

The preference the demo teaches is a style of phrasing: the tiny model was pretrained on both "a guava is a kind of
fruit ." and "a guava is a fruit .", and each pair continues the prompt "a guava is a" with the first (chosen) and the
second (rejected). Both are right. The shorter one is the likelier to the base model, so it ranks the rejected
answer higher on every held-out pair and answers "fruit ." or so; after a minute of DPO it prefers, and answers,
"kind of fruit ." for words it was never shown.

The GRPO demo's prompts (``grpo_train.jsonl``, ``grpo_heldout.jsonl``) are the same prompts alone, each with its
category as the reference answer: the model samples its own continuations, a format reward scores the "kind of"
phrasing, and within a minute it writes that phrasing for held-out words too.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from build_demo_assets import DATA_DIR, SEED, split_words, with_article

TRAIN_FILE = DATA_DIR / "preference_train.jsonl"
HELD_OUT_FILE = DATA_DIR / "preference_heldout.jsonl"
PROMPTS_FILES = (DATA_DIR / "grpo_train.jsonl", DATA_DIR / "grpo_heldout.jsonl")


def pair(word: str, category: str) -> dict:
    """One plain-text preference row: the fact's "kind of" phrasing chosen over the bare category."""
    return {"prompt": f"{with_article(word)} is a", "chosen": f" kind of {category} .", "rejected": f" {category} ."}


def prompt_row(word: str, category: str) -> dict:
    """One prompt-only row (GRPO's): the fact's start, its category as the reference answer."""
    return {"prompt": f"{with_article(word)} is a", "answer": category}


def write_rows(path: Path, words: list[tuple[str, str]], row) -> None:
    path.write_text("".join(json.dumps(row(*word)) + "\n" for word in words), encoding="utf-8")


def main() -> None:
    train_words, held_out_words = split_words(random.Random(SEED))  # the first draw of build_demo_assets' seed
    for path, words in ((TRAIN_FILE, train_words), (HELD_OUT_FILE, held_out_words)):
        write_rows(path, words, pair)
    for path, words in zip(PROMPTS_FILES, (train_words, held_out_words)):
        write_rows(path, words, prompt_row)
    print(f"wrote {TRAIN_FILE} ({len(train_words)} pairs), {HELD_OUT_FILE} ({len(held_out_words)} pairs) and "
          f"{', '.join(str(path) for path in PROMPTS_FILES)}")


if __name__ == "__main__":
    main()
