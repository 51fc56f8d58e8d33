"""Build the preference demo's pairs from the demo's words (``studio demo --objective dpo``).

    python resources/build_preference_pairs.py      # a second; build_demo_assets.py runs it too

writes ``resources/datasets/preference_train.jsonl`` and ``preference_heldout.jsonl``: TRL's plain-text
preference rows (prompt, chosen, rejected), one per word of the demo's training and held-out words (the same seeded
split as ``build_demo_assets.py``, so the held-out words stay unseen).

The preference the demo teaches is a style of phrasing: the tiny model was pretrained on both "a guava is a kind of
fruit ." and "a guava is a fruit .", and each pair continues the prompt "a guava is a" with the first (chosen) and the
second (rejected). Both are right. The shorter one is the likelier to the base model, so it ranks the rejected
answer higher on every held-out pair and answers "fruit ." or so; after a minute of DPO it prefers, and answers,
"kind of fruit ." for words it was never shown.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from build_demo_assets import DATA_DIR, SEED, split_words, with_article

TRAIN_FILE = DATA_DIR / "preference_train.jsonl"
HELD_OUT_FILE = DATA_DIR / "preference_heldout.jsonl"


def pair(word: str, category: str) -> dict:
    """One plain-text preference row: the fact's "kind of" phrasing chosen over the bare category."""
    return {"prompt": f"{with_article(word)} is a", "chosen": f" kind of {category} .", "rejected": f" {category} ."}


def write_pairs(path: Path, words: list[tuple[str, str]]) -> None:
    path.write_text("".join(json.dumps(pair(*word)) + "\n" for word in words), encoding="utf-8")


def main() -> None:
    train_words, held_out_words = split_words(random.Random(SEED))  # the first draw of build_demo_assets' seed
    write_pairs(TRAIN_FILE, train_words)
    write_pairs(HELD_OUT_FILE, held_out_words)
    print(f"wrote {TRAIN_FILE} ({len(train_words)} pairs) and {HELD_OUT_FILE} ({len(held_out_words)} pairs)")


if __name__ == "__main__":
    main()
