"""From data files to tokenized ``datasets.Dataset`` splits with loss masks.

Every example is rendered into segments ``(text, trainable)`` (see
studio.core.data.templates), each segment is tokenized on its own and the ids are
concatenated. Tokenizing the pieces separately means the prompt tokens in
training are exactly the tokens ``encode_prompt`` gives for generation, and the
loss mask follows the segment borders without character offsets.

Labels are the input ids where the text is trainable and -100 elsewhere (the
model shifts them by one position itself). Files are validated by
studio.core.data.dataset first, so bad data is refused before any tokenizing.

Preference pairs are tokenized as TRL's DPOTrainer tokenizes them, so that a pair trains on TRL's very tokens:
the prompt (rendered with the generation prompt, for conversational rows) and prompt+response are tokenized whole,
and the response starts where the two part (a template or a merge across the border may change the prompt's last
tokens). Each of prompt+chosen and prompt+rejected is then cut to max_length keeping its start (TRL's keep_start:
the prompt is kept, the response's end is cut), and a pair whose prompt alone fills max_length is left out, as TRL
leaves it out. A pair's row holds input_ids/labels (prompt+chosen) and rejected_input_ids/rejected_labels.

Unpaired preference rows (KTO's) are tokenized the same way, with their one completion: input_ids/labels, the
completion's tokens (``completion_ids``, as many as max_length) and its ``label``. For KTO's KL term each row also
carries a mismatched completion (``kl_completion_ids``): that of the row before it in its group of micro_batch_size
rows, in the split's order (the group's first takes its last), as TRL's KTOTrainer pairs them.

Prompt-only rows (GRPO's) are their prompt alone, tokenized as a preference row's prompt (conversational ones with
the generation prompt), beside the row as read (``row``, JSON: the rewards read its columns) and where it is
(``location``). A prompt leaves room for its completion: one longer than data.max_length minus
grpo.max_completion_length is left out, named.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import torch

from studio.core.config import RunConfig
from studio.core.data import templates
from studio.core.data.dataset import (MAX_PROBLEMS, SHOWN_ROWS, RowStart, beyond_max_length_problems,
                                      beyond_max_length_warning, inspect_files, iter_examples)
from studio.core.data.row_formats import DataError, Example
from studio.core.data.templates import Segment
from studio.core.errors import Problem, ProblemsError, StudioError
from studio.core.model.vision import SUPPORTED_VISION
from studio.train.data.images import (IMAGE_COLUMN, IMAGE_COLUMN_TYPES, NO_IMAGES, REJECTED_IMAGE_COLUMN, ImageInputs,
                                      ImageRows, image_batch, npz_bytes)

if TYPE_CHECKING:  # imported where a split is made or loaded: importing this module needs no datasets
    import datasets

IGNORE_INDEX = -100
_COLUMNS = ("input_ids", "labels")
PREFERENCE_COLUMNS = {  # the columns of each preference row format (beside input_ids and labels)
    "preference": ("rejected_input_ids", "rejected_labels"),
    "unpaired_preference": ("completion_ids", "label"),
}
IMAGE_COLUMNS = {"preference": (IMAGE_COLUMN, REJECTED_IMAGE_COLUMN)}
"""The image columns of a row format whose rows hold several sequences (the others: ``IMAGE_COLUMN``)."""
PROMPT_COLUMNS = ("input_ids", "row", "location")
"""A prompt-only row's columns: its prompt's ids, the row as read (JSON) and where it is."""
_BATCH_ROWS = 1000
_COLUMN_TYPES = {"label": pa.bool_(), "row": pa.string(), "location": pa.string(),
                 **IMAGE_COLUMN_TYPES}  # the others: token ids


@dataclass
class PreparedData:
    """The tokenized splits (columns input_ids and labels) and what went into them.

    ``stats`` maps "train" (and "eval" when there is one) to: rows (kept),
    tokens (input tokens after truncation), target_tokens (tokens with a
    label), truncated (kept rows cut at max_length), dropped (rows whose
    response lay wholly beyond max_length), unlearned (rows none of whose turns is learned), format and template.
    """

    train: datasets.Dataset
    eval: datasets.Dataset | None
    """None without eval data, or when every eval row was dropped (stats["eval"] still says so)."""
    stats: dict[str, dict[str, Any]]
    warnings: tuple[tuple[str, str], ...] = ()
    """(message, hint) for the run to show: the rows dropped, named (not kept by save_prepared)."""


# ---------------------------------------------------------------- rendering


def resolve_template(template: str, tokenizer: Any) -> str:
    """"tokenizer" or a built-in template name: auto picks the tokenizer's own when it has one."""
    has_own = bool(getattr(tokenizer, "chat_template", None))
    if template == "auto":
        return "tokenizer" if has_own else "chatml"
    if template == "tokenizer" and not has_own:
        raise StudioError("data.template is tokenizer, but the tokenizer has no chat template",
                          "set data.template to auto, chatml or alpaca", kind="data")
    return template


