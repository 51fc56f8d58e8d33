"""Rows built to break a reader: nested past Python's recursion limit, a folder for a file. Each is refused as a
problem naming the file, the line or row and the field, never a traceback."""

import json
import subprocess
import sys

import pytest

from studio.core.data.dataset import inspect_files, iter_examples
from studio.core.data.row_formats import MAX_NESTING, DataError
from studio.core.errors import ProblemsError
from studio.core.presets import demo_config
from studio.core.validation import validate

DEEP = "[" * 50_000 + "]" * 50_000


def problems_of(path) -> list:
    with pytest.raises(ProblemsError) as caught:
        inspect_files([path])
    return caught.value.problems


def test_a_value_50000_deep_is_refused_naming_its_file_line_and_field(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "fine"}\n{"text": ' + DEEP + '}\n' + DEEP + "\n")
    first, second = problems_of(data)
    assert first.where == "rows.jsonl:2" and "field 'text'" in first.message and "100 levels" in first.message
    assert second.where == "rows.jsonl:3" and "the row" in second.message
    with pytest.raises(DataError, match="rows.jsonl:2"):  # the worker's reading (studio train) says the same
        list(iter_examples([data]))


def test_a_row_just_inside_the_limit_reads(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"text": "fine", "extra": json.loads("[" * (MAX_NESTING - 2) + "]" * (MAX_NESTING - 2))})
                    + "\n")
    assert inspect_files([data]).rows == 1


@pytest.mark.parametrize("name, text, where, field", [
    ("rows.json", '[\n{"text": "fine"},\n{"text": ' + DEEP + "}\n]", "rows.json[1] (line 3)", ""),
    ("whole.json", DEEP, "whole.json[0] (line 1)", ""),
    ("one.json", '{"text": ' + DEEP + "}", "one.json:1", ""),
    ("rows.csv", 'messages\n"' + DEEP + '"\n', "rows.csv:2", "field 'messages'"),
])
def test_the_other_readers_refuse_deep_values_by_row(tmp_path, name, text, where, field):
    data = tmp_path / name
    data.write_text(text)
    (problem,) = problems_of(data)
    assert problem.where == where and "levels deep" in problem.message and field in problem.message


def test_a_json_file_value_too_deep_to_render_is_refused_by_field(tmp_path):
    data = tmp_path / "rows.json"  # parses (under Python's limit), but deeper than a row may nest
    data.write_text(json.dumps([{"text": "a", "tools": json.loads("[" * 300 + "]" * 300)}]))
    (problem,) = problems_of(data)
    assert problem.where == "rows.json[0] (line 1)" and "field 'tools'" in problem.message


def test_a_folder_is_called_a_folder(tmp_path):
    folder = tmp_path / "chats.jsonl"
    folder.mkdir()
    (problem,) = problems_of(folder)
    assert "is a folder, not a data file: choose the files inside it" in problem.message
    config = demo_config().replace(data={"train_files": (str(folder),)})
    problems = [p for p in validate(config, check_files=True) if p.where.startswith("data.train_files")]
    assert problems and "is a folder" in problems[0].message and "no such file" not in problems[0].message


def test_config_check_prints_no_traceback_for_a_deep_row(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "a", "completion": ' + DEEP + "}\n")
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{name_or_path: {demo_config().model.name_or_path}}}\n"
                      "data: {train_files: [rows.jsonl]}\n")
    done = subprocess.run([sys.executable, "-m", "studio", "config", "check", str(config)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "RecursionError" not in done.stderr
    assert "rows.jsonl:1" in done.stderr and "field 'completion'" in done.stderr


