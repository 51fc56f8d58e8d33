"""Reading training data files into validated examples, without a tokenizer.

This is the fast, pure-Python half of the data pipeline: the GUI calls
``inspect_files`` for a preview and the worker calls it before loading a model,
so a bad file is refused in a second instead of after minutes of setup.
``studio.train.data.prepare`` turns the examples into tokens.

Files: ``.jsonl`` (one JSON object a line), ``.json`` (a list of objects; an
object holding exactly one list of them, like ``{"data": [...]}``; a single
row object; or JSON Lines saved as .json), ``.csv`` (comma-separated, a header
row of column names), ``.parquet`` and ``.txt`` (one example a non-blank line).

Locations name the row the way an editor finds it: ``data.jsonl:12`` (1-based
line; for CSV the line a row starts on, the header being line 1),
``data.json[3] (line 12)`` (0-based list index and the line it starts on),
``data.parquet row 7`` (1-based), ``hub:OWNER/NAME row 7`` (the entry as written) and ``notes.txt:3``.

Hostile rows are refused as problems, never tracebacks: a value nested deeper than ``row_formats.MAX_NESTING``
(counted on the line's brackets before parsing, which recurses once a level; walked without recursion for
Parquet and .json rows), named by its file, line or row and field; a path that is a folder is called one.

The row formats and their validation are in ``studio.core.data.row_formats``.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from studio.core.data.hub import is_hub_spec, parse_hub_spec, rows_file
from studio.core.data.row_formats import (FORMATS, DataError, Example, check_nesting, describe_value, detect_format,
                                          fits_no_format, nesting_error, to_messages, too_deep, unknown_format_error)
from studio.core.errors import Problem, ProblemsError

SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")


class PreferenceRows(NamedTuple):
    """A preference row format in words: one row, many, the objectives that read it, the fields it needs."""

    row: str
    rows: str
    objectives: str
    fields: str


PREFERENCE_ROWS = {
    "preference": PreferenceRows("a preference pair", "preference pairs (chosen and rejected)", "dpo, orpo or simpo",
                                 "prompt, chosen and rejected (TRL's preference rows)"),
    "unpaired_preference": PreferenceRows("an unpaired preference row", "unpaired preference rows (completion and "
                                          "label)", "kto", "prompt, completion and label (TRL's unpaired preference "
                                          "rows)"),
}

def objective_refusal(fmt: str, objective: str, learns_preferences: bool, where: str) -> DataError | None:
    """Why rows of ``fmt`` cannot train ``objective`` (``where``: their file), or None: preference rows are for the
    preference objectives alone (which read every file as their rows, and refuse others by line)."""
    if fmt in PREFERENCE_ROWS and not learns_preferences:
        rows = PREFERENCE_ROWS[fmt]
        learns = "from responses" if objective == "sft" else "from prompts and rewards"
        return DataError(where, f"the rows are {rows.rows}: objective {objective} learns {learns}",
                         f"set objective to {rows.objectives}")
    return None


def image_rows_refusal(objective: str, pipeline_stages: int, where: str) -> DataError | None:
    """Why rows with images (in ``where``: their file) cannot train ``objective``, or a pipeline of
    ``pipeline_stages``, or None. ORPO's cross-entropy learns each chosen answer's prompt too, which an image's
    tokens never are (KTO's and GRPO's rows are refused images by their row formats); a pipeline's first stage
    starts from the token embeddings: the vision tower is in no stage."""
    if objective == "orpo":
        return DataError(where, "the rows hold images: objective orpo does not train on images yet (its "
                         "cross-entropy learns the prompt too, and an image's tokens are never learned)",
                         "set objective to dpo or simpo, or remove the images")
    if pipeline_stages:
        return DataError(where, "the rows hold images: a pipeline does not carry them yet (its first stage starts "
                         "from the token embeddings; the vision tower is in no stage)",
                         "set distributed.pipeline_stages to 0 (ZeRO-3 or FSDP shard such a model too), or remove "
                         "the images")
    return None


MAX_PROBLEMS = 20
"""inspect_files stops reading after this many problems: enough to see a pattern."""


@dataclass(frozen=True)
class DatasetReport:
    """What ``inspect_files`` found: the format, row counts (per file too) and the examples kept.

    ``complete`` is False when ``limit`` stopped the reading early: ``rows`` is
    then a lower bound.
    """

    format: str
    rows: int
    file_rows: dict[str, int] = field(default_factory=dict)
    examples: tuple[Example, ...] = ()
    complete: bool = True
    image_rows: int = 0
    """The rows holding images (they train on a vision-language model alone)."""


# ---------------------------------------------------------------- reading files

Row = tuple[str, "dict | Problem"]
"""(location, record) where a record that could not be read is a Problem instead."""


def iter_records(path: str | Path) -> Iterator[tuple[str, dict]]:
    """Yield (location, record) for every row of one file; raise DataError at the first bad one.

    Raises DataError for an unreadable, empty or unsupported file too.
    """
    for location, record in _read_file(Path(path)):
        if isinstance(record, Problem):
            raise DataError(record.where, record.message, record.hint)
        yield location, record


def _read_file(path: Path) -> Iterator[Row]:
    """Dispatch on the suffix; turn OS errors and empty files into Problems."""
    if is_hub_spec(path.as_posix()):
        yield from _read_hub(path.as_posix())
        return
    name = path.name
    if path.is_dir():
        yield name, Problem(name, f"{path} is a folder, not a data file: choose the files inside it",
                            f"list the files, e.g. {(path / ('*' + SUFFIXES[0])).as_posix()}")
        return
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        yield name, Problem(name, f"unsupported file type '{path.suffix}'", "use " + ", ".join(SUFFIXES))
        return
    try:
        if path.stat().st_size == 0:
            yield name, Problem(name, "the file is empty: no rows", "choose a file with training rows")
            return
        yield from reader(path, name)
    except OSError as exc:
        yield name, Problem(name, f"cannot read the file: {exc.strerror or exc}", "check the path and its permissions")


def _read_hub(name: str) -> Iterator[Row]:
    """The rows of a Hub dataset split, from the Parquet file the worker wrote when it loaded it."""
    try:
        local = rows_file(parse_hub_spec(name))
    except DataError as exc:
        yield name, exc.problem
        return
    if not local.is_file():
        yield name, Problem(name, f"the Hub dataset {name} has not been loaded on this machine yet",
                            "`studio config check CONFIG` or starting the training loads it (needs the network once)")
        return
    yield from _read_parquet(local, name)


def _text_lines(path: Path, name: str) -> Iterator[tuple[int, str | Problem]]:
    """(1-based line number, line with its ending) for each line, decoding UTF-8 line by line.

    Decoding each line separately lets one bad byte cost one row, not the file,
    and name the line and byte offset. A leading byte-order mark is dropped.
    """
    offset = 0
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw, offset = raw[3:], 3
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                byte = raw[exc.start]
                yield number, Problem(
                    f"{name}:{number}",
                    f"not valid UTF-8: byte 0x{byte:02x} at byte offset {offset + exc.start} of the file",
                    "save the file as UTF-8",
                )
            offset += len(raw)


def _read_jsonl(path: Path, name: str) -> Iterator[Row]:
    for number, line in _text_lines(path, name):
        if isinstance(line, Problem) or line.strip():
            yield _json_row(line, f"{name}:{number}")


def _json_row(line: str | Problem, where: str) -> Row:
    if isinstance(line, Problem):
        return where, line
    line = line.rstrip("\r\n")
    deep, key = too_deep(line)  # json.loads recurses once a level: a row 50,000 brackets deep would end the stack
    if deep:
        return where, nesting_error(where, f"field '{key}'" if key else "").problem
    try:
        value = json.loads(line)
    except RecursionError:
        return where, nesting_error(where).problem
    except json.JSONDecodeError as exc:
        hint = "each line must hold one complete JSON object"
        if exc.msg.startswith("Unterminated string") or exc.pos >= len(line.rstrip()):
            return where, Problem(where, "not valid JSON: the line ends before the object does (cut off?)", hint)
        return where, Problem(where, f"not valid JSON: {exc.msg} (column {exc.colno})", hint)
    return where, _object_or_problem(value, where)


def _object_or_problem(value: Any, where: str) -> dict | Problem:
    if isinstance(value, dict):
        return value
    return Problem(where, f"expected a JSON object {{...}}, got {describe_value(value)}", "each row must be an object of fields")


def _read_text(path: Path, name: str) -> Iterator[Row]:
    for number, line in _text_lines(path, name):
        where = f"{name}:{number}"
        if isinstance(line, Problem):
            yield where, line
        elif line.strip():
            yield where, {"text": line.rstrip("\r\n")}


def _read_csv(path: Path, name: str) -> Iterator[Row]:
    """Rows of a CSV with a header; stops at the first undecodable line or broken quoting."""
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))  # a single 10 MB cell is fine
    stopped: list[Problem] = []

    def lines() -> Iterator[str]:
        for _, line in _text_lines(path, name):
            if isinstance(line, Problem):
                stopped.append(line)
                return
            yield line

    reader = csv.reader(lines())
    try:
        yield from _csv_rows(reader, name)
    except csv.Error as exc:
        where = f"{name}:{reader.line_num}"
        yield where, Problem(where, f"not valid CSV: {exc}", "check the quoting around this line")
    for problem in stopped:
        yield problem.where, problem


def _csv_rows(reader: Any, name: str) -> Iterator[Row]:
    header = next(reader, None)
    if header is None:
        return
    columns = [c.strip() for c in header]
    problem = _check_header(columns, name)
    if problem:
        yield problem.where, problem
        return
    start = reader.line_num + 1
    for cells in reader:
        where, start = f"{name}:{start}", reader.line_num + 1
        if not cells:
            continue
        if len(cells) != len(columns):
            message = f"the row has {_count(len(cells), 'value')} but the header has {_count(len(columns), 'column')}"
            yield where, Problem(where, message, "quote values that contain commas or line breaks")
        else:
            yield where, dict(zip(columns, cells))


def _check_header(columns: list[str], name: str) -> Problem | None:
    where = f"{name}:1"
    if len(columns) == 1:
        for sep, label in ((";", "semicolons"), ("\t", "tabs"), ("|", "bars")):
            if sep in columns[0]:
                return Problem(where, f"the header is a single column {columns[0]!r}: the file seems to "
                               f"separate columns with {label}", "save it as comma-separated CSV")
    duplicates = sorted({c for c in columns if columns.count(c) > 1})
    if duplicates:
        return Problem(where, f"the header repeats column(s) {', '.join(map(repr, duplicates))}", "give each column its own name")
    return None


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _read_parquet(path: Path, name: str) -> Iterator[Row]:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow comes with datasets
        yield name, Problem(name, "reading Parquet needs the pyarrow package", "pip install pyarrow")
        return
    try:
        parquet = pq.ParquetFile(path)
    except (pyarrow.ArrowException, ValueError) as exc:
        yield name, Problem(name, f"not a readable Parquet file: {exc}", "check that the file is complete")
        return
    with closing(parquet):
        number = 0
        for batch in parquet.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                number += 1
                yield f"{name} row {number}", _shallow_or_problem(record, f"{name} row {number}")


def _shallow_or_problem(record: dict, where: str) -> dict | Problem:
    """The record, or a Problem naming the field that nests deeper than a row may (walked without recursion)."""
    try:
        for key, value in record.items():
            check_nesting(value, where, f"field '{key}'")
    except DataError as exc:
        return exc.problem
    return record


def _read_json(path: Path, name: str) -> Iterator[Row]:
    """A .json file: a list of rows, an object holding one list of rows, one row, or JSON Lines."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        where = f"{name}:{_line_of(raw, exc.start)}"
        yield where, Problem(where, f"not valid UTF-8: byte 0x{raw[exc.start]:02x} at byte offset {exc.start}",
                             "save the file as UTF-8")
        return
    try:
        yield from _json_document(text, name, path)
    except _TooDeep as exc:
        where = f"{exc.where} (line {_line_of(text, exc.position)})" if exc.where else f"{name}:{_line_of(text, exc.position)}"
        yield where, nesting_error(where).problem
    except json.JSONDecodeError as exc:
        where = f"{name}:{exc.lineno}"
        yield where, Problem(where, f"not valid JSON: {exc.msg} (column {exc.colno})", "check the JSON syntax")


