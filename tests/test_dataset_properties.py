"""Properties of reading and format detection (studio.core.data.dataset), on generated rows and bytes.

- Any bytes in a file of any supported type are read or refused with our own error: never a crash.
- Any JSON object is validated or refused with a DataError naming its location.
- Detection depends on which fields a row has, not on their order, values or the order of the rows;
  adding valid rows of the same format never changes it.
- The file type does not change the examples: the same rows as JSONL, JSON, CSV or Parquet read alike.
- A row of another format is named with its line.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from studio.core.data.dataset import SUFFIXES, inspect_files, iter_records
from studio.core.data.row_formats import DataError, detect_format, to_messages
from studio.core.errors import ProblemsError

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=12).filter(str.strip)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
                           max_leaves=10)
FORMAT_KEYS = ["messages", "conversations", "instruction", "output", "input", "prompt", "completion", "text", "role"]
records = st.dictionaries(st.sampled_from(FORMAT_KEYS) | st.text(max_size=8), json_values, max_size=5)

ROWS = {  # one valid row of each format from two words
    "instruction": lambda a, b: {"instruction": a, "input": "", "output": b},
    "chat": lambda a, b: {"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]},
    "prompt_completion": lambda a, b: {"prompt": a, "completion": b},
    "text": lambda a, b: {"text": f"{a} {b}"},
}
FLAT = ("instruction", "prompt_completion", "text")  # formats whose rows fit a CSV or Parquet table


def valid_rows(fmt: str):
    return st.lists(st.tuples(words, words), min_size=1, max_size=6).map(lambda pairs: [ROWS[fmt](a, b) for a, b in pairs])


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def contents(report):
    return [(e.kind, e.messages, e.prompt, e.completion, e.text) for e in report.examples]


@PROPERTY
@given(st.binary(max_size=300), st.sampled_from(SUFFIXES))
def test_any_bytes_are_read_or_refused_with_a_data_error(tmp_path, data, suffix):
    path = tmp_path / f"rows{suffix}"
    path.write_bytes(data)
    try:
        report = inspect_files([path])
    except ProblemsError as exc:
        assert exc.kind == "data" and exc.problems and all(p.where.startswith("rows") for p in exc.problems)
    else:
        assert report.rows == sum(report.file_rows.values()) >= 1 and report.format in ROWS
    try:
        for location, record in iter_records(path):
            assert location.startswith("rows") and isinstance(record, dict)
    except DataError as exc:
        assert exc.kind == "data" and exc.problem.where.startswith("rows")


@settings(max_examples=300, deadline=None)
@given(records)
def test_any_json_object_is_validated_or_refused_naming_its_row(record):
    try:
        example = to_messages(record, "auto", "rows.jsonl:7")
    except DataError as exc:
        assert exc.problem.where == "rows.jsonl:7" and exc.problem.message
    else:
        assert example.kind == detect_format(record) and example.location == "rows.jsonl:7"


@settings(max_examples=200, deadline=None)
@given(records, st.randoms(use_true_random=False))
def test_detection_depends_on_the_fields_present_not_their_order_or_values(record, rng):
    keys = list(record)
    rng.shuffle(keys)
    assert detect_format({key: record[key] for key in keys}) == detect_format(record)
    # the one value that counts: a completion that is a list of messages is TRL's conversational form, a chat
    conversational = "prompt" in record and isinstance(record.get("completion"), list)
    texts = detect_format(dict.fromkeys(record, "x"))
    assert detect_format(record) == ("chat" if conversational and texts == "prompt_completion" else texts)


@PROPERTY
@given(st.sampled_from(list(ROWS)), st.data())
def test_row_order_and_more_valid_rows_keep_the_format(tmp_path, fmt, data):
    rows = data.draw(valid_rows(fmt))
    more = data.draw(valid_rows(fmt))
    shuffled = data.draw(st.permutations(rows))
    write_jsonl(tmp_path / "a.jsonl", rows)
    write_jsonl(tmp_path / "b.jsonl", shuffled)
    write_jsonl(tmp_path / "c.jsonl", rows + more)
    report, reordered, grown = (inspect_files([tmp_path / name]) for name in ("a.jsonl", "b.jsonl", "c.jsonl"))
    assert report.format == reordered.format == grown.format == fmt
    assert sorted(map(repr, contents(reordered))) == sorted(map(repr, contents(report)))
    assert grown.rows == report.rows + len(more) and contents(grown)[:report.rows] == contents(report)


@PROPERTY
@given(st.sampled_from(FLAT), st.data())
def test_the_file_type_does_not_change_the_examples(tmp_path, fmt, data):
    import csv

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = data.draw(valid_rows(fmt))
    assume(not any("\r" in v for row in rows for v in row.values()))  # csv turns a lone \r into a line break
    write_jsonl(tmp_path / "rows.jsonl", rows)
    (tmp_path / "rows.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    with open(tmp_path / "rows.csv", "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    reports = [inspect_files([tmp_path / f"rows{suffix}"]) for suffix in (".jsonl", ".json", ".csv", ".parquet")]
    assert {r.format for r in reports} == {fmt}
    assert all(contents(r) == contents(reports[0]) for r in reports)


@PROPERTY
@given(st.sampled_from(list(ROWS)), st.sampled_from(list(ROWS)), st.data())
def test_a_row_of_another_format_is_named_by_its_line(tmp_path, first, other, data):
    assume(first != other)
    rows = data.draw(valid_rows(first))
    position = data.draw(st.integers(1, len(rows)))
    a, b = data.draw(words), data.draw(words)
    write_jsonl(tmp_path / "mixed.jsonl", rows[:position] + [ROWS[other](a, b)] + rows[position:])
    with pytest.raises(ProblemsError) as caught:
        inspect_files([tmp_path / "mixed.jsonl"])
    (problem,) = caught.value.problems
    assert problem.where == f"mixed.jsonl:{position + 1}" and f"looks like {other}" in problem.message


def test_the_strategies_reach_every_format():
    rng = random.Random(0)
    assert {detect_format(ROWS[fmt]("a", "b")) for fmt in ROWS} == set(ROWS)
    assert detect_format({"question": rng.random()}) is None
