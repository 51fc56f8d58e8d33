"""The prepared GPU checks stay runnable: every config they train is one the worker accepts."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from gpu_checks import check_config, checks  # noqa: E402
from studio.core.validation import validate  # noqa: E402


@pytest.mark.parametrize("name, sections", checks(gpus=2).items())
def test_every_gpu_check_is_a_valid_run_config(name, sections):
    assert validate(check_config(sections)) == []