def _json_document(text: str, name: str, path: Path) -> Iterator[Row]:
    start = _skip_space(text, 0)
    if start == len(text):
        return
    if text[start] == "[":
        yield from _json_list_rows(text, start, name)
        return
    value, end = _decode(text, start)
    rest = _skip_space(text, end)
    if rest < len(text) and isinstance(value, dict) and "\n" not in text[start:end]:
        yield from _read_jsonl(path, name)  # JSON Lines saved with a .json suffix
        return
    if rest < len(text):
        raise json.JSONDecodeError("Extra data", text, rest)
    if not isinstance(value, dict):
        yield name, Problem(name, f"expected a list of row objects, got {describe_value(value)}", "put the rows in a JSON list [...]")
    elif detect_format(value):
        where = f"{name}:{_line_of(text, start)}"
        yield where, _shallow_or_problem(value, where)
    else:
        yield from _wrapped_rows(text, start, value, name)


def _wrapped_rows(text: str, start: int, value: dict, name: str) -> Iterator[Row]:
    """The rows of ``{"data": [...]}``: the one list the object holds."""
    lists = [key for key, item in value.items() if isinstance(item, list)]
    if len(lists) != 1:
        message = (f"the top-level object holds several lists ({', '.join(lists)})" if lists
                   else f"the top-level object has no list of rows (fields: {', '.join(value) or 'none'})")
        yield name, Problem(name, message, "put the rows in a JSON list [...] or in a single key like {\"data\": [...]}")
        return
    for key, position in _json_members(text, start):
        if key == lists[0]:
            yield from _json_list_rows(text, position, name)


