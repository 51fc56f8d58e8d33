"""The model card (README.md) of an export: what it is, how it was made and checked, how to load it.

Pure text from the run's config, its events (``run_started`` for the data
counts, ``step``/``eval`` for the losses, ``evaluation`` for base vs fine-tuned, ``estimate``/``memory_measured`` for
memory) and the export's record. The YAML metadata block at the top is the Hub's
model card metadata: ``base_model`` and ``datasets`` only when they are Hub ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from studio.core.choices import OBJECTIVE_WORDS
from studio.core.config import RunConfig
from studio.core.data.hub import hub_dataset_id
from studio.core.methods import RANK
from studio.core.run.evaluation import benchmark_rows, comparison_rows, held_out_words
from studio.core.sizes import format_bytes

CARD_FILE = "README.md"
_PEFT_LOAD = """```python
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer, GenerationConfig

model = AutoPeftModelForCausalLM.from_pretrained("{path}")  # loads the base model, then this adapter
tokenizer = AutoTokenizer.from_pretrained("{path}")  # the chat template and end of turn it was trained with
model.generation_config = GenerationConfig.from_pretrained("{path}")  # stops at that end of turn
```"""
_TRANSFORMERS_LOAD = """```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{path}")
tokenizer = AutoTokenizer.from_pretrained("{path}")
```"""
_GENERATE = """```python
messages = [{"role": "user", "content": "your question"}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
answer = model.generate(**inputs, max_new_tokens=128)[0, inputs["input_ids"].shape[1]:]
print(tokenizer.decode(answer, skip_special_tokens=True))  # stops at the end of turn it was trained on
```"""


def front_matter(readme: str) -> dict[str, Any]:
    """The YAML metadata block at the top of a model card ({} when it has none or it is broken)."""
    if not readme.startswith("---"):
        return {}
    block = readme[3:].split("\n---", 1)[0]
    try:
        meta = yaml.safe_load(block)
    except yaml.YAMLError:
        return {}
    return meta if isinstance(meta, dict) else {}


def is_hub_id(name: str) -> bool:
    """``owner/name`` that is not a folder on this machine."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).exists()


def model_card(config: RunConfig, events: list[dict[str, Any]], record: dict[str, Any], license_: str = "",
               load_path: str = "PATH/TO/THIS/FOLDER") -> str:
    """The README.md of an export. ``record`` is its studio_export.json; ``load_path`` is what the load
    examples name (a Hub repo id once pushed)."""
    adapter = record["kind"] == "adapter"
    sections = [
        _metadata(config, record["kind"], license_),
        f"# {config.name}\n\n{_summary(config, record)}",
        _training(config, events),
        _data(config, events),
        _results(events),
        _evaluation(events),
        _benchmarks(events),
        _gguf_verification(record) if record["kind"] == "gguf" else _verification(record),
        _memory(events),
        _chat(record),
        _gguf_usage(record, load_path) if record["kind"] == "gguf" else _usage(adapter, load_path),
    ]
    return "\n\n".join(section for section in sections if section) + "\n"


def _metadata(config: RunConfig, kind: str, license_: str) -> str:
    adapter = kind == "adapter"
    base = config.model.name_or_path
    meta: dict[str, Any] = {}
    if is_hub_id(base):
        meta["base_model"] = base
    if license_:
        meta["license"] = license_
    meta["library_name"] = {"adapter": "peft", "gguf": "gguf"}.get(kind, "transformers")
    meta["pipeline_tag"] = "text-generation"
    meta["tags"] = ["finetune-studio", config.method] + ([config.objective] if config.learns_preferences else []) + (["gguf"] if kind == "gguf" else []) + (["base_model:adapter:" + base] if adapter and is_hub_id(base) else [])
    datasets = [hub_dataset_id(name) for name in config.data.train_files + config.data.eval_files]
    if any(datasets):
        meta["datasets"] = sorted({name for name in datasets if name})
    return "---\n" + yaml.safe_dump(meta, sort_keys=False).strip() + "\n---"


def _summary(config: RunConfig, record: dict[str, Any]) -> str:
    revision = f" (revision `{config.model.revision}`)" if config.model.revision else ""
    what = {"adapter": "An adapter", "gguf": "GGUF files (llama.cpp, Ollama, LM Studio) of a merged model"}.get(
        record["kind"], "A merged model")
    details = (record.get("form", "") if record["kind"] == "gguf" else f"{record.get('dtype')} weights"
               + (f"; {record.get('form')}" if config.qat.enabled else ""))
    taught = f", objective `{config.objective}` (learning from preference pairs)" if config.learns_preferences else ""
    return (f"{what} ({details}) fine-tuned with "
            f"Finetune Studio from `{config.model.name_or_path}`{revision} by method `{config.method}` "
            f"({config.method_spec.label}){taught}.")


def _table(rows: list[tuple[str, Any]], head: tuple[str, str] = ("setting", "value")) -> str:
    lines = [f"| {head[0]} | {head[1]} |", "|---|---|"]
    return "\n".join(lines + [f"| {key} | {value} |" for key, value in rows])


