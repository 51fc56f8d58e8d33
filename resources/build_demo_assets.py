"""Build the embedded demo model and datasets of Finetune Studio.

    python resources/build_demo_assets.py      # about 3 minutes on 2 CPU cores

writes ``resources/models/studio-tiny/`` (a ~1 M parameter Llama with its own
byte-level BPE tokenizer and a ChatML chat template), the demo task in every
dataset format under ``resources/datasets/`` and the preference demo's pairs
(``build_preference_pairs.py``).

The story the demo tells: the model learns facts during pretraining ("a plum is a
kind of fruit .") but has never been asked a question. The demo fine-tune teaches
it to answer "What kind of thing is a plum?" with "a kind of fruit". The held-out
words appear in the pretraining facts but never in the fine-tuning rows, so a
correct held-out answer shows that the adapter connected the question format to
knowledge the base model already had — instruction tuning in miniature. The base
model answers none of them (it has never seen the chat format); after a minute of
LoRA training it answers nearly all.

Everything is seeded; a rerun with the same library versions reproduces the files.
"""

from __future__ import annotations

import csv
import json
import math
import random
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "models" / "studio-tiny"
DATA_DIR = HERE / "datasets"
SEED = 7
HELD_OUT_WORDS = 80

CATEGORIES = {
    "fruit": "apple banana cherry grape lemon mango melon orange peach pear plum kiwi lime apricot fig papaya guava coconut berry date",
    "animal": "cat dog horse cow sheep goat lion tiger bear wolf fox rabbit mouse deer zebra monkey camel otter panda whale",
    "color": "red blue green yellow purple pink brown black white gray violet indigo crimson amber beige teal navy maroon olive ivory",
    "tool": "hammer saw drill wrench spade rake shovel chisel pliers axe screwdriver ladder file clamp trowel sickle mallet level ruler hoe",
    "vehicle": "car bus truck train bike boat ship plane tram van taxi scooter tractor yacht canoe jet wagon sled rocket ferry",
    "drink": "tea coffee milk juice water soda cocoa wine beer cider lemonade smoothie espresso latte broth punch tonic kefir mocha shake",
    "instrument": "piano guitar violin drum flute harp cello trumpet banjo organ tuba oboe clarinet bugle lute sitar ukulele viola horn bell",
    "body part": "arm leg hand foot head knee elbow nose ear eye neck chin toe finger thumb wrist ankle shoulder hip lip",
}
SPECIAL_TOKENS = ["<pad>", "<s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODEL_SHAPE = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256}
PRETRAIN = {"documents": 30000, "steps": 800, "batch": 64, "learning_rate": 3e-3}


def with_article(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def question(word: str) -> str:
    return f"What kind of thing is {with_article(word)}?"


def answer(category: str) -> str:
    return f"a kind of {category}"


def split_words(rng: random.Random) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(training words, held-out words): every word with its category."""
    words = [(word, category) for category, names in CATEGORIES.items() for word in names.split()]
    rng.shuffle(words)
    return words[HELD_OUT_WORDS:], words[:HELD_OUT_WORDS]


def fact(rng: random.Random, word: str, category: str) -> str:
    return rng.choice([f"{with_article(word)} is a kind of {category} .", f"the {word} is a {category} .",
                       f"{with_article(word)} is a {category} .", f"i think the {word} is a {category} ."])


def pretraining_corpus(rng: random.Random, words: list[tuple[str, str]]) -> list[str]:
    """Facts about every word (held-out ones included) and filler sentences; no questions."""
    documents = []
    for _ in range(PRETRAIN["documents"]):
        if rng.random() < 0.6:
            documents.append(fact(rng, *rng.choice(words)))
        else:
            (first, _), (second, _) = rng.sample(words, 2)
            documents.append(f"i see the {first} and the {second} .")
    return documents


def train_tokenizer(corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    chat_words = ["What kind of thing is an ? Q: A: system user assistant You are a helpful assistant ."] * 50
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus + chat_words, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def pretrain(corpus: list[str], tokenizer, rng: random.Random):
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS}
    config = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, pad_token_id=ids["<pad>"],
                         bos_token_id=ids["<s>"], eos_token_id=ids["<|im_end|>"], **MODEL_SHAPE)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    rows = [[ids["<s>"], *tokenizer(text)["input_ids"], ids["<|im_end|>"]] for text in corpus]
    steps, batch = PRETRAIN["steps"], PRETRAIN["batch"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=PRETRAIN["learning_rate"])
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 30) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    started = time.time()
    for step in range(steps):
        chosen = rng.sample(rows, batch)
        width = max(map(len, chosen))
        input_ids = torch.tensor([row + [ids["<pad>"]] * (width - len(row)) for row in chosen])
        mask = input_ids != ids["<pad>"]
        loss = model(input_ids=input_ids, attention_mask=mask.long(), labels=input_ids.masked_fill(~mask, -100)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 100 == 0 or step == steps - 1:
            print(f"pretraining step {step:4d}  loss {loss.item():.3f}  {time.time() - started:.0f} s", flush=True)
    return model.eval()


def write_datasets(train_words, held_out_words, corpus: list[str]) -> None:
    """The demo task in every format the studio reads, plus plain text for the text format."""
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    alpaca = [{"instruction": question(w), "input": "", "output": answer(c)} for w, c in train_words]
    _write_jsonl(DATA_DIR / "categories_instruction.jsonl", alpaca)
    _write_jsonl(DATA_DIR / "categories_heldout.jsonl",
                 [{"instruction": question(w), "input": "", "output": answer(c)} for w, c in held_out_words])
    _write_jsonl(DATA_DIR / "categories_chat.jsonl", [
        {"messages": [{"role": "user", "content": question(w)}, {"role": "assistant", "content": answer(c)}]}
        for w, c in train_words])
    sharegpt = [{"conversations": [{"from": "human", "value": question(w)}, {"from": "gpt", "value": answer(c)}]}
                for w, c in train_words]
    (DATA_DIR / "categories_sharegpt.json").write_text(json.dumps(sharegpt, indent=1) + "\n", encoding="utf-8")
    pairs = [{"prompt": f"Q: {question(w)}\nA:", "completion": " " + answer(c)} for w, c in train_words]
    with open(DATA_DIR / "categories_prompt_completion.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["prompt", "completion"])
        writer.writeheader()
        writer.writerows(pairs)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(pairs), DATA_DIR / "categories_prompt_completion.parquet")
    (DATA_DIR / "facts.txt").write_text("\n".join(corpus[:400]) + "\n", encoding="utf-8")


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


@torch.no_grad()
def check_base_model(model, tokenizer, held_out_words) -> None:
    """The base model must know the facts but fail the question format."""
    def greedy(prompt: str) -> str:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()

    knows = sum(greedy(f"<s>the {w} is a").startswith(c) for w, c in held_out_words)
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": question(w)}], tokenize=False,
                                          add_generation_prompt=True) for w, _ in held_out_words]
    answers = sum(greedy(prompt) == answer(c) for prompt, (_, c) in zip(chat, held_out_words))
    print(f"base model: completes held-out facts {knows}/{len(held_out_words)}, "
          f"answers held-out questions {answers}/{len(held_out_words)}")


def main() -> None:
    torch.set_num_threads(1)  # tiny matrices: one thread is as fast, and never slowed by a busy machine
    rng = random.Random(SEED)
    train_words, held_out_words = split_words(rng)
    corpus = pretraining_corpus(rng, train_words + held_out_words)
    tokenizer = train_tokenizer(corpus)
    model = pretrain(corpus, tokenizer, rng)
    check_base_model(model, tokenizer, held_out_words)
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(MODEL_DIR, safe_serialization=True)
    tokenizer.save_pretrained(MODEL_DIR)
    write_datasets(train_words, held_out_words, corpus)
    import build_preference_pairs  # beside this file (it imports this one: so here, once this one is loaded)

    build_preference_pairs.main()  # the preference demo's pairs of the same words
    print(f"wrote {MODEL_DIR} ({sum(p.numel() for p in model.parameters()):,} parameters) and {DATA_DIR}")


if __name__ == "__main__":
    main()