class _TooDeep(Exception):
    """A JSON value nested deeper than the parser's recursion allows: where (a row, when known) and its offset."""

    def __init__(self, where: str, position: int):
        super().__init__(where)
        self.where, self.position = where, position


def _decode(text: str, position: int, where: str = "") -> tuple[Any, int]:
    """``_DECODER.raw_decode``, a value too deep for the parser's recursion raised as _TooDeep."""
    try:
        return _DECODER.raw_decode(text, position)
    except RecursionError:
        raise _TooDeep(where, position) from None


_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")


def _skip_space(text: str, position: int) -> int:
    return _SPACE.match(text, position).end()


def _line_of(text: str | bytes, position: int) -> int:
    newline = "\n" if isinstance(text, str) else b"\n"
    return text.count(newline, 0, position) + 1


def _json_list_rows(text: str, position: int, name: str) -> Iterator[Row]:
    """Decode a JSON list element by element to know the line each row starts on."""
    line, counted = 1, 0
    for index, start, value in _json_elements(text, position, name):
        line, counted = line + text.count("\n", counted, start), start
        where = f"{name}[{index}] (line {line})"
        record = _object_or_problem(value, where)
        yield where, record if isinstance(record, Problem) else _shallow_or_problem(record, where)


def _json_elements(text: str, position: int, name: str) -> Iterator[tuple[int, int, Any]]:
    """(index, start offset, value) of each element of the list starting at ``position``."""
    position = _skip_space(text, position + 1)
    index = 0
    if text.startswith("]", position):
        return
    while True:
        value, end = _decode(text, position, f"{name}[{index}]")
        yield index, position, value
        index += 1
        position = _skip_space(text, end)
        if text.startswith("]", position):
            return
        if not text.startswith(",", position):
            raise json.JSONDecodeError("Expecting ',' delimiter", text, position)
        position = _skip_space(text, position + 1)


