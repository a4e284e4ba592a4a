"""mypy started at collection, beside the first tests, when the mypy test is collected.

A cold mypy (a fresh clone, as CI's) reads torch's types too: about 25 s of one core. The suite's
first tests include many that run in the test process alone and leave the second core idle, so
``tests/conftest.py`` starts mypy as soon as the tests are collected and
``tests/test_habits.py`` waits for its result (or runs it then, when it was not started).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEST = "test_habits.py::test_mypy_finds_nothing_in_the_library"
STARTED = pytest.StashKey[subprocess.Popen]()


def start() -> subprocess.Popen:
    """mypy over the library (``pyproject.toml``'s rules), its cache in the checkout."""
    return subprocess.Popen(
        [sys.executable, "-m", "mypy", "--cache-dir", str(REPO / ".mypy_cache")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(config: pytest.Config, timeout: float) -> subprocess.CompletedProcess:
    """The mypy run started at collection, waited for (started now if none was)."""
    process = config.stash.get(STARTED, None) or start()
    stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