def _training(config: RunConfig, events: list[dict[str, Any]]) -> str:
    training = config.training
    rows: list[tuple[str, Any]] = [("objective", objective_words(config)), ("method", config.method)]
    if RANK in config.method_spec.settings:
        lora = config.lora
        rows += [("LoRA rank / alpha / dropout", f"{lora.r} / {lora.alpha:g} / {lora.dropout:g}"),
                 ("target modules", ", ".join(lora.target_modules))]
    if config.effective_load_in != "none":
        rows.append(("base weights", f"{config.effective_load_in} ({config.quantization.quant_type})"))
    started = _last(events, "run_started")
    rows += [("learning rate", f"{training.learning_rate:g} ({training.lr_scheduler}, warmup {training.warmup_ratio:g})"),
             ("optimizer", training.optimizer), ("precision", training.precision),
             ("micro-batch x accumulation", f"{training.micro_batch_size} x {training.gradient_accumulation_steps}"),
             ("max length", config.data.max_length), ("seed", training.seed)]
    if started:
        rows += [("planned steps", started.get("total_steps")),
                 ("trainable parameters", f"{started.get('trainable_params', 0):,} of {started.get('total_params', 0):,}")]
    return "## Training\n\n" + _table(rows)


def objective_words(config: RunConfig) -> str:
    """The objective by its label, with the settings it trained with: "DPO (sigmoid loss, beta 0.1, ...)"."""
    settings = config.preference
    cross_entropy = f", chosen cross-entropy weight {settings.sft_weight:g}" if settings.sft_weight else ""
    details = {"dpo": f"{settings.dpo_loss} loss, beta {settings.beta:g}, reference {settings.reference}{cross_entropy}",
               "simpo": f"beta {settings.beta:g}, gamma {settings.simpo_gamma:g}{cross_entropy}",
               "orpo": f"odds-ratio weight (beta) {settings.beta:g}"}.get(config.objective)
    label = OBJECTIVE_WORDS.get(config.objective, (config.objective,))[0]
    return f"{label} ({details})" if details else label


def _data(config: RunConfig, events: list[dict[str, Any]]) -> str:
    files = "\n".join(f"- `{name}`" for name in config.data.train_files)
    evals = "\n".join(f"- `{name}` (eval)" for name in config.data.eval_files)
    stats = (_last(events, "run_started") or {}).get("data", {})
    rows = [(split, f"{s['rows']:,} | {s['tokens']:,} | {s['target_tokens']:,} | {s['format']} | {s['template']}")
            for split, s in stats.items()]
    table = "\n".join(["| split | rows | tokens | trained tokens | format | template |", "|---|---|---|---|---|---|"]
                      + [f"| {split} | {cells} |" for split, cells in rows])
    return "## Data\n\n" + "\n".join(part for part in (files, evals) if part) + ("\n\n" + table if rows else "")


def _results(events: list[dict[str, Any]]) -> str:
    step = _last(events, "step")
    evaluation = _last(events, "eval", "eval_loss")
    rows = [("steps trained", step["step"] if step else 0)]
    if step:
        rows.append(("final train loss", f"{step['loss']:.4f}"))
    if evaluation:
        rows.append(("final eval loss", f"{evaluation['eval_loss']:.4f} (step {evaluation['step']})"))
    if evaluation and "eval_rewards/accuracies" in evaluation:  # a preference objective's held-out pairs
        rows.append(("final eval reward accuracy", f"{evaluation['eval_rewards/accuracies']:.1%}"))
    return "## Results\n\n" + _table(rows, ("", ""))


def _evaluation(events: list[dict[str, Any]]) -> str:
    """The newest `studio eval`: base and fine-tuned side by side on the held-out rows."""
    found = _last(events, "evaluation")
    if not found:
        return ""
    lines = ["| measure | base | fine-tuned | change |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(cells)} |" for cells in comparison_rows(found)]
    where = ", ".join(f"`{Path(name).name}`" for name in found["data"])
    return (f"## Evaluation\n\nOn {held_out_words(found['tuned'])} ({where}), checkpoint "
            f"`{found['checkpoint']}`:\n\n" + "\n".join(lines))


def _benchmarks(events: list[dict[str, Any]]) -> str:
    """The newest `studio eval --tasks`: lm-evaluation-harness's metrics, base and fine-tuned."""
    found = _last(events, "benchmarks")
    if not found:
        return ""
    lines = ["| task | metric | base | fine-tuned |", "|---|---|---|---|"]
    lines += [f"| {task} | {metric} | {base} | {tuned} |" for task, metric, base, tuned in benchmark_rows(found)]
    limit = f", at most {found['limit']} examples per task" if found.get("limit") else ""
    return (f"## Benchmarks\n\nlm-evaluation-harness, checkpoint `{found['checkpoint']}`{limit}:\n\n"
            + "\n".join(lines))