def _json_members(text: str, position: int) -> Iterator[tuple[str, int]]:
    """(key, value start offset) of each member of an already-validated JSON object."""
    position = _skip_space(text, position + 1)
    while not text.startswith("}", position):
        key, end = _DECODER.raw_decode(text, position)
        value_start = _skip_space(text, _skip_space(text, end) + 1)  # skip the colon
        yield key, value_start
        _, end = _decode(text, value_start)
        position = _skip_space(text, end)
        if text.startswith(",", position):
            position = _skip_space(text, position + 1)


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet, ".txt": _read_text}


# ---------------------------------------------------------------- whole datasets


class _Scanner:
    """Validates the rows of several files in order, as one dataset.

    Under "auto" the first valid row decides the format and a later row that
    looks like another format is a problem (mixed formats); with an explicit
    format every row is validated against it.
    """

    def __init__(self, fmt: str):
        if fmt != "auto" and fmt not in FORMATS:
            raise DataError("data.format", f"{fmt!r} is not one of auto, {', '.join(FORMATS)}")
        self.requested = fmt
        self.format: str | None = None if fmt == "auto" else fmt
        self.decided_at = ""
        self.complete = True
        self.rows_checked = 0
        self.wrong_format = False  # the explicit format does not fit the first row: stop at that one problem

    def items(self, paths: list[Path], limit: int | None = None) -> Iterator[tuple[Path, Example | Problem]]:
        """(file, example or problem) for each row; files without rows are problems too."""
        for path in paths:
            read = 0
            with closing(_read_file(path)) as records:
                for location, record in records:
                    if limit is not None and read >= limit:
                        self.complete = False
                        break
                    read += 1
                    yield path, record if isinstance(record, Problem) else self._example(record, location, path)
            if read == 0:
                yield path, Problem(path.name, "no rows", "the file holds no data rows")

    def _example(self, record: dict, location: str, path: Path) -> Example | Problem:
        seen = detect_format(record)
        try:
            if self.format is None:
                example = with_image_files(to_messages(record, "auto", location), path.parent)
                self.format, self.decided_at = example.kind, location
                return example
            if self.requested == "auto" and seen and seen != self.format:
                return Problem(location, f"mixed formats: this row looks like {seen}, earlier rows are "
                               f"{self.format} ({self.decided_at})", "use one row format per dataset")
            return with_image_files(to_messages(record, self.format, location), path.parent)
        except DataError as exc:
            # a prompt-only row fits no other format by its nature: its own problem (a missing prompt) says it best
            own_fields = (*PREFERENCE_ROWS, "prompt_only")
            if self.requested != "auto" and self.requested not in own_fields and fits_no_format(record):
                self.wrong_format = not self.rows_checked  # "field 'instruction' is missing" would hide why
                return unknown_format_error(record, location, self.format).problem
            if self.format in PREFERENCE_ROWS and seen not in (None, self.format):
                self.wrong_format = not self.rows_checked
                wanted = PREFERENCE_ROWS[self.format]
                fitting = PREFERENCE_ROWS[seen].objectives if seen in PREFERENCE_ROWS else "sft"
                return Problem(exc.problem.where, f"the row looks like {seen or 'no row format'}, not {wanted.row} "
                               f"({exc.problem.message})", f"objective {wanted.objectives} learns from rows with "
                               f"{wanted.fields}; to learn from these rows, set objective to {fitting}")
            if self.requested != "auto" and seen and seen != self.format:
                if not self.rows_checked:  # the first row already: the whole dataset is likely another format
                    self.wrong_format = True
                    return Problem(exc.problem.where, f"the rows look like {seen}, but data.format is {self.format} "
                                   f"({exc.problem.message})", f"set data.format to {seen} or auto")
                return Problem(exc.problem.where, exc.problem.message,
                               f"the row looks like {seen} but data.format is {self.format}")
            return exc.problem
        finally:
            self.rows_checked += 1


