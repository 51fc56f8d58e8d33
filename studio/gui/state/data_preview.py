"""The dataset preview: examples rendered as the model will see them, and their token lengths. No Qt.

Rendering follows the worker (studio.train.data.prepare.render_segments) without
importing it: built-in templates come from studio.core.data.templates, and a
tokenizer's own chat template is rendered here with Jinja in a sandbox,
split at the assistant turns the same way, so the preview masks exactly what
training masks. Token counts use the Rust ``tokenizers`` library on the
model's tokenizer.json (the transformers tokenizer would import torch); a model
without one gets character lengths, labelled as such.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from studio.core.data import templates
from studio.core.data.dataset import RowStart, inspect_files, iter_examples
from studio.core.data.row_formats import DataError, Example
from studio.core.data.templates import PROMPTING, Learning, Segment
from studio.gui.state.memory import ImageTokens
from studio.gui.state.model_summary import ModelSummary

if TYPE_CHECKING:
    import numpy as np

PREVIEW_EXAMPLES = 5
LENGTH_SAMPLE = 2000  # rows tokenized for the histogram


def _numpy():
    import numpy  # in the reading thread, not at import: the window shows before numpy has loaded

    return numpy


@dataclass(frozen=True)
class TokenizerInfo:
    """What rendering needs from the model's tokenizer files."""

    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)
    tokenizer_json: Path | None = None
    image_placeholder: str = ""  # what the chat template writes for an image (a vision-language model's)
    model_folder: Path | None = None  # its preprocessor_config.json says how many tokens an image becomes

    @property
    def eos(self) -> str:
        return self.special_tokens.get("eos_token", "")

    @property
    def bos(self) -> str:
        return self.special_tokens.get("bos_token", "")


def tokenizer_of(summary: ModelSummary | None) -> TokenizerInfo:
    """The tokenizer files of a model as the preview reads them; none for a model not on this machine."""
    if summary is None or summary.folder is None:
        return TokenizerInfo()
    return TokenizerInfo(summary.chat_template, summary.special_tokens, summary.folder / "tokenizer.json",
                         summary.image_placeholder, summary.folder)


@dataclass(frozen=True)
class RenderedExample:
    location: str
    segments: tuple[Segment, ...]  # a preference pair's: the chosen sequence
    tokens: int | None  # None when there is no tokenizer (length in characters then); a pair's: its longer sequence
    error: str = ""
    rejected: tuple[Segment, ...] = ()  # a preference pair's rejected sequence, beside the chosen one
    label: bool | None = None  # an unpaired preference row's: whether its completion is desirable
    images: tuple[ShownImage, ...] = ()  # in the order the chat template's image placeholders stand


@dataclass(frozen=True)
class ShownImage:
    """An image of a row as the preview draws it: its file, its thumbnail's size in pixels, the tokens it becomes
    (None for a family whose processor's rule studio does not know)."""

    path: str
    width: int
    height: int
    tokens: int | None = None


THUMBNAIL = 96  # pixels: the longer side of a row's image in the preview


def shown_images(example: Example, tokens: ImageTokens) -> tuple[ShownImage, ...]:
    """The row's images as thumbnails with their tokens (their headers read: PIL decodes no pixels for the size)."""
    from PIL import Image

    shown = []
    for path in example.images:
        with Image.open(path) as image:
            width, height = image.size
        scale = THUMBNAIL / max(width, height, 1)
        shown.append(ShownImage(str(path), max(1, round(width * scale)), max(1, round(height * scale)),
                                tokens.of(width, height)))
    return tuple(shown)


def added_image_tokens(images: Sequence[ShownImage]) -> int:
    """The tokens a row's images add to its text's count: each placeholder, counted once, becomes its image's
    tokens (all in the prompt)."""
    return sum(image.tokens - 1 for image in images if image.tokens is not None)


@dataclass(frozen=True)
class Preview:
    format: str
    rows: int
    complete: bool
    template: str  # what rendered the rows: tokenizer, chatml, alpaca, or "none" for text/prompt_completion
    examples: tuple[RenderedExample, ...]
    lengths: np.ndarray  # per sampled row: tokens, or characters when unit is "characters"
    unit: str  # "tokens" or "characters"
    sampled: int  # rows the lengths cover
    image_placeholder: str = ""  # where an example's images stand in its text (TokenizerInfo.image_placeholder)
    locations: tuple[str, ...] = ()  # of each sampled row
    response_starts: np.ndarray = field(default_factory=lambda: _numpy().zeros(0))  # per sampled row: tokens before its
    # response (zeros when unit is "characters")
    image_rows: int = 0  # rows holding images, of all the files' rows

    def truncated(self, max_length: int) -> int:
        return int((self.lengths > max_length).sum()) if self.unit == "tokens" else 0

    def beyond(self, max_length: int) -> list[RowStart]:
        """The sampled rows whose response starts at or after ``max_length`` tokens: the cut leaves none of it."""
        if self.unit != "tokens":
            return []
        starts = zip(self.locations, self.response_starts)
        return [(where, int(start)) for where, start in starts if start >= max_length]