def render_segments(example: Example, tokenizer: Any, template: str,
                    learning: templates.Learning = templates.Learning()) -> list[Segment]:
    """The example as (text, trainable) segments.

    Instruction and chat rows go through the template (with their tools), the assistant text ``learning`` names
    trainable; prompt_completion rows are the prompt then the completion with eos; text rows are wholly
    trainable text with eos; a preference pair as its chosen answer. Raises DataError naming the example's location.
    """
    if example.kind == "preference":
        return render_segments(example.chosen_row(), tokenizer, template, learning)
    eos = tokenizer.eos_token or ""
    if example.kind == "prompt_completion":
        return [(example.prompt, False), (example.completion + eos, True)]
    if example.kind == "text":
        return [(example.text + eos, True)]
    try:
        name = resolve_template(template, tokenizer)
        if name == "tokenizer":
            return templates.split_rendered_chat(example.messages, example.tools, partial(_apply_template, tokenizer),
                                                 learning)
        return templates.render(name, example.messages, eos, example.tools, learning)
    except DataError as exc:
        raise exc.at(example.location) from None


def _apply_template(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict],
                    generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(list(messages), tools=list(tools) or None, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as exc:  # jinja raises anything the template author wrote
        raise DataError("", f"the tokenizer's chat template failed: {exc}", templates.TEMPLATE_HINT) from None


# ---------------------------------------------------------------- tokenizing


def adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer puts its bos token before a text (Llama: yes; GPT-2, Qwen: no).

    Asking the tokenizer itself respects its config instead of guessing from
    the mere presence of a bos token.
    """
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


def encode(segments: Sequence[Segment | tuple[list[int], bool]], tokenizer: Any, max_length: int,
           train_on_prompt: bool = False, add_bos: bool | None = None) -> dict[str, Any]:
    """Token ids, labels, whether the example was cut at ``max_length`` (right truncation), where its
    first learned token was before the cut (``response_start``; the length when none is) and whether it has one
    (``learns``: not when every turn is marked train: false).

    A bos token is prepended when the tokenizer adds one (``add_bos``; None:
    ask it) and the text does not start with it already (a template wrote it). A segment may come tokenized
    (its ids instead of its text: an image's tokens, ``ImageRows.expand``): never learned, even with train_on_prompt.
    """
    texts = [text for text, _ in segments if isinstance(text, str)]
    tokenized = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    if add_bos is None:
        add_bos = adds_bos(tokenizer)
    first = next((text for text in texts if text), "")
    ids: list[int] = []
    labels: list[int] = []
    if add_bos and not first.startswith(tokenizer.bos_token):
        ids.append(tokenizer.bos_token_id)
        labels.append(tokenizer.bos_token_id if train_on_prompt else IGNORE_INDEX)
    for text, trainable in segments:
        piece = next(tokenized) if isinstance(text, str) else text
        ids += piece
        learned = trainable or (train_on_prompt and isinstance(text, str))
        labels += piece if learned else [IGNORE_INDEX] * len(piece)
    response_start = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
    return {"input_ids": ids[:max_length], "labels": labels[:max_length], "truncated": len(ids) > max_length,
            "response_start": response_start, "learns": response_start < len(labels)}


def encode_prompt(example: Example, tokenizer: Any, template: str) -> tuple[list[int], str]:
    """The tokens before the last response, exactly as in training, and that response's text.

    For generation-based evaluation: the model continues the prompt ids and
    its answer is compared to the expected response (without end marker): a pair's chosen one.
    """
    ids, _, expected = encode_image_prompt(example, tokenizer, template, None)
    return ids, expected


def encode_image_prompt(example: Example, tokenizer: Any, template: str,
                        image_rows: ImageRows | None) -> tuple[list[int], dict[str, bytes], str]:
    """``encode_prompt``'s ids and response, with the row's images as the model takes them (a split row's image
    column: empty for a row without): a row with images through ``image_rows``, its placeholders expanded as
    training expands them (refused without: a text model's)."""
    if example.kind == "preference":
        example = example.chosen_row()
    if example.kind == "prompt_only":
        return _whole_ids(prompt_only_text(example, tokenizer, template), tokenizer, adds_bos(tokenizer)), \
            NO_IMAGES, example.reference
    if example.kind == "text":
        raise DataError(example.location, "text rows have no prompt to answer",
                        "evaluate with instruction, chat or prompt_completion rows")
    if example.images and image_rows is None:
        raise DataError(example.location, f"the prompt holds {len(example.images)} image(s), but the model is a text "
                        "model", f"choose a run of a vision-language model ({', '.join(SUPPORTED_VISION)}), or ask "
                        "in words")
    prompt = templates.prompt_segments(render_segments(example, tokenizer, template, templates.PROMPTING))
    expected = example.messages[-1]["content"] if example.messages else example.completion
    if not example.images:
        return encode(prompt, tokenizer, sys.maxsize)["input_ids"], NO_IMAGES, expected
    expanded, inputs = image_rows.expand(prompt, example)
    encoded = image_rows.masked(encode(expanded, tokenizer, sys.maxsize), inputs, sys.maxsize, example.location)
    return encoded["input_ids"], {IMAGE_COLUMN: encoded[IMAGE_COLUMN]}, expected


def encode_preference(example: Example, tokenizer: Any, template: str, max_length: int,
                      add_bos: bool | None = None, image_rows: ImageRows | None = None) -> dict[str, Any]:
    """A preference row's sequences (the module docstring says how, as TRL), each cut to ``max_length``: a pair's
    two, or an unpaired row's one with its ``completion_ids`` and ``label``; ``response_start`` is the prompt's
    length (the row is dropped when it is max_length or more). A pair whose prompt holds images carries them
    through ``image_rows`` as a chat row does, its placeholders expanded alike in all three texts: the images'
    inputs and the chosen sequence's per-token ones in ``IMAGE_COLUMN``, the rejected one's in
    ``REJECTED_IMAGE_COLUMN``; refused when max_length cuts into the images."""
    if add_bos is None:
        add_bos = adds_bos(tokenizer)
    (prompt_ids, *sequence_ids), inputs = _preference_ids(example, tokenizer, template, add_bos, image_rows)
    if inputs is not None:
        along = [image_rows.token_inputs(ids[:max_length], inputs, max_length, example.location)
                 for ids in sequence_ids]
    start = min(_common_prefix(prompt_ids, ids) for ids in sequence_ids)
    if start >= max_length:  # nothing of the responses would be left: TRL drops the row
        return {"input_ids": [], "labels": [], "truncated": True, "response_start": start}
    encoded: dict[str, Any] = {"truncated": max(map(len, sequence_ids)) > max_length, "response_start": start}
    for prefix, ids in zip(("", "rejected_"), sequence_ids):
        encoded[f"{prefix}input_ids"] = ids[:max_length]
        encoded[f"{prefix}labels"] = ([IGNORE_INDEX] * start + ids[start:])[:max_length]
    if example.kind == "unpaired_preference":  # as much of the completion as another row's prompt may take (KTO's KL)
        encoded["completion_ids"] = sequence_ids[0][start:start + max_length]
        encoded["label"] = example.label
    if inputs is not None:
        encoded[IMAGE_COLUMN] = npz_bytes({**inputs.arrays, **along[0]})
        encoded[REJECTED_IMAGE_COLUMN] = npz_bytes(along[1])
    return encoded


def _preference_ids(example: Example, tokenizer: Any, template: str, add_bos: bool,
                    image_rows: ImageRows | None) -> tuple[list[list[int]], ImageInputs | None]:
    """The ids of a preference row's prompt, then of its sequences, each tokenized whole; a pair with images: each
    of its texts with the image placeholders expanded to the images' tokens (the images processed once), and the
    images' inputs (None without images)."""
    texts = _preference_texts(example, tokenizer, template)
    if not example.images:
        return [_whole_ids(text, tokenizer, add_bos) for text in texts], None
    renderings, inputs = _vision(example, image_rows).expand_renderings([[(text, False)] for text in texts], example)
    return [encode(rendering, tokenizer, sys.maxsize, add_bos=add_bos)["input_ids"] for rendering in renderings], \
        inputs


def _vision(example: Example, image_rows: ImageRows | None) -> ImageRows:
    """What expands a row's images; refused for a text model's run (``image_rows`` None)."""
    if image_rows is None:
        raise DataError(example.location, f"the row holds {len(example.images)} image(s), but the model is a text "
                        f"model", f"choose a vision-language model ({', '.join(SUPPORTED_VISION)}) or remove the "
                        "images")
    return image_rows


def _preference_texts(example: Example, tokenizer: Any, template: str) -> list[str]:
    """The prompt, then the prompt and each response (chosen, rejected; or the completion) as text: plain ones with
    eos after each response (if it lacks one), conversational ones through the chat template."""
    if not example.conversational:
        eos = tokenizer.eos_token or ""
        return [example.prompt] + [example.prompt + (text if text.endswith(eos) else text + eos)
                                   for text in example.responses]
    def chat(turns: tuple) -> Example:
        return Example("chat", messages=example.messages + turns, location=example.location, tools=example.tools)

    rendered = [render_segments(chat(response), tokenizer, template) for response in example.responses]
    first_response = render_segments(chat(example.responses[0][:1]), tokenizer, template, templates.PROMPTING)
    prompt = "".join(text for text, _ in templates.prompt_segments(first_response))
    return [prompt] + ["".join(text for text, _ in segments) for segments in rendered]


def prompt_only_text(example: Example, tokenizer: Any, template: str) -> str:
    """A prompt-only row's prompt as its completion will follow it: the text, or the turns through the chat
    template with the assistant's turn opened (as a preference row's prompt)."""
    if not example.messages:
        return example.prompt
    answered = Example("chat", messages=example.messages + ({"role": "assistant", "content": ""},),
                       location=example.location, tools=example.tools)
    return "".join(text for text, _ in templates.prompt_segments(render_segments(answered, tokenizer, template,
                                                                                 templates.PROMPTING)))


def encode_prompt_only(example: Example, tokenizer: Any, template: str, max_prompt: int,
                       add_bos: bool) -> dict[str, Any]:
    """A prompt-only row: its prompt's ids (none when it is longer than ``max_prompt``: the row is left out), the row
    as read and where it is."""
    ids = _whole_ids(prompt_only_text(example, tokenizer, template), tokenizer, add_bos)
    return {"input_ids": ids if len(ids) <= max_prompt else [], "row": json.dumps(example.row, default=str),
            "location": example.location, "truncated": False, "response_start": len(ids)}


def _whole_ids(text: str, tokenizer: Any, add_bos: bool) -> list[int]:
    """``text`` tokenized in one piece, with the bos token the tokenizer adds (unless the text starts with it)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [tokenizer.bos_token_id, *ids] if add_bos and not text.startswith(tokenizer.bos_token) else ids


def _common_prefix(ids: list[int], other: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ids, other)) if a != b), min(len(ids), len(other)))


def collate(features: list[dict[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """A right-padded batch: input_ids (pad id), labels (-100) and attention_mask; the rows' images, if any."""
    rows = [as_token_list(f["input_ids"]) for f in features]
    labels = [as_token_list(f["labels"]) for f in features]
    width = max(len(row) for row in rows)

    def pad(values: list[list[int]], fill: int) -> torch.Tensor:
        return torch.tensor([v + [fill] * (width - len(v)) for v in values], dtype=torch.long)

    return {"input_ids": pad(rows, pad_token_id), "labels": pad(labels, IGNORE_INDEX),
            "attention_mask": pad([[1] * len(row) for row in rows], 0), **image_batch(features, width)}


def as_token_list(values: Any) -> list[int]:
    """A row's token ids as a plain list, whether the dataset gave a tensor or a sequence."""
    return values.tolist() if hasattr(values, "tolist") else list(values)


# ---------------------------------------------------------------- whole splits


class _SplitBuilder:
    """Collects encoded rows of one split into Arrow batches and counts them."""

    def __init__(self, fmt: str, template: str, kl_group: int, images: bool = False):
        self.kl_group = kl_group  # unpaired rows: the groups whose completions are mismatched (KTO's KL term)
        self.stats: dict[str, Any] = {"rows": 0, "tokens": 0, "target_tokens": 0, "truncated": 0,
                                      "dropped": 0, "unlearned": 0, "format": fmt, "template": template}
        self.prompts_only = fmt == "prompt_only"
        self.columns = PROMPT_COLUMNS if self.prompts_only else (*_COLUMNS, *PREFERENCE_COLUMNS.get(fmt, ()),
                                                                 *(image_columns(fmt) if images else ()))
        self._schema = pa.schema([(name, _COLUMN_TYPES.get(name, pa.list_(pa.int32()))) for name in self.columns])
        self._batches: list[pa.RecordBatch] = []
        self._rows: dict[str, list[list[int]]] = {name: [] for name in self.columns}
        self.dropped: list[RowStart] = []  # the rows whose response lay beyond max_length, and where it started
        self.unlearned: list[str] = []  # where the rows are whose every assistant turn is marked not learned

    def add(self, encoded: dict[str, Any], location: str) -> None:
        if not encoded.get("learns", True):  # nothing to learn whatever max_length: not a row the cut dropped
            self.stats["unlearned"] += 1
            self.unlearned.append(location)
            return
        if self.prompts_only:
            left_out = not encoded["input_ids"]  # no room for a completion
        else:  # the response lay beyond max_length: nothing to learn
            left_out = not any(label != IGNORE_INDEX for label in encoded["labels"])
        if left_out:
            self.stats["dropped"] += 1
            self.dropped.append((location, encoded["response_start"]))
            return
        self.stats["rows"] += 1
        self.stats["tokens"] += sum(len(encoded[name]) for name in self.columns if name.endswith("input_ids"))
        self.stats["target_tokens"] += sum(sum(label != IGNORE_INDEX for label in encoded[name])
                                           for name in self.columns if name.endswith("labels"))
        self.stats["truncated"] += encoded["truncated"]
        for name in self.columns:
            self._rows[name].append(encoded[name])
        if len(self._rows["input_ids"]) >= _BATCH_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._rows["input_ids"]:
            self._batches.append(pa.record_batch([self._rows[name] for name in self.columns], schema=self._schema))
            self._rows = {name: [] for name in self.columns}

    def dataset(self) -> datasets.Dataset:
        import datasets
        from datasets.table import InMemoryTable

        self._flush()
        table = pa.Table.from_batches(self._batches, schema=self._schema)
        if "completion_ids" in self.columns:
            mismatched = rotated_in_groups(table.column("completion_ids").to_pylist(), self.kl_group)
            table = table.append_column("kl_completion_ids", pa.array(mismatched, type=pa.list_(pa.int32())))
        return datasets.Dataset(InMemoryTable(table))


def image_columns(fmt: str) -> tuple[str, ...]:
    """The image columns of a run on images whose rows are ``fmt``."""
    return IMAGE_COLUMNS.get(fmt, (IMAGE_COLUMN,))


def rotated_in_groups(values: list, group: int) -> list:
    """Each value replaced by the one before it in its group of ``group`` (the first by the group's last): KTO's
    mismatched completions, as TRL's KTOTrainer pairs them (its groups: a batch of the data's order)."""
    rotated = []
    for start in range(0, len(values), group):
        chunk = values[start:start + group]
        rotated += chunk[-1:] + chunk[:-1]
    return rotated


def sequence_lengths(rows: datasets.Dataset) -> list[int]:
    """The tokens each row puts into a micro-batch: a pair's two sequences together."""
    lengths = [len(ids) for ids in rows["input_ids"]]
    if "rejected_input_ids" in rows.column_names:
        lengths = [length + len(ids) for length, ids in zip(lengths, rows["rejected_input_ids"])]
    return lengths


def prepare_data(config: RunConfig, tokenizer: Any, reports: tuple | None = None,
                 image_rows: ImageRows | None = None) -> PreparedData:
    """Validate, render and tokenize the training (and eval) data; rows with images through ``image_rows`` (the
    run's ``ImageRows.for_run``: None for a text model, which refuses them).

    Every file is checked first (all problems reported together), unless
    ``reports`` holds the (train, eval) inspect_files reports of a check
    already made; then one pass tokenizes. The eval split comes from data.eval_files, else a
    seeded random eval_fraction of the training rows, else there is none.
    """
    data = config.data
    if reports is None:
        reports = (inspect_files(data.train_files, config.row_format, keep=0),
                   inspect_files(data.eval_files, config.row_format, keep=0) if data.eval_files else None)
    train_report, eval_report = reports
    formats = {report.format for report in (train_report, eval_report) if report}
    # pairs may be conversational, known row by row: the template is resolved for them all
    rendered = {"instruction", "chat", "prompt_only", *PREFERENCE_COLUMNS}
    template = resolve_template(data.template, tokenizer) if formats & rendered else "none"
    encoder = RowEncoder.for_run(config, tokenizer, template, image_rows)
    images = image_rows is not None

    held_out = set() if eval_report else held_out_rows(train_report.rows, data.eval_fraction, config.training.seed)
    group = config.training.micro_batch_size
    train = _SplitBuilder(train_report.format, template, group, images)
    evaluation = _SplitBuilder((eval_report or train_report).format, template, group, images) \
        if eval_report or held_out else None
    encoder.run(iter_examples(data.train_files, train_report.format),
                lambda index: evaluation if index in held_out else train)
    if eval_report is not None:
        encoder.run(iter_examples(data.eval_files, eval_report.format), lambda index: evaluation)
    encoder.raise_problems()

    if train.stats["rows"] == 0 and train.prompts_only:
        message, hint = long_prompts_warning(train.dropped, "the training prompts", config)
        raise ProblemsError([Problem("data.train_files", f"no prompt is left to train on: {message}", hint)], "data")
    if train.stats["rows"] == 0 and not train.dropped:
        message, hint = unlearned_warning(train.unlearned, "the training rows")
        raise ProblemsError([Problem("data.train_files", f"no row is left to train on: {message}", hint)], "data")
    if train.stats["rows"] == 0:
        raise ProblemsError(beyond_max_length_problems(train.dropped, data.max_length), "data", "the training data")
    warnings = _dropped_warnings(train, evaluation, config)
    if evaluation is None:
        return PreparedData(train.dataset(), None, {"train": train.stats}, warnings)
    eval_set = evaluation.dataset() if evaluation.stats["rows"] else None
    return PreparedData(train.dataset(), eval_set, {"train": train.stats, "eval": evaluation.stats}, warnings)


def _dropped_warnings(train: _SplitBuilder, evaluation: _SplitBuilder | None,
                      config: RunConfig) -> tuple[tuple[str, str], ...]:
    """What to say of the rows left out because their response lay beyond max_length (a prompt-only row: its
    completion would); the rest still trains."""
    warnings = []
    for split, name, consequence in ((train, "training", "the run trains on the other {kept:,} rows"),
                                     (evaluation, "eval", "eval loss is measured on the other {kept:,} rows")):
        if split is None:
            continue
        kept = split.stats["rows"]
        if split.unlearned:
            warnings.append(unlearned_warning(split.unlearned, f"{kept + len(split.unlearned):,} {name} rows"))
        if not split.dropped:
            continue
        checked = f"{kept + len(split.dropped):,} {name} rows"
        said = consequence.format(kept=kept) if kept else "this run measures no eval loss"
        if split.prompts_only:
            message, hint = long_prompts_warning(split.dropped, checked, config)
            warnings.append((message, f"{said}; {hint}"))
        else:
            warnings.append(beyond_max_length_warning(split.dropped, checked, config.data.max_length, said))
    return tuple(warnings)


def unlearned_warning(locations: list[str], checked: str) -> tuple[str, str]:
    """(message, hint) for rows left out because none of their assistant turns is learned."""
    named = "; ".join(locations[:SHOWN_ROWS]) + (f"; and {len(locations) - SHOWN_ROWS:,} more"
                                                 if len(locations) > SHOWN_ROWS else "")
    return (f"{len(locations):,} of {checked} learn nothing and are left out: every assistant turn of theirs is "
            f"marked train: false or weight: 0, or data.last_turn_only leaves only such a turn ({named})",
            "mark a turn to learn (remove its train: false), or remove the rows")


def long_prompts_warning(rows: list[RowStart], checked: str, config: RunConfig) -> tuple[str, str]:
    """(message, hint) for prompts left out: each leaves less than grpo.max_completion_length of data.max_length for
    its completion."""
    room = config.data.max_length - config.grpo.max_completion_length
    named = "; ".join(f"{where}: {tokens:,} tokens" for where, tokens in rows[:SHOWN_ROWS])
    more = f"; and {len(rows) - SHOWN_ROWS:,} more" if len(rows) > SHOWN_ROWS else ""
    return (f"{len(rows):,} of {checked} are left out: their prompt is longer than the {room:,} tokens data.max_length "
            f"{config.data.max_length:,} leaves beside grpo.max_completion_length {config.grpo.max_completion_length:,} "
            f"({named}{more})",
            f"raise data.max_length to at least {max(t for _, t in rows) + config.grpo.max_completion_length:,}, or "
            "lower grpo.max_completion_length")


def save_prepared(data: PreparedData, folder: Path) -> None:
    """The tokenized splits and their stats, for the other processes of this machine (load_prepared)."""
    shutil.rmtree(folder, ignore_errors=True)  # an earlier attempt's
    folder.mkdir(parents=True)
    data.train.save_to_disk(str(folder / "train"))
    if data.eval is not None:
        data.eval.save_to_disk(str(folder / "eval"))
    (folder / "stats.json").write_text(json.dumps(data.stats), encoding="utf-8")


def load_prepared(folder: Path) -> PreparedData:
    """What save_prepared wrote: the same rows, ids and stats as preparing them here."""
    import datasets

    evaluation = datasets.load_from_disk(str(folder / "eval")) if (folder / "eval").is_dir() else None
    stats = json.loads((folder / "stats.json").read_text(encoding="utf-8"))
    return PreparedData(datasets.load_from_disk(str(folder / "train")), evaluation, stats)


class RowEncoder:
    """Renders and tokenizes examples (``encode``) into split builders, collecting per-row problems."""

    def __init__(self, tokenizer: Any, template: str, max_length: int, train_on_prompt: bool, max_prompt: int,
                 learning: templates.Learning, image_rows: ImageRows | None = None):
        self.tokenizer, self.template, self.learning = tokenizer, template, learning
        self.image_rows = image_rows
        self.max_length, self.train_on_prompt = max_length, train_on_prompt
        self.max_prompt = max_prompt  # a prompt-only row's room: its completion follows it
        self.add_bos = adds_bos(tokenizer)
        self.problems: list[Problem] = []

    @classmethod
    def for_run(cls, config: RunConfig, tokenizer: Any, template: str,
                image_rows: ImageRows | None = None) -> "RowEncoder":
        data = config.data
        return cls(tokenizer, template, data.max_length, data.train_on_prompt,
                   data.max_length - config.grpo.max_completion_length, templates.Learning.of(data), image_rows)

    def run(self, examples: Iterable[Example], split_of: Callable[[int], _SplitBuilder]) -> None:
        """Add each example to the split that ``split_of(its index)`` names."""
        for index, example in enumerate(examples):
            if len(self.problems) >= MAX_PROBLEMS:
                return
            try:
                encoded = self.encode(example)
            except DataError as exc:
                self.problems.append(exc.problem)
                continue
            split_of(index).add(encoded, example.location)

    def encode(self, example: Example) -> dict[str, Any]:
        if example.kind == "prompt_only":
            return encode_prompt_only(example, self.tokenizer, self.template, self.max_prompt, self.add_bos)
        if example.kind in PREFERENCE_COLUMNS:
            encoded = encode_preference(example, self.tokenizer, self.template, self.max_length, self.add_bos,
                                        self.image_rows)
        else:
            segments = render_segments(example, self.tokenizer, self.template, self.learning)
            if example.images:
                return self._encode_images(example, segments)
            encoded = encode(segments, self.tokenizer, self.max_length, self.train_on_prompt, self.add_bos)
        return {**dict.fromkeys(image_columns(example.kind), b""), **encoded} if self.image_rows else encoded

    def _encode_images(self, example: Example, segments: list[Segment]) -> dict[str, Any]:
        """A chat row with images: its image placeholders expanded to the images' tokens, never learned."""
        expanded, inputs = _vision(example, self.image_rows).expand(segments, example)
        encoded = encode(expanded, self.tokenizer, self.max_length, self.train_on_prompt, self.add_bos)
        return self.image_rows.masked(encoded, inputs, self.max_length, example.location)

    def raise_problems(self) -> None:
        if self.problems:
            raise ProblemsError(self.problems, "data", "the data")


def held_out_rows(rows: int, fraction: float, seed: int) -> set[int]:
    """Indices of a seeded random ``fraction`` of the rows (at least one), leaving at least one."""
    if fraction <= 0:
        return set()
    count = max(1, round(rows * fraction))
    if count >= rows:
        raise StudioError(f"cannot hold out {fraction:.0%} of {rows} row(s) for eval and still train",
                          "add rows, lower data.eval_fraction or give data.eval_files", kind="data")
    return set(random.Random(seed).sample(range(rows), count))
