"""The bad-input corpus through the commands a user runs: every malformed data file, model folder and
config is refused by `studio config check` and `studio train` with a non-zero exit and a message that
names what is wrong and where (file and line, or field and YAML line), and nothing is written into the
folder that holds the bad input.

Small inputs live in tests/data (see its README); big or binary ones and broken model folders are
made here in the test's own "user folder".
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml

from studio.cli import main
from studio.core.presets import DEMO_MODEL, DEMO_TRAIN, RESOURCES
from studio.core.run.events import read_events

DATA = Path(__file__).parent / "data"
CONFIGS = DATA / "configs"
# exit codes of (config check, train): a refused config or data exits 2, a model that cannot load 1
CONFIG, DATA_FILE, MODEL = (2, 2), (2, 1), (1, 1)


@dataclass(frozen=True)
class Case:
    make: Callable[[Path], Path]  # writes the bad input into the user's folder, returns the config file
    expected: tuple[str, ...]  # each must appear in the message: what and where
    codes: tuple[int, int]


# ---------------------------------------------------------------- building the inputs


def write_config(folder: Path, model: str | Path, data: str | Path) -> Path:
    """A run config in the user's folder, as `studio config init` would write it, naming the inputs."""
    config = {"name": "bad-input", "model": {"name_or_path": str(model)},
              "data": {"train_files": [str(data)], "max_length": 64}, "training": {"max_steps": 2}}
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def data_file(name: str) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        shutil.copy(DATA / name, folder / name)
        return write_config(folder, DEMO_MODEL, name)
    return make


def generated_data(name: str, write: Callable[[Path], None]) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        write(folder / name)
        return write_config(folder, DEMO_MODEL, name)
    return make


def ten_megabyte_line(path: Path) -> None:
    path.write_text('{"prompt": "Summarize:", "completion": "' + "word " * 2_000_000 + "\n", encoding="utf-8")


def prompt_beyond_max_length(path: Path) -> None:
    """One row whose prompt alone is longer than the config's max_length (64): nothing of its response is left."""
    path.write_text(json.dumps({"instruction": "Repeat: " + "word " * 100, "output": "done"}) + "\n", encoding="utf-8")


def parquet_with_numbers(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["2+2=", "3+3="], "completion": [4, 6]}), path)


def broken_model(breakage: Callable[[Path], None]) -> Callable[[Path], Path]:
    """The demo model copied into the user's folder, then broken."""
    def make(folder: Path) -> Path:
        model = folder / "model"
        shutil.copytree(DEMO_MODEL, model)
        breakage(model)
        return write_config(folder, "./model", DEMO_TRAIN)
    return make


def edit_config_json(**changes) -> Callable[[Path], None]:
    def edit(model: Path) -> None:
        settings = json.loads((model / "config.json").read_text())
        settings.update(changes)
        (model / "config.json").write_text(json.dumps({k: v for k, v in settings.items() if v is not None}))
    return edit


def truncate(name: str, size: int) -> Callable[[Path], None]:
    def cut(model: Path) -> None:
        (model / name).write_bytes((model / name).read_bytes()[:size])
    return cut


def split_into_shards_and_lose_one(model: Path) -> None:
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))


def remove(*names: str) -> Callable[[Path], None]:
    def delete(model: Path) -> None:
        for name in names:
            (model / name).unlink()
    return delete


def config_file(name: str) -> Callable[[Path], Path]:
    """A corpus config copied into the user's folder; its paths to the demo assets made absolute."""
    def make(folder: Path) -> Path:
        text = (CONFIGS / name).read_text(encoding="utf-8").replace("../../../resources", str(RESOURCES))
        (folder / name).write_text(text, encoding="utf-8")
        return folder / name
    return make


