"""The Hugging Face Hub without the network: publishing an export (refusals, what is uploaded, the
token kept out of the run), Hub datasets in data.train_files, and TRL's conversational rows."""

import json

import huggingface_hub
import pytest

from helpers import quick_config
from studio.cli import main
from studio.core.config import load_config, save_config
from studio.core.data.dataset import inspect_files
from studio.core.data.hub import HubDataset, parse_hub_spec, rows_file
from studio.core.data.row_formats import DataError, detect_format, to_messages
from studio.core.errors import ProblemsError, StudioError
from studio.core.export.model_card import front_matter, model_card
from studio.core.run.commands import EXIT_OK, EXIT_USAGE
from studio.core.validation import validate
from studio.train.data.hub import load_hub_datasets
from studio.train.export import hf_format as export_module
from studio.train.worker import run

SECRET = "hf_sentinelTokenThatMustNeverBeWritten"


# ---------------------------------------------------------------- publishing


@pytest.fixture
def online(monkeypatch):
    """As if the Hub were reachable (conftest switches it off): refusals then come from the login."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)


def refuse_export_work(monkeypatch):
    def no_export(*args, **kwargs):
        raise AssertionError("the export started before the push was refused")

    monkeypatch.setattr(export_module, "export_run", no_export)


def test_offline_push_is_refused_before_any_export_work(monkeypatch, tmp_path, capsys):
    refuse_export_work(monkeypatch)
    assert main(["export", str(tmp_path), "--adapter", "--push-to-hub", "me/tune"]) == EXIT_USAGE
    assert "HF_HUB_OFFLINE" in capsys.readouterr().err


def test_a_push_without_a_login_is_refused_before_any_export_work(monkeypatch, tmp_path, capsys, online):
    refuse_export_work(monkeypatch)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    assert main(["export", str(tmp_path), "--merged", "--push-to-hub", "me/tune"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "not logged in" in err and "hf auth login" in err


@pytest.mark.parametrize("repo_id", ["tune", "me/tune/extra", "me/", "me/my tune"])
def test_a_malformed_repository_id_is_refused(monkeypatch, tmp_path, capsys, repo_id):
    refuse_export_work(monkeypatch)
    assert main(["export", str(tmp_path), "--adapter", "--push-to-hub", repo_id]) == EXIT_USAGE
    assert "OWNER/NAME" in capsys.readouterr().err


def test_private_without_a_push_is_refused(monkeypatch, tmp_path, capsys):
    refuse_export_work(monkeypatch)
    assert main(["export", str(tmp_path), "--adapter", "--private"]) == EXIT_USAGE
    assert "--push-to-hub" in capsys.readouterr().err


class FakeHfApi:
    """Records what would go to the Hub: the repository made and the files an upload_folder call sends."""

    calls: list = []
    progress_shown = False

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, repo_id, folder_path, ignore_patterns=(), **kwargs):
        from pathlib import Path

        sent = sorted(p.relative_to(folder_path).as_posix() for p in Path(folder_path).rglob("*")
                      if p.is_file() and p.name not in ignore_patterns)
        self.calls.append(("upload_folder", repo_id, sent))
        type(self).progress_shown = not huggingface_hub.utils.are_progress_bars_disabled()


@pytest.mark.slow
def test_publish_uploads_the_verified_export_with_its_card_and_never_writes_the_token(
        tmp_path, small_data, monkeypatch, capsys, online):
    config = quick_config(small_data, training={"max_steps": 2})
    code, run_dir = run(config, tmp_path / "run", watch_stdin=False)
    assert code == EXIT_OK
    monkeypatch.setenv("HF_TOKEN", SECRET)
    FakeHfApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)

    assert main(["export", str(run_dir.path), "--adapter", "--push-to-hub", "me/tiny-tune", "--private"]) == EXIT_OK
    out = capsys.readouterr().out
    (_, repo, options), (_, _, sent) = FakeHfApi.calls
    assert repo == "me/tiny-tune" and options == {"private": True, "exist_ok": True}
    assert sent == ["README.md", "adapter_config.json", "adapter_model.safetensors", "chat_template.jinja",
                    "generation_config.json", "studio_export.json", "tokenizer.json", "tokenizer_config.json"]
    assert all(name in out for name in sent) and "published: https://huggingface.co/me/tiny-tune" in out
    assert FakeHfApi.progress_shown  # the export turned huggingface_hub's bars off; the upload shows its own
    card = (run_dir.exports_dir / "adapter" / "README.md").read_text()
    assert 'AutoPeftModelForCausalLM.from_pretrained("me/tiny-tune")' in card
    for path in run_dir.path.rglob("*"):
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path


# ---------------------------------------------------------------- Hub datasets


@pytest.mark.parametrize("spec, expected", [
    ("hub:tatsu-lab/alpaca", HubDataset("tatsu-lab/alpaca", "", "train")),
    ("hub:HuggingFaceH4/ultrachat_200k:train_sft", HubDataset("HuggingFaceH4/ultrachat_200k", "", "train_sft")),
    ("hub:openai/gsm8k@main:test", HubDataset("openai/gsm8k", "main", "test")),
    ("hub:squad", HubDataset("squad", "", "train")),
])
def test_hub_dataset_names_parse(spec, expected):
    assert parse_hub_spec(spec) == expected
    assert str(parse_hub_spec(str(expected))) == str(expected)


def test_validation_checks_a_hub_name_but_never_looks_for_it_as_a_file(small_data, tmp_path):
    config = quick_config(small_data).replace(data={"train_files": ("hub:someone/tiny@default:train", "hub:bad name")})
    problems = validate(config, check_files=True)
    assert [p.where for p in problems] == ["data.train_files[1]"]
    assert "not a Hub dataset name" in problems[0].message and "hub:OWNER/NAME" in problems[0].hint
    path = tmp_path / "run.yaml"  # relative paths become absolute on loading; a Hub name stays a name
    save_config(config.replace(data={"train_files": ("hub:someone/tiny", "local.jsonl")}), path)
    assert load_config(path).data.train_files == ("hub:someone/tiny", str(tmp_path / "local.jsonl"))


def test_an_uncached_hub_dataset_offline_is_a_clear_error_naming_it(small_data):
    config = quick_config(small_data).replace(data={"train_files": ("hub:someone/never-downloaded",)})
    with pytest.raises(StudioError, match="someone/never-downloaded") as error:
        load_hub_datasets(config)
    assert "HF_HUB_OFFLINE" in error.value.hint


TRL_ROWS = [{"prompt": [{"role": "user", "content": f"What kind of thing is a {word}?"}],
             "completion": [{"role": "assistant", "content": f"a {kind}"}]}
            for word, kind in [("plum", "fruit"), ("cat", "animal"), ("oak", "tree"), ("rose", "flower")] * 4]


@pytest.fixture
def cached_hub_dataset(tmp_path, monkeypatch):
    """someone/tiny in a datasets cache, laid out as a download would leave it, and an empty rows folder."""
    from datasets import config as datasets_config
    from datasets.packaged_modules.json.json import Json

    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in TRL_ROWS))
    cache = tmp_path / "datasets-cache"
    Json(cache_dir=str(cache), dataset_name="someone___tiny", config_name="default", data_files={"train": str(source)},
         hash="0123abcd").download_and_prepare()
    built = next((cache / "someone___tiny").glob("default-*"))
    built.rename(built.with_name("default"))
    version = cache / "someone___tiny" / "default" / "0.0.0" / "0123abcd"
    (version / "someone___tiny-train.arrow").rename(version / "tiny-train.arrow")  # the Hub loader's file name
    monkeypatch.setattr(datasets_config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("STUDIO_HUB_ROWS", str(tmp_path / "rows"))
    return "hub:someone/tiny"


def test_a_cached_hub_dataset_loads_offline_and_reads_like_a_file(small_data, cached_hub_dataset):
    config = quick_config(small_data).replace(data={"train_files": (cached_hub_dataset,), "format": "auto"})
    with pytest.raises(ProblemsError, match="not been loaded on this machine yet"):
        inspect_files(config.data.train_files)
    assert load_hub_datasets(config) == [HubDataset("someone/tiny")]
    assert rows_file(HubDataset("someone/tiny")).is_file()
    report = inspect_files(config.data.train_files)
    assert report.format == "chat" and report.rows == len(TRL_ROWS)
    assert report.examples[0].location == "hub:someone/tiny row 1"
    assert report.examples[0].messages[-1] == {"role": "assistant", "content": "a fruit"}


def test_config_check_loads_a_hub_dataset_and_counts_its_rows(small_data, cached_hub_dataset, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    save_config(quick_config(small_data).replace(data={"train_files": (cached_hub_dataset,), "format": "auto"}), path)
    assert main(["config", "check", str(path)]) == EXIT_OK
    assert f"{len(TRL_ROWS)} training rows in chat format" in capsys.readouterr().out


def test_a_missing_split_names_the_valid_ones(small_data, cached_hub_dataset):
    config = quick_config(small_data).replace(data={"train_files": (cached_hub_dataset + ":test",)})
    with pytest.raises(StudioError, match="train"):
        load_hub_datasets(config)


@pytest.mark.slow
def test_a_run_trains_on_a_cached_hub_dataset_of_trl_conversational_rows(tmp_path, small_data, cached_hub_dataset):
    config = quick_config(small_data).replace(data={"train_files": (cached_hub_dataset,), "format": "auto"},
                                              training={"max_steps": 2})
    code, run_dir = run(config, tmp_path / "run", watch_stdin=False)
    assert code == EXIT_OK
    started = next(e for e in map(json.loads, run_dir.events.read_text().splitlines()) if e["type"] == "run_started")
    assert started["data"]["train"]["rows"] == len(TRL_ROWS) and started["data"]["train"]["format"] == "chat"


def test_the_model_card_names_hub_ids_in_its_metadata(small_data):
    config = quick_config(small_data).replace(model={"name_or_path": "someone/base-model", "revision": "v1"},
                                              data={"train_files": ("hub:someone/tiny@default:train", str(small_data))})
    events = [{"type": "step", "step": 3, "loss": 1.25}, {"type": "eval", "step": 3, "eval_loss": 1.5},
              {"type": "evaluation", "checkpoint": "step-000003", "data": ["/data/held_out.jsonl"],
               **{model: {"rows": 4, "tokens": 40, "loss": loss, "perplexity": 2.0, "answered": 4, "exact_match": match,
                          "contains": match, "f1": match} for model, loss, match in (("base", 2.0, 0.0),
                                                                                     ("tuned", 0.5, 0.75))}}]
    card = model_card(config, events, {"kind": "adapter", "dtype": "float32"}, "mit", load_path="me/tune")
    assert "| final train loss | 1.2500 |" in card and "| final eval loss | 1.5000 (step 3) |" in card
    assert "| exact match | 0.0% | 75.0% |" in card and "(`held_out.jsonl`), checkpoint `step-000003`" in card
    meta = front_matter(card)
    assert meta["base_model"] == "someone/base-model" and meta["datasets"] == ["someone/tiny"]
    assert meta["license"] == "mit" and meta["library_name"] == "peft"
    assert "base_model:adapter:someone/base-model" in meta["tags"] and "(revision `v1`)" in card


# ---------------------------------------------------------------- TRL's conversational rows


def test_trl_conversational_prompt_completion_rows_are_chats():
    row = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
           "completion": [{"role": "assistant", "content": "Hello"}]}
    assert detect_format(row) == "chat"
    assert [m["role"] for m in to_messages(row, "auto", "x.jsonl:1").messages] == ["system", "user", "assistant"]
    assert detect_format({"prompt": "Hi", "completion": "Hello"}) == "prompt_completion"


def test_broken_trl_rows_name_the_turn():
    with pytest.raises(DataError, match=r"x.jsonl:3: completion\[0\].role 'robot'"):
        to_messages({"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "robot", "content": "x"}]},
                    "auto", "x.jsonl:3")
    with pytest.raises(DataError, match="set data.format to chat"):
        to_messages(TRL_ROWS[0], "prompt_completion", "x.jsonl:1")


def test_a_cluster_bundle_keeps_a_hub_dataset_as_a_name(tmp_path, small_data):
    from studio.core.run.bundle import CONFIG_NAME, parse_hosts, write_bundle

    config = quick_config(small_data).replace(data={"train_files": ("hub:someone/tiny", str(small_data))},
                                              distributed={"num_processes": 2})
    bundle = write_bundle(config, parse_hosts("10.0.0.1,10.0.0.2"), 1, tmp_path / "bundle")
    written = load_config(bundle.folder / CONFIG_NAME).data.train_files
    assert written[0] == "hub:someone/tiny" and written[1] == str(bundle.folder / "data" / small_data.name)
