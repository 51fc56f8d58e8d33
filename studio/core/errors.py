"""Errors that reach the user: each names where the problem is and what to do about it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the user's input.

    ``where`` is a field path (``training.learning_rate``), a file with a line
    (``data.jsonl:12``) or both; ``hint`` says what to change.
    """

    where: str
    message: str
    hint: str = ""

    def __str__(self) -> str:
        text = f"{self.where}: {self.message}" if self.where else self.message
        return f"{text} ({self.hint})" if self.hint else text


class StudioError(Exception):
    """An error with a readable message and a hint; never shown as a traceback.

    ``kind`` is a short machine-readable category (``config``, ``data``,
    ``model``, ``oom``, ...) that the worker puts into its ``error`` event.
    """

    def __init__(self, message: str, hint: str = "", kind: str = "error"):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.kind = kind

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message


class ProblemsError(StudioError):
    """Several problems found at once (validation reports all, not the first)."""

    def __init__(self, problems: list[Problem], kind: str, source: str = ""):
        self.problems = list(problems)
        head = f"{len(self.problems)} problem(s) in {source}" if source else f"{len(self.problems)} problem(s)"
        body = "\n".join(f"  - {p}" for p in self.problems)
        named = "the rows and files" if kind == "data" else "the fields"  # data problems name file and line
        super().__init__(f"{head}:\n{body}", hint=f"fix {named} named above and try again", kind=kind)


# The packages whose pip name differs from the module's, among those studio imports only where it uses them
_PIP_NAMES = {"yaml": "pyyaml", "pynvml": "nvidia-ml-py", "PySide6": "PySide6-Essentials", "lm_eval": "lm-eval",
              "tensorboardX": "tensorboardX", "PIL": "pillow"}


def missing_package(exc: BaseException) -> StudioError | None:
    """What to say when a package that studio imports only where it is used is not installed (bitsandbytes for
    QLoRA and 8-bit optimizers, deepspeed for ZeRO, torchao for QAT, datasets for the data, platformdirs for the
    default folders); None for any other error, a missing module of studio's own included."""
    package = (getattr(exc, "name", None) or "").partition(".")[0]
    if not isinstance(exc, ModuleNotFoundError) or not package or package == "studio":
        return None
    install = _PIP_NAMES.get(package, package)
    return StudioError(f"the Python package {install} is not installed, and this needs it ({exc})",
                       f"install it into the Python that runs studio: pip install {install} (the app's own: "
                       "Runtime ▸ Training runtime… repairs it)", kind="runtime")