CORPUS = {
    # data files (tests/data)
    "truncated jsonl": Case(data_file("truncated.jsonl"), ("truncated.jsonl:3: not valid JSON: the line ends before",), DATA_FILE),
    "invalid utf-8": Case(data_file("invalid_utf8.jsonl"), ("invalid_utf8.jsonl:2: not valid UTF-8: byte 0xe9",), DATA_FILE),
    "wrong columns": Case(data_file("wrong_columns.jsonl"),
                          ("wrong_columns.jsonl:1: cannot tell the row format from its fields (question, answer)",), DATA_FILE),
    "missing field": Case(data_file("missing_field.jsonl"), ("missing_field.jsonl:2: field 'output' is missing",), DATA_FILE),
    "empty rows": Case(data_file("empty_rows.jsonl"), ("empty_rows.jsonl:2: field 'instruction' is missing",
                                                       "empty_rows.jsonl:5: field 'output' is empty (null)"), DATA_FILE),
    "mixed formats": Case(data_file("mixed_formats.jsonl"),
                          ("mixed_formats.jsonl:3: mixed formats: this row looks like prompt_completion",), DATA_FILE),
    "rows not objects": Case(data_file("not_objects.jsonl"), ("not_objects.jsonl:2: expected a JSON object",), DATA_FILE),
    "wrong value types": Case(data_file("wrong_types.jsonl"), (
        "wrong_types.jsonl:2: field 'instruction' must be text, got a number (42)",
        "wrong_types.jsonl:3: field 'output' must be text, got a list",
        "wrong_types.jsonl:4: field 'output' must be text, got true/false"), DATA_FILE),
    "chat turns out of order": Case(data_file("chat_out_of_order.jsonl"), (
        "chat_out_of_order.jsonl:2: messages[0]: the conversation starts with an assistant turn",
        "chat_out_of_order.jsonl:3: messages[1]: two user turns in a row"), DATA_FILE),
    "sharegpt roles": Case(data_file("sharegpt_bad.jsonl"),
                           ("sharegpt_bad.jsonl:2: conversations[1].from 'bing' is not one of",), DATA_FILE),
    "csv with semicolons": Case(data_file("semicolon.csv"),
                                ("semicolon.csv:1: the header is a single column", "semicolons"), DATA_FILE),
    "csv with tabs": Case(data_file("tabs.csv"), ("tabs.csv:1: the header is a single column", "tabs"), DATA_FILE),
    "ragged csv": Case(data_file("ragged.csv"), ("ragged.csv:3: the row has 3 values but the header has 2 columns",), DATA_FILE),
    "broken json": Case(data_file("broken.json"), ("broken.json:4: not valid JSON: Expecting ',' delimiter",), DATA_FILE),
    "empty file": Case(data_file("empty.jsonl"), ("empty.jsonl: the file is empty",), DATA_FILE),
    "only blank lines": Case(data_file("blank.txt"), ("blank.txt: no rows",), DATA_FILE),
    # data files made here
    "a 10 MB line cut off": Case(generated_data("big.jsonl", ten_megabyte_line),
                                 ("big.jsonl:1: not valid JSON: the line ends before the object does",), DATA_FILE),
    "response beyond max_length": Case(generated_data("long_prompt.jsonl", prompt_beyond_max_length), (
        "long_prompt.jsonl:1: the response starts after", "tokens, or shorten the prompt",
        "no row is left to train on"), DATA_FILE),
    "parquet with wrong types": Case(generated_data("typed.parquet", parquet_with_numbers),
                                     ("typed.parquet row 1: field 'completion' must be text, got a number (4)",), DATA_FILE),
    "not parquet": Case(generated_data("garbage.parquet", lambda p: p.write_bytes(b"PAR1 not really")),
                        ("garbage.parquet: not a readable Parquet file",), DATA_FILE),
    "latin-1 csv": Case(generated_data("latin.csv", lambda p: p.write_bytes(b"text\nok\ncaf\xe9\n")),
                        ("latin.csv:3: not valid UTF-8: byte 0xe9",), DATA_FILE),
    # model folders
    "model folder missing": Case(broken_model(shutil.rmtree), ("model.name_or_path", "model: no such model folder"), CONFIG),
    "config.json corrupt": Case(broken_model(lambda m: (m / "config.json").write_text('{"model_type": "llama",\n  "hidden')),
                                ("config.json:2: not valid JSON",), MODEL),
    "config.json without model_type": Case(broken_model(edit_config_json(model_type=None)),
                                           ("config.json: has no model_type",), MODEL),
    "unknown architecture": Case(broken_model(edit_config_json(model_type="florp", architectures=["FlorpForCausalLM"])),
                                 ("config.json: model_type 'florp' (architectures: FlorpForCausalLM) is not an architecture",),
                                 MODEL),
    "weights missing": Case(broken_model(remove("model.safetensors")), ("model: no weights",), MODEL),
    "safetensors cut off": Case(broken_model(truncate("model.safetensors", 100_000)),
                                ("model.safetensors: cut off: 100,000 of",), MODEL),
    "safetensors header only": Case(broken_model(truncate("model.safetensors", 6)),
                                    ("model.safetensors: cut off or not a safetensors file",), MODEL),
    "shard missing": Case(broken_model(split_into_shards_and_lose_one),
                          ("model-00002-of-00002.safetensors: missing: the index lists this shard",), MODEL),
    "tokenizer missing": Case(broken_model(remove("tokenizer.json", "tokenizer_config.json")), ("model: no tokenizer",), MODEL),
    "tokenizer.json corrupt": Case(broken_model(truncate("tokenizer.json", 200)), ("tokenizer.json:", "not valid JSON"), MODEL),
    # configs (tests/data/configs)
    "config: wrong types": Case(config_file("wrong_types.yaml"), (
        "model.trust_remote_code (", "wrong_types.yaml:4): expected true or false, got 'yes'",
        "data.max_length (", "wrong_types.yaml:7): expected a whole number, got '512 tokens'",
        "training.micro_batch_size (", "wrong_types.yaml:9): expected a whole number, got 2.5"), CONFIG),
    "config: unknown keys": Case(config_file("unknown_keys.yaml"), (
        "unknown_keys.yaml:4): unknown field (did you mean 'model.revision'?)",
        "unknown_keys.yaml:7): unknown field (did you mean 'training'?)", "lora.rank ("), CONFIG),
    "config: impossible combinations": Case(config_file("impossible.yaml"), (
        "data.eval_fraction (", "impossible.yaml:8): set together with data.eval_files",
        "quantization.load_in (", "impossible.yaml:10): 4bit weights cannot be fully fine-tuned",
        "distributed.offload_optimizer (", "impossible.yaml:12): offloading needs DeepSpeed ZeRO",
        "distributed.layer_split (", "impossible.yaml:13)"), CONFIG),
    "config: broken yaml": Case(config_file("broken_syntax.yaml"), ("broken_syntax.yaml:5: not valid YAML",), CONFIG),
    "config: not a mapping": Case(config_file("not_a_mapping.yaml"),
                                  ("not_a_mapping.yaml: the top level must be a mapping",), CONFIG),
    "config: newer schema": Case(config_file("newer_schema.yaml"),
                                 ("newer_schema.yaml:1): written by a newer Finetune Studio",), CONFIG),
}


