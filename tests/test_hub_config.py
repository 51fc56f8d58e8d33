"""A Hub model's config.json through huggingface_hub: its cache (offline too), HF_ENDPOINT, the saved token,
and a clear message when it is nowhere to be had."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from model_factory import tiny_config

from studio.core.errors import StudioError
from studio.core.model.info import load_model_config

COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROOT = Path(__file__).resolve().parent.parent


def cache_model(cache: Path, repo_id: str, config: dict, ref: str = "main") -> None:
    """Lay out ``repo_id``'s config.json in ``cache`` as huggingface_hub does (refs, then snapshots by commit)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(config))


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


def test_a_cached_hub_config_is_read_offline_by_branch_tag_or_commit(offline_cache):
    config = tiny_config("llama")
    cache_model(offline_cache, "acme/tiny", config)
    cache_model(offline_cache, "acme/tiny", config, ref="v1")
    assert load_model_config("acme/tiny") == config
    assert load_model_config("acme/tiny", "v1") == config
    assert load_model_config("acme/tiny", COMMIT) == config
    assert load_model_config("acme/tiny", allow_network=False) == config


def test_offline_with_nothing_cached_names_the_model_and_what_to_do(offline_cache, monkeypatch):
    with pytest.raises(StudioError) as raised:
        load_model_config("acme/missing")
    assert "'acme/missing'" in raised.value.message and "HF_HUB_OFFLINE" in raised.value.message
    assert "hf download acme/missing config.json" in raised.value.hint
    assert "local folder" in raised.value.hint
    monkeypatch.delenv("HF_HUB_OFFLINE")  # the window's per-keystroke lookups never go online either
    with pytest.raises(StudioError, match="acme/missing.*not in the Hugging Face cache"):
        load_model_config("acme/missing", allow_network=False)


class _FakeHub(BaseHTTPRequestHandler):
    """Serves one repository's config.json the way the Hub's resolve endpoint does."""

    body = b""
    seen_tokens: list = []

    def _answer(self, with_body: bool) -> None:
        type(self).seen_tokens.append(self.headers.get("authorization"))
        if self.path.split("?")[0] != "/acme/gated-tiny/resolve/main/config.json":
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.send_header("ETag", '"abc123"')
        self.send_header("X-Repo-Commit", COMMIT)
        self.end_headers()
        if with_body:
            self.wfile.write(self.body)

    def do_HEAD(self):  # noqa: N802 (http.server's names)
        self._answer(False)

    def do_GET(self):  # noqa: N802
        self._answer(True)

    def log_message(self, *args):
        pass


def test_a_hub_config_is_fetched_from_hf_endpoint_with_the_token_into_the_cache(tmp_path):
    config = tiny_config("gpt2")
    _FakeHub.body = json.dumps(config).encode()
    _FakeHub.seen_tokens = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {"PATH": "", "PYTHONPATH": str(ROOT), "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
           "HF_TOKEN": "hf_secret", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    script = ("import json, sys\nfrom studio.core.model.info import load_model_config\n"
              "from studio.core.errors import StudioError\n"
              "print(json.dumps(load_model_config('acme/gated-tiny')))\n"
              "try:\n    load_model_config('acme/unknown')\nexcept StudioError as exc:\n    print(exc.message)\n")
    try:
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr
    fetched, refused = done.stdout.strip().splitlines()[-2:]
    assert json.loads(fetched) == config
    assert "Bearer hf_secret" in _FakeHub.seen_tokens
    assert "no model 'acme/unknown'" in refused
    cached = tmp_path / "hub" / "models--acme--gated-tiny" / "snapshots" / COMMIT / "config.json"
    assert json.loads(cached.read_text()) == config  # where transformers will find it
