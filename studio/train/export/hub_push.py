"""Publishing an export to the Hugging Face Hub (``studio export ... --push-to-hub OWNER/NAME``).

Through huggingface_hub with the user's own login: its saved token
(``hf auth login``) or ``HF_TOKEN``. The token stays with huggingface_hub: it is
never read into studio, so never written to the run directory, its logs or
events. Whether a push can work (online, a token, a valid repo id) is checked
before any export work starts, so a refusal costs nothing.
"""

from __future__ import annotations

from pathlib import Path

from studio.core.config import load_config
from studio.core.run.commands import read_export_record
from studio.core.run.directory import COMPLETE_MARKER, RunDir
from studio.train.export.card import write_card

NOT_UPLOADED = (COMPLETE_MARKER,)  # studio's own marker of a finished export


def upload_plan(folder: Path) -> list[tuple[str, int]]:
    """(path in the repository, bytes) of every file a push of ``folder`` uploads."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.name not in NOT_UPLOADED)
    return [(p.relative_to(folder).as_posix(), p.stat().st_size) for p in files]


def publish(run_dir: Path, folder: Path, repo_id: str, private: bool, api=None, say=print) -> str:
    """Push a verified export of a run, its model card first rewritten to load it from ``repo_id``."""
    run = RunDir(run_dir)
    write_card(load_config(run.config), run, read_export_record(folder), Path(folder), load_path=repo_id)
    return push_export(folder, repo_id, private, api, say)


def push_export(folder: Path, repo_id: str, private: bool, api=None, say=print) -> str:
    """Create ``repo_id`` (private if asked; an existing repo keeps its visibility) and upload the export.

    huggingface_hub draws the upload's progress bars on the console. Returns the repository's URL.
    """
    from huggingface_hub import HfApi, constants
    from huggingface_hub.utils import enable_progress_bars

    if not constants.HF_HUB_DISABLE_PROGRESS_BARS:  # the export silenced every bar; the upload's says how far it is
        enable_progress_bars()
    api = api or HfApi()
    plan = upload_plan(folder)
    say(f"publishing {len(plan)} files ({sum(size for _, size in plan) / 1e6:.1f} MB) to {repo_id}"
        + (" (private)" if private else ""))
    for name, size in plan:
        say(f"  {name}  {size / 1e6:.2f} MB")
    url = api.create_repo(repo_id, private=private, exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=str(folder), ignore_patterns=list(NOT_UPLOADED),
                      commit_message="Upload a fine-tune from Finetune Studio")
    return str(url)