def with_image_files(example: Example, folder: Path) -> Example:
    """The example with its images' paths resolved against ``folder`` (the data file's), each an existing file; a
    DataError names the row, the image (its index and path) and the file looked for."""
    if not example.images:
        return example
    files = []
    for index, image in enumerate(example.images):
        file = (folder / image).resolve()
        if not file.is_file():
            what = "is a folder, not an image file" if file.is_dir() else "does not exist"
            raise DataError(example.location, f"image {index} ({image}) {what}: {file}",
                            "image paths are relative to the data file's folder")
        files.append(str(file))
    return replace(example, images=tuple(files))


def iter_examples(paths: Iterable[str | Path], fmt: str = "auto") -> Iterator[Example]:
    """Every example of the files in order; raise DataError at the first problem.

    Meant for data already checked by ``inspect_files`` (pass its ``format``).
    """
    with closing(_Scanner(fmt).items(_paths(paths))) as items:
        for _, item in items:
            if isinstance(item, Problem):
                raise DataError(item.where, item.message, item.hint)
            yield item


def inspect_files(paths: Iterable[str | Path], fmt: str = "auto", limit: int | None = None,
                  keep: int | None = None) -> DatasetReport:
    """Read and validate the files: the format, the row counts and the examples.

    Reads every row, or the first ``limit`` rows of each file, and keeps the
    first ``keep`` examples in the report (None: all that were read; a GUI
    preview passes a small number). Collects up to MAX_PROBLEMS problems, then
    raises them together as a ProblemsError (kind "data"). No tokenizer: fast
    enough for the GUI.
    """
    paths = _paths(paths)
    if not paths:
        raise DataError("data.train_files", "no data files", "choose at least one file")
    scanner = _Scanner(fmt)
    problems: list[Problem] = []
    kept: list[Example] = []
    counts = {str(p): 0 for p in paths}
    image_rows = 0
    with closing(scanner.items(paths, limit)) as items:
        for path, item in items:
            if isinstance(item, Example):
                counts[str(path)] += 1
                image_rows += bool(item.images)
                if keep is None or len(kept) < keep:
                    kept.append(item)
            elif len(problems) < MAX_PROBLEMS:
                problems.append(item)
                if scanner.wrong_format:
                    break
            else:
                problems.append(Problem("", f"stopped checking after {MAX_PROBLEMS} problems"))
                break
    if problems:
        raise ProblemsError(problems, "data", _describe_paths(paths))
    assert scanner.format is not None  # a dataset without rows has problems
    return DatasetReport(scanner.format, sum(counts.values()), counts, tuple(kept), scanner.complete, image_rows)


