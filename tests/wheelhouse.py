"""A folder of wheels made from what is installed here, for provisioning a runtime without a network.

No registry is asked: each installed distribution (the requirements and everything they need, markers
evaluated for this machine) is packed back into a wheel from the files its RECORD lists, with the tag its
WHEEL file names. A wheel that already lies in a ``--find-links`` folder of pip's (the machine's torch) is
linked instead of packed again.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def build_wheelhouse(requirements: list[str], target: Path, ready_made: list[Path] = ()) -> list[Path]:
    """Wheels for ``requirements`` and their dependencies, installed versions, in ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    wheels = []
    for dist in _closure(requirements):
        name, version = dist.metadata["Name"], dist.version
        found = _ready_made(name, version, ready_made)
        if found is not None:
            link = target / found.name
            if not link.exists():
                os.symlink(found, link)
            wheels.append(link)
        else:
            wheels.append(_repack(dist, target))
    return wheels


def _closure(requirements: list[str]) -> list[metadata.Distribution]:
    seen: dict[str, metadata.Distribution] = {}
    todo = [(Requirement(text), "") for text in requirements]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        key = canonicalize_name(requirement.name)
        if key in seen:
            continue
        dist = metadata.distribution(requirement.name)
        seen[key] = dist
        todo += [(Requirement(text), extra) for text in dist.requires or [] for extra in ("", *requirement.extras)]
    return list(seen.values())


def _ready_made(name: str, version: str, folders: list[Path]) -> Path | None:
    stem = re.sub(r"[-_.]+", "_", name).lower()
    for folder in folders:
        for wheel in Path(folder).glob("*.whl"):
            if wheel.name.lower().startswith(f"{stem}-{version.lower()}-"):
                return wheel
    return None


def _compressed_tag(tags: list[str]) -> str:
    """``py2-none-any`` and ``py3-none-any`` become ``py2.py3-none-any``, as a wheel's file name writes them."""
    parts = [tag.split("-") for tag in tags]
    return "-".join(".".join(dict.fromkeys(part[index] for part in parts)) for index in range(3))


def _repack(dist: metadata.Distribution, target: Path) -> Path:
    info = Path(dist.locate_file(next(file for file in dist.files if file.name == "RECORD"))).parent  # .dist-info
    tags = [line.split(":", 1)[1].strip() for line in (info / "WHEEL").read_text().splitlines() if line.startswith("Tag:")]
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    wheel = target / f"{name}-{dist.version}-{_compressed_tag(tags)}.whl"
    if wheel.exists():
        return wheel
    site = info.parent
    record_name = f"{info.name}/RECORD"
    partial = wheel.with_suffix(".part")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED) as archive:
        rows = []
        for entry in (info / "RECORD").read_text().splitlines():
            relative = entry.rsplit(",", 2)[0]
            if not relative or relative == record_name or relative.startswith(".."):  # scripts outside site-packages
                continue
            path = site / relative
            if not path.is_file() or "__pycache__" in relative:
                continue
            data = path.read_bytes()
            archive.writestr(relative, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{relative},sha256={digest},{len(data)}")
        archive.writestr(record_name, "\n".join([*rows, f"{record_name},,"]) + "\n")
    partial.rename(wheel)
    return wheel
