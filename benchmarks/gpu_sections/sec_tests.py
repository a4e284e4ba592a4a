"""tests: ``pytest tests/gpu -rA``, with every test's outcome read from pytest's summary.

pytest runs in a process of its own under the section's time limit. Without pytest installed
the section is skipped and says so (the GPU image is known to have it). The section fails when
a test fails or errors, or pytest ends abnormally; it is skipped when every test was skipped
(on a machine without CUDA all of tests/gpu skips).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections import Counter

OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
_SUMMARY_LINE = re.compile(rf"^({'|'.join(OUTCOMES)}) (.*)$")
# "SKIPPED [2] tests/gpu/x.py:10: needs CUDA": count, location, reason
_SKIP_REASON = re.compile(r"^\[(\d+)\] (?:(\S+?:\d+): )?(.*)$")


def parse_outcomes(text: str) -> list[tuple[str, str]]:
    """(outcome, test or skip reason) for each line of pytest's ``-rA`` short summary."""
    found = []
    for line in text.splitlines():
        match = _SUMMARY_LINE.match(line.strip())
        if match:
            found.append((match.group(1), match.group(2).strip()))
    return found


def tally(outcomes: list[tuple[str, str]]) -> Counter:
    """Tests per outcome; a ``SKIPPED [n] ...`` line counts n tests."""
    counts: Counter = Counter()
    for outcome, what in outcomes:
        match = _SKIP_REASON.match(what) if outcome == "SKIPPED" else None
        counts[outcome] += int(match.group(1)) if match else 1
    return counts


def skip_reason(what: str) -> str:
    """The reason of a ``SKIPPED [n] location: reason`` summary entry."""
    match = _SKIP_REASON.match(what)
    return match.group(3) if match else what


# one process, without pyproject.toml's two workers (its addopts): a lent machine may lack
# pytest-xdist, and the GPU tests share one device
PYTEST_OPTIONS = ("-rA", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-p", "no:xdist")


def run(ctx, result) -> None:  # noqa: ANN001
    if importlib.util.find_spec("pytest") is None:
        result.skip_section(f"pytest is not installed for {sys.executable}")
        return
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", *PYTEST_OPTIONS]
    try:
        done = subprocess.run(cmd, cwd=ctx.repo, capture_output=True, text=True,
                              timeout=max(ctx.time_left() - 3, 5))
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        code, text = None, _text(err.stdout) + _text(err.stderr)
    print(text, flush=True)
    outcomes = parse_outcomes(text)
    counts = tally(outcomes)
    for outcome in OUTCOMES:
        result.figure(outcome.lower(), counts[outcome], "tests", headline=counts[outcome] > 0)
    rows = [[outcome, what] for outcome, what in outcomes]
    if rows:
        result.table("pytest tests/gpu -rA", ["outcome", "test"], rows)
    result.check("pytest finished in time", code is not None, f"exit code {code}")
    if code is None:
        return
    bad = [what for outcome, what in outcomes if outcome in ("FAILED", "ERROR")]
    result.check("no test failed or errored", not bad, "; ".join(bad)[:500])
    result.check("pytest exit code 0", code == 0,
                 f"exit code {code}" + (" (no tests collected)" if code == 5 else ""))
    ran = counts["PASSED"] + counts["FAILED"] + counts["ERROR"] + counts["XPASS"] + counts["XFAIL"]
    if not bad and code == 0 and ran == 0 and counts["SKIPPED"]:
        reasons = sorted({skip_reason(w) for o, w in outcomes if o == "SKIPPED"})
        result.skip_section(f"all {counts['SKIPPED']} tests skipped: {'; '.join(reasons)[:300]}")


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value