def _paths(paths: Iterable[str | Path] | str | Path) -> list[Path]:
    """A single path is a list of one, not a sequence of characters."""
    return [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]


def _describe_paths(paths: list[Path]) -> str:
    if len(paths) <= 3:
        return ", ".join(str(p) for p in paths)
    return f"{len(paths)} data files"


# ---------------------------------------------------------------- rows the cut at max_length leaves nothing to learn

SHOWN_ROWS = 3
"""How many rows a message about rows beyond max_length names; it counts the rest."""

RowStart = tuple[str, int]
"""(location, tokens before its response): a row whose response starts at or after data.max_length."""


def beyond_max_length_problems(rows: list[RowStart], max_length: int,
                               setting: str = "data.max_length") -> list[Problem]:
    """No training row keeps a token of its response: the first rows named with what to do, and the count.

    Raised when every training row is cut before its response: the run would have nothing to learn.
    ``setting`` names max_length as the reader knows it (the window: by its label).
    """
    problems = [Problem(where, f"the response starts after {start:,} tokens, beyond the {max_length:,} of {setting}: "
                        "the cut leaves nothing of it to learn",
                        f"raise {setting} to at least {start + 1:,} tokens, or shorten the prompt")
                for where, start in rows[:SHOWN_ROWS]]
    every = "the only training row is" if len(rows) == 1 else f"all {len(rows):,} training rows are"
    keep_all = (f"raise {setting} to at least {_tokens_keeping(rows):,} tokens to keep every row, or shorten the "
                "prompts") if len(rows) > 1 else ""
    problems.append(Problem("", f"no row is left to train on: {every} cut before its response", keep_all))
    return problems


def beyond_max_length_warning(rows: list[RowStart], checked: str, max_length: int, consequence: str = "",
                              setting: str = "data.max_length") -> tuple[str, str]:
    """(message, hint) for some of the ``checked`` rows ("120 training rows") cut before their response: they
    are left out.

    ``consequence`` says what happens to the rest (the run trains on them), in the hint before what to do;
    ``setting`` as for beyond_max_length_problems.
    """
    named = "; ".join(f"{where}: after {start:,} tokens" for where, start in rows[:SHOWN_ROWS])
    more = f"; and {len(rows) - SHOWN_ROWS:,} more" if len(rows) > SHOWN_ROWS else ""
    one = len(rows) == 1
    message = (f"{len(rows):,} of {checked} {'is' if one else 'are'} left out: {'its' if one else 'their'} response "
               f"starts beyond the {max_length:,} tokens of {setting}, so the cut leaves nothing of it to learn "
               f"({named}{more})")
    to_do = (f"to keep {'it' if one else 'them'}, raise {setting} to at least {_tokens_keeping(rows):,} tokens, or "
             f"shorten {'its prompt' if one else 'their prompts'}")
    return message, f"{consequence}; {to_do}" if consequence else to_do


def _tokens_keeping(rows: list[RowStart]) -> int:
    """The max_length that keeps a token of every row's response."""
    return max(start for _, start in rows) + 1