# ---------------------------------------------------------------- the test


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``folder``: size and modification time (ns)."""
    return {str(p.relative_to(folder)): (p.stat().st_size if p.is_file() else -1, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def error_events(runs: Path) -> str:
    texts = []
    for events in runs.glob("*/events.jsonl"):
        texts += [f"{e['message']}\n{e.get('hint', '')}" for e in read_events(events) if e["type"] == "error"]
    return "\n".join(texts)


def assert_names(text: str, expected: tuple[str, ...]) -> None:
    for part in expected:
        assert part in text, f"{part!r} not in:\n{text}"
    assert "Traceback" not in text


def test_the_corpus_covers_every_kind_of_bad_input():
    assert len(CORPUS) >= 25
    documented = (DATA / "README.md").read_text()
    for path in [*DATA.glob("*.*"), *CONFIGS.glob("*.yaml")]:
        if path.name != "README.md":
            assert f"| {path.relative_to(DATA).as_posix()} |" in documented, f"{path.name} is not in tests/data/README.md"


@pytest.mark.parametrize("name", CORPUS)
def test_bad_input_is_refused_naming_what_and_where(name, tmp_path, monkeypatch, capsys):
    case = CORPUS[name]
    user, runs = tmp_path / "user", tmp_path / "runs"
    user.mkdir()
    monkeypatch.setenv("STUDIO_RUNS_DIR", str(runs))
    config = case.make(user)
    before = snapshot(user)

    check_code = main(["config", "check", str(config)])
    check = capsys.readouterr()
    assert check_code == case.codes[0], check.err
    assert_names(check.err, case.expected)
    assert "valid" not in check.out

    train_code = main(["train", str(config)])
    train = capsys.readouterr()
    assert train_code == case.codes[1], train.err
    assert_names(train.err + error_events(runs), case.expected)
    assert not any(runs.glob("*/checkpoints")), "a refused input must not train"

    assert snapshot(user) == before, "nothing may be written into the folder holding the bad input"


# ---------------------------------------------------------------- the app shows the same, readably

GUI_DATA = ("missing field", "chat turns out of order", "a 10 MB line cut off", "parquet with wrong types", "csv with tabs")
GUI_MODELS = {name: case.expected for name, case in CORPUS.items() if case.make.__qualname__.startswith("broken_model")
              and name != "unknown architecture"}  # the app does not import transformers: the worker says that one
GUI_MODELS["model folder missing"] = ("no model folder at ./model", "choose a folder holding config.json")


def assert_readable(text: str, expected) -> None:
    for part in expected:
        assert part in text, f"{part!r} not in:\n{text}"
    assert "Traceback" not in text and 'File "' not in text


def user_config(name: str, tmp_path: Path):
    from studio.core.config import load_config

    user = tmp_path / "user"
    user.mkdir()
    return load_config(CORPUS[name].make(user))


@pytest.mark.parametrize("name", GUI_DATA)
def test_data_panel_shows_a_readable_problem(name, tmp_path, qtbot):
    from studio.gui.panels.data import DataPanel
    from studio.gui.widgets.common import ConfigStore

    panel = DataPanel(ConfigStore(user_config(name, tmp_path)))
    qtbot.addWidget(panel)
    qtbot.waitUntil(lambda: not panel.task.busy and panel.banner.isVisibleTo(panel), timeout=20000)
    assert_readable(panel.banner.text.text(), [html_quoted(e) for e in CORPUS[name].expected])
    assert panel.preview is None


def test_data_panel_names_the_rows_cut_before_their_response_until_the_length_keeps_them(tmp_path, qtbot):
    from studio.gui.panels.data import DataPanel
    from studio.gui.state.model_summary import summarize_model
    from studio.gui.widgets.common import ConfigStore

    store = ConfigStore(user_config("response beyond max_length", tmp_path))
    panel = DataPanel(store)
    qtbot.addWidget(panel)
    panel.set_model(summarize_model(str(DEMO_MODEL)))  # the window passes the model's tokenizer: tokens to count
    qtbot.waitUntil(lambda: not panel.task.busy and panel.preview is not None, timeout=20000)
    assert panel.banner.isVisibleTo(panel) and panel.banner.property("role") == "banner-error"
    text = panel.banner.text.text()
    assert_readable(text, ["long_prompt.jsonl:1: the response starts after", "no row is left to train on"])
    needed = int(re.search(r"raise the Sequence length \(Techniques tab\) to at least (\d+) tokens", text).group(1))
    assert [p.where for p in panel.problems] == ["long_prompt.jsonl:1", ""]  # what Start waits for
    assert panel.summary.text().startswith("<b>1 row</b> · format")

    store.update(data={"max_length": needed})
    assert panel.banner.isHidden() and not panel.problems
    store.update(data={"max_length": 64, "train_files": (*store.config.data.train_files, str(DEMO_TRAIN))})
    qtbot.waitUntil(lambda: not panel.task.busy and len(panel.preview.locations) > 1, timeout=20000)
    text = panel.banner.text.text()  # others still train: a note naming the row, not an error
    assert panel.banner.property("role") == "banner-info" and not panel.problems
    assert_readable(text, [f"1 of {panel.preview.rows:,} training rows is left out", "(long_prompt.jsonl:1: after ",
                           "the run trains on the others; to keep it, raise the Sequence length"])


@pytest.mark.parametrize("name", GUI_MODELS)
def test_model_panel_names_the_broken_file(name, tmp_path, qtbot):
    from studio.gui.panels.model import ModelPanel
    from studio.gui.state.settings import AppSettings
    from studio.gui.widgets.common import ConfigStore

    panel = ModelPanel(ConfigStore(user_config(name, tmp_path)), AppSettings())
    qtbot.addWidget(panel)
    assert panel.banner.isVisibleTo(panel)
    assert_readable(panel.banner.text.text(), [html_quoted(e) for e in GUI_MODELS[name]])
    assert panel.summary is None or not panel.settings.recent_models  # a broken folder is not remembered


def test_model_panel_says_a_model_without_tokenizer_has_none_not_that_it_lacks_a_chat_template(tmp_path, qtbot):
    from studio.gui.panels.model import ModelPanel
    from studio.gui.state.settings import AppSettings
    from studio.gui.widgets.common import ConfigStore

    panel = ModelPanel(ConfigStore(user_config("tokenizer missing", tmp_path)), AppSettings())
    qtbot.addWidget(panel)
    words = panel.facts["Chat template"].text()
    assert "no tokenizer" in words and "no text can go in or out" in words and "ChatML" not in words
    assert "no tokenizer: none of tokenizer.json" in panel.banner.text.text()  # and the banner: what to copy where
    panel.use_model(str(DEMO_MODEL))
    assert panel.facts["Chat template"].text() == "its own (chat rows use it)"


@pytest.mark.parametrize("name, expected", [
    ("config: wrong types", ("“Run Python code shipped with the model (trust_remote_code)” (",  # by the labels
                             "last-choices.yaml:4): expected true or false",
                             "“Learning rate” (", "last-choices.yaml:10): expected a number")),
    ("config: broken yaml", ("last-choices.yaml:5: not valid YAML",)),
])
def test_unreadable_last_choices_are_explained_when_the_app_opens(name, expected, tmp_path, qtbot, monkeypatch):
    from studio.core.presets import demo_config
    from studio.gui.main_window import MainWindow

    monkeypatch.setenv("STUDIO_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("STUDIO_RUNS_DIR", str(tmp_path / "runs"))
    (tmp_path / "config").mkdir()
    CORPUS[name].make(tmp_path / "config").rename(tmp_path / "config" / "last-choices.yaml")
    window = MainWindow(attach_live_runs=False)
    window.ask_close_choice = lambda: "stop"
    qtbot.addWidget(window)
    assert window.notice.isVisibleTo(window) and window.store.config == demo_config()
    assert_readable(window.notice.text.text(), expected + ("last-choices.yaml.broken", "demo preset"))


def html_quoted(text: str) -> str:
    import html

    return html.escape(text)