def build_preview(files: Sequence[str], fmt: str, template: str, tokenizer: TokenizerInfo,
                  train_on_prompt: bool = False, learning: Learning = Learning(), max_pixels: int = 0) -> Preview:
    """Read the files (all rows, for the count), render the first examples and measure a sample (an image row's
    images counted as the tokens they become under ``max_pixels``, the run's vision.max_pixels).

    Raises the dataset's ProblemsError/StudioError with every problem found.
    """
    report = inspect_files(files, fmt, keep=LENGTH_SAMPLE)
    encoder = _load_encoder(tokenizer)
    image_tokens = ImageTokens(tokenizer.model_folder if tokenizer.image_placeholder else None, max_pixels)
    resolved = resolve_template(template, tokenizer) if _templated(report.format) else "none"
    rendered, lengths, locations, starts = [], [], [], []
    for index, example in enumerate(report.examples):
        try:
            sequences = [_measure(segments, tokenizer, train_on_prompt, encoder)
                         for segments in sequences_of(example, resolved, tokenizer, train_on_prompt, learning)]
        except DataError as exc:
            if index < PREVIEW_EXAMPLES:
                rendered.append(RenderedExample(example.location, (), None, str(exc)))
            continue
        images = shown_images(example, image_tokens) if example.images else ()
        added = added_image_tokens(images) if encoder else 0
        length = max(length for _, length, _ in sequences) + added
        start = min(first for _, _, first in sequences) + added
        lengths.append(length)
        locations.append(example.location)
        starts.append(start)
        if index < PREVIEW_EXAMPLES:
            shown = [tuple(segments) for segments, _, _ in sequences]
            rendered.append(RenderedExample(example.location, shown[0], length if encoder else None,
                                            rejected=shown[1] if len(shown) > 1 else (),
                                            label=example.label if example.kind == "unpaired_preference" else None,
                                            images=images))
    np = _numpy()
    return Preview(report.format, report.rows, report.complete, resolved, tuple(rendered),
                   np.asarray(lengths, dtype=float), "tokens" if encoder else "characters", len(lengths),
                   tokenizer.image_placeholder, tuple(locations), np.asarray(starts, dtype=float), report.image_rows)


def rows_beyond(files: Sequence[str], fmt: str, template: str, tokenizer: TokenizerInfo, max_length: int,
                train_on_prompt: bool = False, learning: Learning = Learning()) -> tuple[list[RowStart], int] | None:
    """Every row whose response starts at or after ``max_length`` tokens, and how many rows there are; None
    without a tokenizer.json to count with.

    For a check of the whole data (``studio config check``): the preview measures only a sample. ``fmt`` is
    the format inspect_files detected. Raises DataError for a row the template cannot render.
    """
    encoder = _load_encoder(tokenizer)
    if encoder is None:
        return None
    resolved = resolve_template(template, tokenizer) if _templated(fmt) else "none"
    beyond, rows = [], 0
    for example in iter_examples(files, fmt):
        rows += 1
        segments = _with_bos(render_example(example, resolved, tokenizer, train_on_prompt, learning), encoder, tokenizer,
                             train_on_prompt)
        prompt = [text for text, _ in itertools.takewhile(lambda segment: not segment[1], segments)]
        if _may_reach(prompt, max_length) and (start := sum(encoder.counts(prompt))) >= max_length:
            beyond.append((example.location, start))
    return beyond, rows


def _may_reach(texts: Sequence[str], tokens: int) -> bool:
    """Whether the texts may tokenize into ``tokens`` tokens: a token holds at least a byte of its text, beside the
    one a tokenizer may put before each text. Shorter texts need no tokenizing: most prompts of a dataset."""
    return sum(len(text.encode()) + 1 for text in texts) >= tokens


PREFERENCE_KINDS = ("preference", "unpaired_preference")


def _templated(fmt: str) -> bool:
    """Whether rows of this format go through a chat template (preference rows: their conversational ones)."""
    return fmt in ("instruction", "chat", *PREFERENCE_KINDS)


def sequences_of(example: Example, template: str, tokenizer: TokenizerInfo,
                 train_on_prompt: bool = False, learning: Learning = Learning()) -> list[list[Segment]]:
    """What the model reads of a row, as (text, trainable) segments: one sequence, a pair's chosen and rejected
    ones, or an unpaired row's completion (the prompt masked, every token after it learned, as
    studio.train.data.prepare.encode_preference learns them)."""
    if example.kind not in PREFERENCE_KINDS:
        return [render_example(example, template, tokenizer, train_on_prompt, learning)]
    if not example.conversational:
        eos = tokenizer.eos
        return [[(example.prompt, False), (response if response.endswith(eos) else response + eos, True)]
                for response in example.responses]
    first = example.responses[0][:1]
    asked = render_example(Example("chat", messages=example.messages + first, tools=example.tools), template, tokenizer,
                           learning=PROMPTING)
    prompt = "".join(text for text, _ in templates.prompt_segments(asked))
    sequences = []
    for response in example.responses:
        whole = "".join(text for text, _ in render_example(Example("chat", messages=example.messages + response,
                                                                   tools=example.tools), template, tokenizer))
        sequences.append([(prompt, False), (whole[len(prompt):], True)] if whole.startswith(prompt)
                         else [(whole, True)])
    return [[segment for segment in segments if segment[0]] for segments in sequences]


