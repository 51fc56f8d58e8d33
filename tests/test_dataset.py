"""Reading and validating data files (studio.core.data.dataset) and the built-in templates, no tokenizer."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from studio.core.data import templates
from studio.core.data.dataset import MAX_PROBLEMS, inspect_files, iter_examples, iter_records
from studio.core.data.row_formats import DataError, Example, detect_format, to_messages
from studio.core.errors import ProblemsError

DATA = Path(__file__).parent / "data"

ALPACA = [{"instruction": "Name a colour.", "input": "", "output": "Blue."},
          {"instruction": "Translate.", "input": "chat", "output": "cat"}]
OPENAI = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello!"}]}]
SHAREGPT = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
                               {"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Bye!"}]}]
PROMPT_COMPLETION = [{"prompt": "2+2=", "completion": "4"}, {"prompt": "", "completion": "free text"}]
TEXT = [{"text": "Once upon a time."}, {"text": "The end."}]


def write(path: Path, rows: list[dict]) -> Path:
    """Write rows in the format the suffix names."""
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif suffix == ".json":
        path.write_text(json.dumps(rows, indent=2), encoding="utf-8")
    elif suffix == ".csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif suffix == ".txt":
        path.write_text("\n\n".join(r["text"] for r in rows) + "\n", encoding="utf-8")
    return path


def problems_of(paths, fmt="auto") -> list[str]:
    with pytest.raises(ProblemsError) as info:
        inspect_files([paths] if isinstance(paths, (str, Path)) else paths, fmt)
    assert info.value.kind == "data"
    return [str(p) for p in info.value.problems]


# ---------------------------------------------------------------- formats and file types


@pytest.mark.parametrize("suffix, rows, fmt", [
    (".jsonl", ALPACA, "instruction"), (".json", ALPACA, "instruction"), (".csv", ALPACA, "instruction"),
    (".parquet", ALPACA, "instruction"), (".jsonl", OPENAI, "chat"), (".json", SHAREGPT, "chat"),
    (".parquet", OPENAI, "chat"), (".jsonl", SHAREGPT, "chat"), (".csv", PROMPT_COMPLETION, "prompt_completion"),
    (".parquet", PROMPT_COMPLETION, "prompt_completion"), (".jsonl", TEXT, "text"), (".txt", TEXT, "text"),
    (".csv", TEXT, "text"),
])
def test_every_file_type_and_format_is_detected(tmp_path, suffix, rows, fmt):
    report = inspect_files([write(tmp_path / f"data{suffix}", rows)])
    assert (report.format, report.rows, report.complete) == (fmt, len(rows), True)
    assert len(report.examples) == len(rows) and all(e.kind == fmt for e in report.examples)
    assert report.file_rows == {str(tmp_path / f"data{suffix}"): len(rows)}


def test_alpaca_becomes_a_user_and_an_assistant_message():
    plain, with_input = (to_messages(r, "auto", "x") for r in ALPACA)
    assert plain.messages == ({"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."})
    assert with_input.messages[0]["content"] == "Translate.\n\nchat"
    system = to_messages({"system": "Be kind.", **ALPACA[0]}, "instruction", "x")
    assert system.messages[0] == {"role": "system", "content": "Be kind."}


def test_sharegpt_roles_are_mapped():
    example = to_messages(SHAREGPT[0], "auto", "x")
    assert [m["role"] for m in example.messages] == ["user", "assistant", "user", "assistant"]
    assert example.messages[1]["content"] == "Hello!"


def test_detect_format_by_fields():
    assert detect_format(OPENAI[0]) == "chat" and detect_format(SHAREGPT[0]) == "chat"
    assert detect_format(ALPACA[0]) == "instruction"
    assert detect_format({**ALPACA[0], "text": "formatted"}) == "instruction"  # tatsu-lab/alpaca has both
    assert detect_format(PROMPT_COMPLETION[0]) == "prompt_completion"
    assert detect_format(TEXT[0]) == "text"
    assert detect_format({"question": "q", "answer": "a"}) is None


def test_explicit_format_overrides_detection(tmp_path):
    path = write(tmp_path / "alpaca.jsonl", [{**r, "text": f"### {r['instruction']}"} for r in ALPACA])
    assert inspect_files([path]).format == "instruction"
    report = inspect_files([path], "text")
    assert report.format == "text" and report.examples[0].text == "### Name a colour."


def test_explicit_format_names_what_the_row_looks_like(tmp_path):
    (message,) = problems_of(write(tmp_path / "d.jsonl", PROMPT_COMPLETION), "instruction")
    assert message == ("d.jsonl:1: the rows look like prompt_completion, but data.format is instruction (field "
                       "'instruction' is missing) (set data.format to prompt_completion or auto)")
    rows = ALPACA + PROMPT_COMPLETION[:1]
    (message,) = problems_of(write(tmp_path / "later.jsonl", rows), "instruction")
    assert message.startswith("later.jsonl:3: field 'instruction' is missing") and "looks like prompt_completion" in message


def test_fields_that_fit_no_format_are_named_whether_or_not_a_format_is_set(tmp_path):
    path = tmp_path / "scores.csv"
    path.write_text("foo,bar\n1,2\n3,4\n")
    message = "cannot tell the row format from its fields (foo, bar)"
    found = [problem.split(" (rows need")[0] for problem in problems_of(path)]
    assert found == [f"scores.csv:{line}: {message}" for line in (2, 3)]
    for fmt, needs in (("instruction", "instruction and output"), ("chat", "messages or conversations")):
        (problem,) = problems_of(path, fmt)  # the first row says it for the file
        assert problem.startswith(f"scores.csv:2: {message}: data.format is {fmt}, whose rows need {needs} ("), fmt


def test_csv_cell_may_hold_a_conversation_as_json(tmp_path):
    path = write(tmp_path / "chat.csv", [{"messages": json.dumps(OPENAI[0]["messages"])}])
    assert inspect_files([path]).examples[0].messages == tuple(OPENAI[0]["messages"])


def test_json_locations_give_index_and_line(tmp_path):
    path = write(tmp_path / "d.json", [ALPACA[0], {"instruction": "x", "output": 3}])
    (message,) = problems_of(path)
    assert message.startswith("d.json[1] (line 7): field 'output' must be text, got a number (3)")


def test_json_object_holding_one_list_and_json_lines_saved_as_json(tmp_path):
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"version": 2, "data": ALPACA}, indent=1))
    assert [e.location for e in inspect_files([wrapped]).examples] == ["wrapped.json[0] (line 4)", "wrapped.json[1] (line 9)"]
    lines = tmp_path / "lines.json"
    write(tmp_path / "lines.jsonl", ALPACA).rename(lines)
    assert inspect_files([lines]).rows == 2
    single = tmp_path / "single.json"
    single.write_text(json.dumps(OPENAI[0]))
    assert inspect_files([single]).rows == 1


def test_json_object_with_several_lists_is_refused(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"train": ALPACA, "test": ALPACA}))
    (message,) = problems_of(path)
    assert "d.json: the top-level object holds several lists (train, test)" in message


def test_locations_per_file_type(tmp_path):
    assert [loc for loc, _ in iter_records(write(tmp_path / "a.csv", ALPACA))] == ["a.csv:2", "a.csv:3"]
    assert [loc for loc, _ in iter_records(write(tmp_path / "a.txt", TEXT))] == ["a.txt:1", "a.txt:3"]
    assert [loc for loc, _ in iter_records(write(tmp_path / "a.parquet", TEXT))] == ["a.parquet row 1", "a.parquet row 2"]


def test_limit_reads_the_first_rows_of_each_file_and_keep_bounds_the_examples(tmp_path):
    a = write(tmp_path / "a.jsonl", ALPACA * 5)
    b = write(tmp_path / "b.jsonl", ALPACA * 5)
    report = inspect_files([a, b], limit=3, keep=4)
    assert (report.rows, report.complete, len(report.examples)) == (6, False, 4)
    assert report.file_rows == {str(a): 3, str(b): 3}


def test_format_is_shared_across_files(tmp_path):
    a = write(tmp_path / "a.jsonl", ALPACA)
    b = write(tmp_path / "b.jsonl", TEXT)
    (first, second) = problems_of([a, b])
    assert first.startswith("b.jsonl:1: mixed formats: this row looks like text, earlier rows are instruction (a.jsonl:1)")


def test_iter_examples_yields_examples_and_raises_at_the_first_problem(tmp_path):
    assert [e.kind for e in iter_examples([write(tmp_path / "a.jsonl", ALPACA)], "instruction")] == ["instruction"] * 2
    with pytest.raises(DataError, match=r"missing_field.jsonl:2: field 'output' is missing") as info:
        list(iter_examples([DATA / "missing_field.jsonl"]))
    assert info.value.kind == "data"


def test_a_ten_megabyte_line_is_read(tmp_path):
    big = "word " * 2_000_000
    path = write(tmp_path / "big.jsonl", [{"prompt": "Summarize:", "completion": big}, PROMPT_COMPLETION[0]])
    report = inspect_files([path], keep=1)
    assert report.rows == 2 and report.examples[0].completion == big
    assert inspect_files([write(tmp_path / "big.csv", [{"text": big}])]).rows == 1


# ---------------------------------------------------------------- the bad-input corpus (tests/data)


@pytest.mark.parametrize("name, expected", [
    ("truncated.jsonl", ["truncated.jsonl:3: not valid JSON: the line ends before the object does"]),
    ("invalid_utf8.jsonl", ["invalid_utf8.jsonl:2: not valid UTF-8: byte 0xe9 at byte offset 96"]),
    ("wrong_columns.jsonl", ["wrong_columns.jsonl:1: cannot tell the row format from its fields (question, answer)",
                             "wrong_columns.jsonl:2: cannot tell"]),
    ("missing_field.jsonl", ["missing_field.jsonl:2: field 'output' is missing"]),
    ("empty_rows.jsonl", ["empty_rows.jsonl:2: field 'instruction' is missing",
                          "empty_rows.jsonl:3: field 'output' is empty",
                          "empty_rows.jsonl:4: field 'instruction' is empty",
                          "empty_rows.jsonl:5: field 'output' is empty (null)"]),
    ("mixed_formats.jsonl", ["mixed_formats.jsonl:3: mixed formats: this row looks like prompt_completion, earlier rows are instruction",
                             "mixed_formats.jsonl:4: mixed formats: this row looks like chat, earlier rows are instruction"]),
    ("not_objects.jsonl", ["not_objects.jsonl:2: expected a JSON object {...}, got a list",
                           "not_objects.jsonl:3: expected a JSON object {...}, got text 'just text'"]),
    ("semicolon.csv", ["semicolon.csv:1: the header is a single column 'prompt;completion': the file seems to separate columns with semicolons"]),
    ("ragged.csv", ["ragged.csv:3: the row has 3 values but the header has 2 columns",
                    "ragged.csv:6: the row has 1 value but the header has 2 columns"]),
    ("broken.json", ["broken.json:4: not valid JSON: Expecting ',' delimiter"]),
    ("empty.jsonl", ["empty.jsonl: the file is empty: no rows"]),
    ("blank.txt", ["blank.txt: no rows"]),
    ("chat_out_of_order.jsonl", [
        "chat_out_of_order.jsonl:2: messages[0]: the conversation starts with an assistant turn",
        "chat_out_of_order.jsonl:3: messages[1]: two user turns in a row",
        "chat_out_of_order.jsonl:4: messages[1].role 'bot' is not one of system, user, assistant",
        "chat_out_of_order.jsonl:5: messages[2] is a system turn after the start",
        "chat_out_of_order.jsonl:6: field 'messages' does not end with an assistant turn",
        "chat_out_of_order.jsonl:7: field 'messages' does not end with an assistant turn",
        "chat_out_of_order.jsonl:8: messages[1].content is missing",
        "chat_out_of_order.jsonl:9: messages[1].content[0] must be a text or image part, got text 'Hello'",
        "chat_out_of_order.jsonl:10: field 'messages' has no turns"]),
    ("sharegpt_bad.jsonl", ["sharegpt_bad.jsonl:2: conversations[1].from 'bing' is not one of system, human, gpt",
                            "sharegpt_bad.jsonl:3: conversations[0]: the conversation starts with an assistant turn",
                            "sharegpt_bad.jsonl:4: conversations[1].value is missing"]),
])
def test_bad_inputs_name_file_line_and_field(name, expected):
    messages = problems_of(DATA / name)
    assert len(messages) == len(expected)
    for message, start in zip(messages, expected):
        assert message.startswith(start), (message, start)


def test_parquet_with_wrong_types(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "typed.parquet"
    pq.write_table(pa.table({"prompt": ["2+2=", "3+3="], "completion": [4, 6]}), path)
    assert problems_of(path) == ["typed.parquet row 1: field 'completion' must be text, got a number (4)",
                                 "typed.parquet row 2: field 'completion' must be text, got a number (6)"]
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"instruction": ["a", "b"], "input": [None, None], "output": ["x", None]}), nulls)
    assert problems_of(nulls) == ["nulls.parquet row 2: field 'output' is empty (null)"]


def test_unreadable_and_unsupported_files(tmp_path):
    (missing,) = problems_of(tmp_path / "nope.jsonl")
    assert missing.startswith("nope.jsonl: cannot read the file: No such file or directory")
    (folder,) = problems_of(tmp_path)
    assert "is a folder, not a data file: choose the files inside it" in folder
    (xlsx,) = problems_of(write(tmp_path / "d.jsonl", TEXT).rename(tmp_path / "d.xlsx"))
    assert xlsx.startswith("d.xlsx: unsupported file type '.xlsx'")
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all")
    (parquet,) = problems_of(garbage)
    assert parquet.startswith("garbage.parquet: not a readable Parquet file")


def test_a_directory_is_refused(tmp_path):
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()
    (message,) = problems_of(folder)
    assert message.startswith("folder.jsonl: ") and "is a folder, not a data file: choose the files inside it" in message


def test_invalid_utf8_in_csv_and_json(tmp_path):
    csv_path = tmp_path / "latin.csv"
    csv_path.write_bytes(b"text\nok\ncaf\xe9\n")
    assert problems_of(csv_path) == ["latin.csv:3: not valid UTF-8: byte 0xe9 at byte offset 11 of the file (save the file as UTF-8)"]
    json_path = tmp_path / "latin.json"
    json_path.write_bytes(b'[\n{"text": "caf\xe9"}\n]')
    (message,) = problems_of(json_path)
    assert message.startswith("latin.json:2: not valid UTF-8: byte 0xe9")


def test_byte_order_mark_is_ignored(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbfprompt,completion\n2+2=,4\n")
    assert inspect_files([path]).examples[0].prompt == "2+2="


def test_problems_are_capped(tmp_path):
    path = write(tmp_path / "bad.jsonl", [{"instruction": "x"}] * (MAX_PROBLEMS + 5))
    messages = problems_of(path)
    assert len(messages) == MAX_PROBLEMS + 1 and messages[-1] == f"stopped checking after {MAX_PROBLEMS} problems"


def test_problems_of_several_files_are_collected_together():
    messages = problems_of([DATA / "missing_field.jsonl", DATA / "empty.jsonl", DATA / "semicolon.csv"])
    assert [m.split(":")[0] for m in messages] == ["missing_field.jsonl", "empty.jsonl", "semicolon.csv"]


def test_iter_records_raises_for_a_bad_file():
    with pytest.raises(DataError, match="truncated.jsonl:3"):
        list(iter_records(DATA / "truncated.jsonl"))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.fixed_dictionaries({"instruction": st.text(min_size=1).filter(str.strip),
                                        "output": st.text(min_size=1).filter(str.strip)}), min_size=1, max_size=6),
       st.sampled_from([None, 0, 2]))
def test_json_rows_round_trip_with_their_lines(tmp_path_factory, rows, indent):
    path = tmp_path_factory.mktemp("json") / "rows.json"
    text = json.dumps(rows, indent=indent)
    path.write_text(text, encoding="utf-8")
    examples = inspect_files([path]).examples
    assert [e.messages[1]["content"] for e in examples] == [r["output"] for r in rows]
    lines = text.split("\n")
    for index, example in enumerate(examples):
        line = int(example.location.split("line ")[1].rstrip(")"))
        assert example.location.startswith(f"rows.json[{index}]")
        assert json.dumps(rows[index], indent=indent).split("\n")[0] in lines[line - 1]


def test_core_dataset_loads_pyarrow_only_for_parquet():
    code = "import sys, studio.core.data.dataset, studio.core.data.templates; print('pyarrow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.stdout.strip() == "False"


# ---------------------------------------------------------------- built-in templates

CHAT = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye!"})


def test_chatml_marks_assistant_content_and_end_marker_trainable():
    segments = templates.render("chatml", CHAT)
    assert "".join(t for t, _ in segments) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        "Hello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\nBye!<|im_end|>")
    assert [t for t, trainable in segments if trainable] == ["Hello!<|im_end|>", "Bye!<|im_end|>"]


def test_generation_prompt_is_the_text_before_the_last_response():
    prompt = templates.generation_prompt("chatml", CHAT)
    assert prompt.endswith("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")
    assert prompt == templates.generation_prompt("chatml", CHAT[:-1])  # ending with the user turn
    assert prompt == "".join(t for t, _ in templates.prompt_segments(templates.render("chatml", CHAT)))


def test_alpaca_template_is_single_turn():
    example = to_messages({"system": "Be kind.", **ALPACA[1]}, "instruction", "x")
    assert templates.render("alpaca", example.messages, "</s>") == [
        ("Be kind.\n\n### Instruction:\nTranslate.\n\nchat\n\n### Response:\n", False), ("cat</s>", True)]
    assert templates.generation_prompt("alpaca", example.messages) == \
        "Be kind.\n\n### Instruction:\nTranslate.\n\nchat\n\n### Response:\n"
    with pytest.raises(DataError, match="one instruction and its response; this conversation has 4") as info:
        templates.render("alpaca", CHAT)
    assert "chatml" in info.value.hint


def test_unknown_template_is_refused():
    with pytest.raises(DataError, match="'vicuna' is not a built-in template"):
        templates.render("vicuna", CHAT)


def test_example_is_frozen():
    example = Example("text", text="x")
    with pytest.raises(AttributeError):
        example.text = "y"


def test_data_problems_say_to_fix_the_rows_named_not_fields(tmp_path):
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\nnot json\n')
    with pytest.raises(ProblemsError) as caught:
        inspect_files([bad])
    assert "rows.jsonl:2" in caught.value.message and "fix the rows and files named above" in caught.value.hint


def test_prompt_only_rows_are_read_for_grpo_and_refused_by_line_and_field(tmp_path):
    from studio.core.presets import demo_config

    rows = [{"prompt": "What is 2+2?", "answer": "4"},
            {"prompt": [{"role": "user", "content": "And 3+3?"}], "solution": 6}]
    path = write(tmp_path / "math.jsonl", rows)
    fmt = demo_config().replace(objective="grpo").row_format
    report = inspect_files([path], fmt)
    assert report.format == "prompt_only" and [e.reference for e in report.examples] == ["4", "6"]
    assert detect_format(rows[0]) is None  # a prompt alone is never detected: grpo reads its rows so
    write(tmp_path / "bad.jsonl", [rows[0], {"question": "x"}, {"prompt": "q", "answer": {"value": 1}}])
    with pytest.raises(ProblemsError) as caught:
        inspect_files([tmp_path / "bad.jsonl"], fmt)
    assert [str(p) for p in caught.value.problems] == [
        "bad.jsonl:2: field 'prompt' is missing", "bad.jsonl:3: field 'answer' must be text or a number, got an object"]


def test_grpo_reads_supervised_rows_as_prompts_with_their_answers_as_references(tmp_path):
    """A user's SFT data (GSM8K as instruction rows, a chat export, prompt/completion pairs) trains GRPO as it is."""
    from studio.core.presets import DEMO_TRAIN, demo_config

    fmt = demo_config().replace(objective="grpo").row_format
    rows = {"instruction": {"instruction": "What is 2+3?", "input": "Show the sum.", "output": "#### 5"},
            "chat": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                                  {"role": "assistant", "content": "4"}]},
            "completion": {"prompt": "a plum is a", "completion": " kind of fruit ."},
            "own reference": {"instruction": "3+3?", "output": "It is six.", "answer": "6"}}
    examples = {name: inspect_files([write(tmp_path / f"{index}.jsonl", [row])], fmt).examples[0]
                for index, (name, row) in enumerate(rows.items())}
    assert all(e.kind == "prompt_only" for e in examples.values())
    assert examples["instruction"].messages == ({"role": "user", "content": "What is 2+3?\n\nShow the sum."},)
    assert examples["instruction"].reference == "#### 5"
    assert [m["role"] for m in examples["chat"].messages] == ["system", "user"] and examples["chat"].reference == "4"
    assert examples["completion"].prompt == "a plum is a" and examples["completion"].reference == " kind of fruit ."
    assert examples["own reference"].reference == "6"  # a reference column wins over the answer
    assert examples["instruction"].row["reference"] == "#### 5"  # where the rewards read it
    assert "reference" not in examples["own reference"].row
    assert inspect_files([DEMO_TRAIN], fmt).format == "prompt_only"  # the SFT demo trains grpo as it is