def _verification(record: dict[str, Any]) -> str:
    check = record.get("verification")
    if not check:
        return ""
    verdict = "passed" if check["passed"] else "FAILED"
    base = (f"; the untrained base differs by {check['base_max_abs_diff']:.3g}"
            if check.get("base_max_abs_diff") is not None else "")
    return (f"## Verification\n\nThis export was loaded back with the plain libraries and its logits compared "
            f"with the trained model's on {check['samples']} training examples: {verdict}, max logit "
            f"difference {check['max_abs_diff']:.3g}, next-token agreement {check['top1_agreement']:.1%}{base}.")


def _memory(events: list[dict[str, Any]]) -> str:
    estimate = _last(events, "estimate")
    measured = [event for event in events if event["type"] == "memory_measured"]
    rows = []
    if estimate and estimate.get("peak_bytes"):
        rows.append(("estimated peak", f"{format_bytes(estimate['peak_bytes'])} ({estimate.get('peak_phase', '')})"))
    rows += [(f"measured peak, {event.get('device', '')}", format_bytes(event["peak_bytes"])) for event in measured]
    return "## Memory\n\n" + _table(rows, ("", "")) if rows else ""


def _chat(record: dict[str, Any]) -> str:
    chat = record.get("chat")
    if not chat or chat["template"] == "none":
        return ""
    end = (f"ends each response with `{chat['end_of_turn']}`, the tokenizer's eos and generation_config.json's "
           f"`eos_token_id` {list(chat['eos_token_ids'])}, so generation stops there" if chat["end_of_turn"]
           else "ends responses with several tokens: stop generation on its end marker yourself")
    name = "the base tokenizer's own" if chat["template"] == "tokenizer" else f"the built-in `{chat['template']}`"
    carrier = ("each GGUF carries (`tokenizer.chat_template`, its end of turn as eos)" if record["kind"] == "gguf"
               else "the tokenizer here carries (`tokenizer.apply_chat_template`)")
    return f"## Chat template\n\nTrained with {name} chat template, which {carrier}. The model {end}."


def _usage(adapter: bool, path: str) -> str:
    load = (_PEFT_LOAD if adapter else _TRANSFORMERS_LOAD).format(path=path)
    gguf = ("llama.cpp, Ollama and LM Studio read GGUF files: export them with `studio export RUN --gguf` "
            "(or the app's Export tab).")
    return f"## How to use\n\n{load}\n\n{_GENERATE}\n\n{gguf}"


def _gguf_verification(record: dict[str, Any]) -> str:
    rows = [(f"`{f['file']}`", f"{f['bytes'] / 1e6:.1f} MB | {f['verification']['top1_agreement']:.1%} | "
                               f"{f['verification']['max_abs_diff']:.3g}") for f in record["files"].values()]
    table = "\n".join(["| file | size | same next token | max logit difference |", "|---|---|---|---|"]
                      + [f"| {name} | {cells} |" for name, cells in rows])
    samples = next(iter(record["files"].values()))["verification"]["samples"]
    return (f"## Verification\n\nConverted by llama.cpp's own converter ({record.get('converter', '')}). Each file "
            f"was read back by transformers' GGUF reader and its next-token choices compared with the merged "
            f"model's on {samples} held-out examples; every file passed its type's threshold.\n\n{table}"
            + _llama_cpp_check(record))


def _llama_cpp_check(record: dict[str, Any]) -> str:
    checks = [(f["file"], f["llama_cpp_verification"]) for f in record["files"].values() if "llama_cpp_verification" in f]
    return ("\n\nRun by llama.cpp itself: " + "; ".join(f"`{name}` {check['top1_agreement']:.1%} the same next token"
                                                       for name, check in checks) + ".") if checks else ""


def _gguf_usage(record: dict[str, Any], path: str) -> str:
    quant, first = next(iter(record["files"].items()))
    name, modelfile = first["file"], first["modelfile"]["file"]
    if is_hub_id(path):  # published: both read a GGUF straight from the Hub by its type
        get = (f"```bash\nllama-cli -hf {path}:{quant.upper()} -cnv\nollama run hf.co/{path}:{quant.upper()}\n```\n\n"
               f"Or download the folder (`hf download {path} --local-dir {path.split('/')[1]}`) and use it as below.\n\n")
        path = path.split("/")[1]
    else:
        get = ""
    return (f"## How to use\n\n{get}llama.cpp (the chat template and end of turn are inside the file):\n\n```bash\n"
            f"llama-cli -m {name} -cnv\nllama-server -m {name}\n```\n\nOllama, with the Modelfile beside each "
            f"file (its template, stop tokens and defaults):\n\n```bash\ncd {path}\n"
            f"ollama create my-fine-tune -f {modelfile}\nollama run my-fine-tune\n```\n\n"
            f"LM Studio: `lms import {name}` (or copy the file into its models folder), then load it.")


def _last(events: list[dict[str, Any]], kind: str, key: str = "type") -> dict[str, Any] | None:
    """The newest event of ``kind`` that has ``key``."""
    return next((event for event in reversed(events) if event["type"] == kind and key in event), None)