def _measure(segments: list[Segment], tokenizer: TokenizerInfo, train_on_prompt: bool,
             encoder: _Encoder | None) -> tuple[list[Segment], int, int]:
    """A sequence's segments as the worker sees them, its length (tokens; characters without an encoder)
    and the tokens before its first learned one (0 without an encoder)."""
    if encoder is None:
        return segments, sum(len(text) for text, _ in segments), 0
    segments = _with_bos(segments, encoder, tokenizer, train_on_prompt)
    return segments, *encoder.measure(segments)


def resolve_template(template: str, tokenizer: TokenizerInfo) -> str:
    if template == "auto":
        return "tokenizer" if tokenizer.chat_template else "chatml"
    if template == "tokenizer" and not tokenizer.chat_template:
        raise DataError("data.template", "the tokenizer has no chat template", "choose auto, chatml or alpaca")
    return template


def render_example(example: Example, template: str, tokenizer: TokenizerInfo,
                   train_on_prompt: bool = False, learning: Learning = Learning()) -> list[Segment]:
    """The example as (text, trainable) segments, exactly as the worker renders it."""
    eos = tokenizer.eos
    if example.kind == "prompt_completion":
        segments = [(example.prompt, False), (example.completion + eos, True)]
    elif example.kind == "text":
        segments = [(example.text + eos, True)]
    else:
        segments = _chat_segments(example, template, tokenizer, learning)
    segments = [(text, trainable or train_on_prompt) for text, trainable in segments if text]
    return templates.merge_segments(segments)


# ---------------------------------------------------------------- the tokenizer's chat template


def _chat_segments(example: Example, template: str, tokenizer: TokenizerInfo, learning: Learning) -> list[Segment]:
    """A conversation through the tokenizer's template or a built-in one; a problem names the row."""
    try:
        if template == "tokenizer":
            return templates.split_rendered_chat(example.messages, example.tools, partial(_apply, tokenizer), learning)
        return templates.render(template, example.messages, tokenizer.eos, example.tools, learning)
    except DataError as exc:
        raise exc.at(example.location) from None


def _apply(tokenizer: TokenizerInfo, messages, tools, generation_prompt: bool) -> str:
    try:
        return _compiled(tokenizer.chat_template).render(
            messages=list(messages), tools=list(tools) or None, add_generation_prompt=generation_prompt,
            **tokenizer.special_tokens)
    except Exception as exc:  # jinja raises whatever the template author wrote
        raise DataError("", f"the tokenizer's chat template failed: {exc}", templates.TEMPLATE_HINT) from None


_TEMPLATE_CACHE: dict[str, object] = {}


def _compiled(source: str | None):
    """The template in Jinja's immutable sandbox, configured like transformers' renderer."""
    if source not in _TEMPLATE_CACHE:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        _TEMPLATE_CACHE[source] = env.from_string(source or "")
    return _TEMPLATE_CACHE[source]


# ---------------------------------------------------------------- tokens


class _Encoder:
    """Counts tokens the way the worker does: each segment on its own, without special tokens."""

    def __init__(self, tokenizer, bos: str):
        tokenizer.no_padding()  # a tokenizer.json may pad batches to their longest row
        tokenizer.no_truncation()
        self._tokenizer = tokenizer
        bos_id = tokenizer.token_to_id(bos) if bos else None
        self.adds_bos = bos_id is not None and tokenizer.encode("a").ids[:1] == [bos_id]

    def counts(self, texts: Sequence[str]) -> list[int]:
        encoded = self._tokenizer.encode_batch(list(texts), add_special_tokens=False) if texts else []
        return [len(e.ids) for e in encoded]

    def measure(self, segments: Sequence[Segment]) -> tuple[int, int]:
        """The tokens of all segments, and of those before the first learned one (all, when none is)."""
        counts = self.counts([text for text, _ in segments])
        learned = [trainable for _, trainable in segments]
        return sum(counts), sum(counts[:learned.index(True)] if True in learned else counts)


def _load_encoder(tokenizer: TokenizerInfo) -> _Encoder | None:
    path = tokenizer.tokenizer_json
    if path is None or not Path(path).is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return _Encoder(Tokenizer.from_file(str(path)), tokenizer.bos)
    except Exception:  # a tokenizer.json this version cannot read: fall back to characters
        return None


def _with_bos(segments: list[Segment], encoder: _Encoder, tokenizer: TokenizerInfo, train_on_prompt: bool) -> list[Segment]:
    """The bos token the worker puts first when the tokenizer adds one."""
    bos = tokenizer.bos
    if not segments or not encoder.adds_bos or segments[0][0].startswith(bos):
        return segments
    return templates.merge_segments([(bos, train_on_prompt)] + list(segments))
