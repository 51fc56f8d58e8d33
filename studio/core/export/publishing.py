"""Whether an export can be published to the Hugging Face Hub, asked before any work: by the command
line (``--push-to-hub``) and by the app's Publish button. The upload itself is ``studio.train.export.hub_push``."""

from __future__ import annotations

import os
import re

from studio.core.errors import StudioError

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_TRUE = {"1", "ON", "YES", "TRUE"}


def check_can_push(repo_id: str) -> None:
    """Refuse a push that cannot work: a malformed id, offline mode, or no Hub login."""
    from huggingface_hub import get_token, is_offline_mode

    if not _REPO_ID.fullmatch(repo_id):
        raise StudioError(f"--push-to-hub {repo_id!r} is not a Hub repository id",
                          "write OWNER/NAME, e.g. your-name/my-fine-tune", kind="usage")
    if is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE:
        raise StudioError(f"cannot publish to {repo_id}: the Hugging Face Hub is switched off (HF_HUB_OFFLINE)",
                          "unset HF_HUB_OFFLINE, or export without --push-to-hub and upload the folder later",
                          kind="usage")
    if not get_token():
        raise StudioError(f"cannot publish to {repo_id}: not logged in to the Hugging Face Hub",
                          "run `hf auth login` (or set HF_TOKEN to a token with write access); nothing was exported",
                          kind="usage")
