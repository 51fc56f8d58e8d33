"""Writing an export's model card (README.md): the text comes from ``studio.core.export.model_card``,
the base model's license from its own card (a local folder's, or the Hub's cached copy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from studio.core.config import RunConfig
from studio.core.export.model_card import CARD_FILE, front_matter, model_card
from studio.core.model.check import is_local_model
from studio.core.run.directory import RunDir
from studio.core.run.events import read_events


def base_license(config: RunConfig) -> str:
    """The license the base model's card declares, "" when unknown (no card here, or none declared)."""
    name = config.model.name_or_path
    if is_local_model(name):
        card = Path(name).expanduser() / CARD_FILE
    else:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, CARD_FILE, revision=config.model.revision or None)
        card = Path(cached) if isinstance(cached, str) else None
    if card is None or not card.is_file():
        return ""
    license_ = front_matter(card.read_text(encoding="utf-8", errors="replace")).get("license", "")
    return str(license_) if license_ else ""


def write_card(config: RunConfig, run: RunDir, record: dict[str, Any], folder: Path,
               load_path: str = "PATH/TO/THIS/FOLDER") -> Path:
    """Write README.md into an export folder; ``load_path`` is what its loading examples name."""
    events = read_events(run.events) if run.events.is_file() else []
    card = folder / CARD_FILE
    card.write_text(model_card(config, events, record, base_license(config), load_path), encoding="utf-8")
    return card
