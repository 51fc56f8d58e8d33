"""The app's remembered choices, in the user's config directory (platformdirs). No Qt.

    <config dir>/gui.json            recent models, the target GPU, open tabs
    <config dir>/last-choices.yaml   the run config as last edited (a normal run config file)
    <config dir>/window.ini          window geometry and splitters (QSettings, written by the window)

``STUDIO_CONFIG_DIR`` moves all of them (tests use it). A damaged file is set
aside rather than stopping the app: the window then opens with the demo preset.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import platformdirs

from studio.core.config import RunConfig, load_config, save_config
from studio.core.errors import StudioError
from studio.core.presets import demo_config
from studio.core.run.directory import write_atomically

RECENT_LIMIT = 8


def config_dir() -> Path:
    override = os.environ.get("STUDIO_CONFIG_DIR")
    return Path(override) if override else platformdirs.user_config_path("finetune-studio")


@dataclass
class AppSettings:
    recent_models: list[str] = field(default_factory=list)
    gpu_card: str = ""  # a card from hardware.COMMON_CARDS, or "" for the detected GPU / custom size
    gpu_custom_gib: float = 0.0
    gpu_custom_unit: str = "GiB"  # how the custom size is typed: GiB, or GB as on a card's box
    left_tab: int = 0
    right_tab: int = 0
    self_test_offered: bool = False  # the GPU self-test was offered on a first start with a GPU (once)

    def remember_model(self, name: str) -> None:
        self.recent_models = _front(self.recent_models, name)


def _front(items: list[str], item: str) -> list[str]:
    return ([item] + [i for i in items if i != item])[:RECENT_LIMIT]


def settings_path() -> Path:
    return config_dir() / "gui.json"


def choices_path() -> Path:
    return config_dir() / "last-choices.yaml"


def window_state_path() -> Path:
    return config_dir() / "window.ini"


def load_settings() -> AppSettings:
    try:
        data = json.loads(settings_path().read_text(encoding="utf-8"))
    except FileNotFoundError:
        return AppSettings()
    except (OSError, ValueError):
        _set_aside(settings_path())
        return AppSettings()
    known = {f.name for f in fields(AppSettings)}
    try:
        return AppSettings(**{k: v for k, v in data.items() if k in known})
    except TypeError:
        return AppSettings()


def save_settings(settings: AppSettings) -> None:
    path = settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(asdict(settings), indent=2))


def read_last_config() -> tuple[RunConfig, StudioError | None]:
    """(the config as the user left it, None), or (the demo preset, why the file was set aside)."""
    path = choices_path()
    if not path.is_file():
        return demo_config(), None
    try:
        return load_config(path), None
    except StudioError as exc:
        _set_aside(path)
        return demo_config(), exc


def save_last_config(config: RunConfig) -> None:
    path = choices_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_config(config, path)


def _set_aside(path: Path) -> None:
    try:
        os.replace(path, path.with_suffix(path.suffix + ".broken"))
    except OSError:
        pass
