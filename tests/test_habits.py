"""The house habits, checked by the test command: ``ruff`` lint-clean on the library, tests,
benchmarks and scripts, the library formatted as ``ruff format`` formats it, ``mypy`` clean on
the library, every module of it (no ``ignore_errors`` override in ``pyproject.toml``), every type
ignore naming its error code and its reason. ``tests/test_sizes.py`` counts the formatted lines.

The rules live in ``pyproject.toml`` (``[tool.ruff]``, ``[tool.mypy]``); the tools are pinned in
its ``test`` extra, which ``scripts/setup.sh`` installs. mypy keeps its cache in the checkout's
``.mypy_cache`` (ignored by git): cold it reads torch's types too (about 30 s of CPU), warm a
few seconds; the suite's other worker keeps the second core busy meanwhile.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINTED = ["megapipe", "tests", "benchmarks", "scripts"]
# an ignore names its code(s) and, after a second ``#`` or in a comment line just above it, why
# the checker is wrong there
IGNORE = re.compile(r"#\s*type:\s*ignore(?P<codes>\[[a-z0-9_,\s-]+\])?(?P<rest>.*)$")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=540)


def _clean(done: subprocess.CompletedProcess, what: str) -> None:
    if "No module named" in done.stderr:
        pytest.fail(f"{what}: {done.stderr.strip()} (install the test extra: "
                    "bash scripts/setup.sh, or pip install -e '.[test]')")
    assert done.returncode == 0, f"{what} found:\n{done.stdout}{done.stderr}"


def test_ruff_finds_nothing():
    _clean(_run("ruff", "check", "--no-cache", *LINTED), "ruff check")


def test_the_library_is_formatted_as_ruff_formats_it():
    _clean(_run("ruff", "format", "--check", "--no-cache", "megapipe"), "ruff format --check")


def test_the_format_check_finds_an_unformatted_module(tmp_path):
    """The check above can fail: one module written by hand, not as ruff writes it."""
    (tmp_path / "m.py").write_text("x = f( 1,2 )\n")
    done = _run("ruff", "format", "--check", "--no-cache", str(tmp_path / "m.py"))
    assert done.returncode == 1 and "m.py" in done.stdout, done.stdout + done.stderr


def test_mypy_finds_nothing_in_the_library():
    _clean(_run("mypy", "--cache-dir", str(REPO / ".mypy_cache")), "mypy")


def test_no_module_is_left_out_of_the_type_check():
    config = (REPO / "pyproject.toml").read_text()
    assert not re.search(r"^\s*ignore_errors\s*=\s*true", config, re.MULTILINE), (
        "a [[tool.mypy.overrides]] entry hides a module's errors: type the module instead")


def _ignores_without_reason(text: str) -> list[str]:
    found = []
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        match = IGNORE.search(line)
        if not match:
            continue
        above = lines[number - 2].strip() if number > 1 else ""
        reason = re.match(r"\s*#\s*\S", match["rest"]) or (above.startswith("#")
                                                            and "type: ignore" not in above)
        if not (match["codes"] and reason):
            found.append(f"{number}: {line.strip()}")
    return found


def test_every_type_ignore_names_its_code_and_its_reason():
    # not this file, whose examples below are ignores without a reason on purpose
    found = [f"{path.relative_to(REPO)}:{hit}"
             for folder in LINTED for path in sorted((REPO / folder).rglob("*.py"))
             if path != Path(__file__).resolve()
             for hit in _ignores_without_reason(path.read_text())]
    assert found == [], "\n".join(found)


def test_an_ignore_without_reason_or_code_is_found():
    assert _ignores_without_reason("x = f()  # type: ignore[arg-type]\n") == [
        "1: x = f()  # type: ignore[arg-type]"]
    assert _ignores_without_reason("x = f()  # type: ignore  # torch's stub is wrong\n") != []
    assert _ignores_without_reason("x = f()  # type: ignore[arg-type]  # torch's stub\n") == []
    above = "# torch's stub is wrong\nx = f()  # type: ignore[arg-type]\n"
    assert _ignores_without_reason(above) == []
    assert _ignores_without_reason("y = 1\nx = f()  # type: ignore[arg-type]\n") == [
        "2: x = f()  # type: ignore[arg-type]"]
