"""Security defaults: remote code only on request and with a warning naming the revision, weights from
safetensors (pickle only through torch's weights_only loader), and a Hub token never written anywhere."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from helpers import quick_config
from studio.core.config import RunConfig
from studio.core.model.check import resolved_revision
from studio.core.presets import DEMO_MODEL
from studio.core.run.events import EventWriter, read_events
from studio.train.preflight import check_inputs, weight_load_kwargs

ROOT = Path(__file__).resolve().parents[1]
FAKE_TOKEN = "hf_StudioLeakCanary_7f3a9c2e41d8b6"


def warnings_of(config: RunConfig, tmp_path: Path) -> list[dict]:
    """The warning events the worker emits before loading (check_inputs is its first step)."""
    with_events = tmp_path / "events.jsonl"
    events = EventWriter(with_events)
    check_inputs(config, events)
    events.close()
    return [e for e in read_events(with_events) if e["type"] == "warning"]


def test_remote_code_is_off_by_default_and_warned_about_with_the_revision_when_on(tmp_path, small_data):
    config = quick_config(small_data)
    assert RunConfig().model.trust_remote_code is False and config.model.trust_remote_code is False
    assert warnings_of(config, tmp_path / "off") == []
    (warning,) = warnings_of(config.replace(model={"trust_remote_code": True}), tmp_path / "on")
    assert f"Python code shipped with {DEMO_MODEL} will run" in warning["message"]
    assert "local folder" in warning["message"] and "no Hub revision" in warning["message"]
    assert "pin model.revision" in warning["hint"]


def test_the_revision_of_a_hub_model_resolves_to_its_commit_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    refs = tmp_path / "hub" / "models--acme--tiny" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text(commit)
    (refs / "v1").write_text(commit)
    assert resolved_revision("acme/tiny") == f"commit {commit} (default branch)"
    assert resolved_revision("acme/tiny", "v1") == f"commit {commit} (v1)"
    assert resolved_revision("acme/other", "v2") == "revision v2"
    assert resolved_revision("acme/other") == "the default branch (not pinned to a commit)"


def test_gui_toggle_is_off_by_default_and_shows_the_warning_when_on(qtbot):
    from studio.core.presets import demo_config
    from studio.gui.panels.model import ModelPanel
    from studio.gui.state.settings import AppSettings
    from studio.gui.widgets.common import ConfigStore

    store = ConfigStore(demo_config())
    panel = ModelPanel(store, AppSettings())
    qtbot.addWidget(panel)
    assert not panel.trust_remote_code.check.isChecked() and not panel.remote_code_warning.isVisibleTo(panel)
    panel.trust_remote_code.check.setChecked(True)
    assert store.config.model.trust_remote_code is True
    assert panel.remote_code_warning.isVisibleTo(panel)
    assert str(DEMO_MODEL) in panel.remote_code_warning.text() and "no Hub revision" in panel.remote_code_warning.text()
    panel.trust_remote_code.check.setChecked(False)
    assert not panel.remote_code_warning.isVisibleTo(panel)


# ---------------------------------------------------------------- weights


def test_safetensors_are_required_when_present_and_pickle_loads_only_weights_only(tmp_path, small_data):
    assert weight_load_kwargs(quick_config(small_data)) == {"weights_only": True, "use_safetensors": True}
    pickled = tmp_path / "pickled"
    shutil.copytree(DEMO_MODEL, pickled)
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"")  # only its presence matters here
    config = quick_config(small_data, model={"name_or_path": str(pickled)})
    assert weight_load_kwargs(config) == {"weights_only": True}
    (warning,) = warnings_of(config, tmp_path)
    assert "pickle" in warning["message"] and "weights_only=True" in warning["message"]


@pytest.mark.slow  # importing the transformers model code takes ~10 s on its own
def test_a_pickle_checkpoint_that_runs_code_is_refused(tmp_path, small_data, capsys):
    """A .bin whose unpickling would run a command: transformers' weights_only loader refuses it."""
    import pickle

    import torch

    from studio.core.errors import StudioError
    from studio.train.model.build import load_base_model

    class Exploit:
        def __reduce__(self):
            return (print, ("pickle code ran",))

    folder = tmp_path / "evil"
    shutil.copytree(DEMO_MODEL, folder)
    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": Exploit()}, folder / "pytorch_model.bin", pickle_module=pickle)
    config = quick_config(small_data, model={"name_or_path": str(folder)})
    with pytest.raises(StudioError, match="refused to load the weights of .*evil: the PyTorch pickle file holds") as caught:
        load_base_model(config, torch.device("cpu"))
    assert "safetensors" in caught.value.hint and "weights_only` set to `False`" not in str(caught.value)
    assert "pickle code ran" not in capsys.readouterr().out


def torch_load_calls() -> list[tuple[Path, ast.Call]]:
    """Every ``torch.load(...)`` call in studio/; importing ``load`` from torch under another name fails instead."""
    calls = []
    for path in (ROOT / "studio").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "torch":
                assert "load" not in {alias.name for alias in node.names}, f"{path}: call torch.load by its full name"
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                calls.append((path, node))
    return calls


def test_every_torch_load_in_studio_passes_weights_only_true():
    calls = torch_load_calls()
    assert calls, "the scan found no torch.load at all: is it still looking at the right code?"
    for path, node in calls:
        flag = next((k.value for k in node.keywords if k.arg == "weights_only"), None)
        assert isinstance(flag, ast.Constant) and flag.value is True, \
            f"{path.relative_to(ROOT)}:{node.lineno}: torch.load without weights_only=True"


# ---------------------------------------------------------------- the Hub token


@pytest.mark.slow
def test_a_hub_token_is_never_written_into_runs_logs_or_exports(tmp_path, small_data, monkeypatch):
    from studio.cli import main
    from studio.train.export.hf_format import export_run
    from studio.train.worker import run

    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", FAKE_TOKEN)
    config = quick_config(small_data, model={"trust_remote_code": True},
                          training={"max_steps": 2}, schedule={"save_every": 1})
    code, run_dir = run(config, tmp_path / "run", watch_stdin=False)
    assert code == 0
    export_run(run_dir.path, "adapter")
    export_run(run_dir.path, "merged")
    assert main(["bundle", str(run_dir.config), "--hosts", "node1,node2", "--gpus-per-host", "2",
                 "--out", str(tmp_path / "bundle")]) == 0

    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "adapter_model.safetensors" for p in written) and any(p.name == "events.jsonl" for p in written)
    leaks = [p for p in written if FAKE_TOKEN.encode() in p.read_bytes()]
    assert leaks == [], f"the token was written into {leaks}"
    for event in read_events(run_dir.events):  # no environment dump either
        assert "HF_TOKEN" not in json.dumps(event) and "HUGGING_FACE_HUB_TOKEN" not in json.dumps(event)
    assert any(e["type"] == "warning" and "trust_remote_code" in e["message"] for e in read_events(run_dir.events))
