"""What one section reports, written to its JSON file after every addition.

A section records figures (measured values with units), checks (properties that must hold:
a failed one fails the section), targets (benchmark goals, reported as met or not, never
failing anything), tables, notes, and the parts it skipped with the reason. The file is rewritten
after each addition, so a section killed by its timeout still leaves what it had measured.

Status: ``failed`` when the section raised, timed out or a check failed; ``skipped`` when the
whole section was skipped (``skip_section``); ``passed`` otherwise (parts may be skipped).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


def clean(value: Any) -> Any:
    """JSON-safe: floats rounded to 4 significant digits, NaN/inf as None, tuples as lists."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return str(value)


def empty(name: str) -> dict[str, Any]:
    return {
        "name": name, "figures": {}, "checks": [], "targets": [], "tables": [], "notes": [],
        "skipped_parts": [], "skipped_reason": None, "error": None,
    }


def status_of(data: dict[str, Any]) -> str:
    if data.get("error") or any(not c["ok"] for c in data.get("checks", [])):
        return FAILED
    if data.get("skipped_reason"):
        return SKIPPED
    return PASSED


class SectionResult:
    """The growing result of one section, saved to ``path`` (atomically) after each change."""

    def __init__(self, name: str, path: str | Path | None) -> None:
        self.data = empty(name)
        self.path = Path(path) if path is not None else None
        self.save()

    def figure(
        self, key: str, value: Any, unit: str = "", label: str = "", headline: bool = False
    ) -> None:
        """A measured value; ``headline`` ones go into the summary table."""
        self.data["figures"][key] = {"value": clean(value), "unit": unit, "label": label or key,
                                     "headline": headline}
        self.save()

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.data["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        self.save()
        return bool(ok)

    def target(self, name: str, value: float | None, goal: str, met: bool | None) -> None:
        """A benchmark goal (from the issue): reported, never failing the section."""
        self.data["targets"].append({"name": name, "value": clean(value), "goal": goal,
                                     "met": met})
        self.save()

    def table(self, title: str, columns: list[str], rows: list[list[Any]]) -> None:
        """A table; one with the same title is replaced (a table that grows as rows come)."""
        tables = [t for t in self.data["tables"] if t["title"] != title]
        tables.append({"title": title, "columns": columns, "rows": clean(rows)})
        self.data["tables"] = tables
        self.save()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.save()

    def skip(self, part: str, reason: str) -> None:
        """One part of the section did not run, and why."""
        self.data["skipped_parts"].append({"part": part, "reason": reason})
        self.save()

    def skip_section(self, reason: str) -> None:
        self.data["skipped_reason"] = reason
        self.save()

    def fail(self, error: str) -> None:
        self.data["error"] = error
        self.save()

    @property
    def status(self) -> str:
        return status_of(self.data)

    def save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)
