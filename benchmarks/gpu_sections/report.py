"""The GPU check's report: ``gpu_check.json`` (everything) and ``gpu_check.md`` (to read).

Both are rewritten after every section, so a run cut short still leaves a report of the
sections done. The markdown has one part per section (figures, checks, targets, tables, skipped
parts, notes), then the summary table, and ends with the line ``N passed, N failed, N skipped``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpu_sections.result import FAILED, PASSED, SKIPPED, status_of


def counts(results: Sequence[dict[str, Any]]) -> dict[str, int]:
    found = {PASSED: 0, FAILED: 0, SKIPPED: 0}
    for result in results:
        found[status_of(result)] += 1
    return found


def summary_line(results: Sequence[dict[str, Any]]) -> str:
    c = counts(results)
    return f"{c[PASSED]} passed, {c[FAILED]} failed, {c[SKIPPED]} skipped"


def device_facts(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The device, torch and CUDA versions the env section found, for the report's header."""
    env = next((r for r in results if r["name"] == "env"), None)
    if env is None:
        return {}
    return {key: env["figures"][key]["value"] for key in ("device", "torch", "cuda")
            if key in env["figures"]}


def _value(figure: dict[str, Any]) -> str:
    value, unit = figure["value"], figure.get("unit", "")
    if value is None:
        return "n/a"
    text = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)
    return f"{text} {unit}".strip()


def headline(result: dict[str, Any]) -> str:
    """The section's headline figures, or why it did not pass, in one cell."""
    status = status_of(result)
    if status == SKIPPED:
        return f"skipped: {result['skipped_reason']}"
    parts = [f"{f['label']} {_value(f)}" for f in result["figures"].values() if f.get("headline")]
    if status == FAILED:
        failed = [c["name"] for c in result["checks"] if not c["ok"]]
        why = result.get("error") or f"check failed: {'; '.join(failed)}"
        parts.insert(0, why.strip().splitlines()[-1][:200])
    return "; ".join(parts)


def summary_rows(results: Sequence[dict[str, Any]]) -> list[list[str]]:
    return [[r["name"], status_of(r), f"{r.get('seconds', 0):.0f}", headline(r)] for r in results]


def device_rows(results: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Per section what it would be allowed on the device (a dry run's ``on_device``)."""
    return [[r["name"], r["on_device"]] for r in results if r.get("on_device")]


def text_table(results: Sequence[dict[str, Any]]) -> str:
    """The summary as aligned plain text (for the terminal)."""
    rows = [["section", "status", "s", "figures / reason"]] + summary_rows(results)
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
        for row in rows
    )


def _md_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    def cell(value: Any) -> str:
        return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return lines


def section_markdown(result: dict[str, Any]) -> list[str]:
    lines = [f"## {result['name']}: {status_of(result)} ({result.get('seconds', 0):.0f} s)", ""]
    if result.get("what"):
        lines += [result["what"], ""]
    if result.get("skipped_reason"):
        lines += [f"Skipped: {result['skipped_reason']}", ""]
    if result.get("error"):
        lines += ["Error:", "", "```", result["error"].strip(), "```", ""]
    if result["figures"]:
        rows = [[f["label"], _value(f)] for f in result["figures"].values()]
        lines += _md_table(["figure", "value"], rows) + [""]
    if result["checks"]:
        rows = [["ok" if c["ok"] else "FAILED", c["name"], c["detail"]] for c in result["checks"]]
        lines += _md_table(["check", "what", "detail"], rows) + [""]
    if result["targets"]:
        rows = [
            [t["name"], t["value"], t["goal"], {True: "met", False: "not met"}.get(t["met"], "n/a")]
            for t in result["targets"]
        ]
        lines += _md_table(["target", "value", "goal", ""], rows) + [""]
    for table in result["tables"]:
        lines += [f"**{table['title']}**", ""] + _md_table(table["columns"], table["rows"]) + [""]
    if result["skipped_parts"]:
        lines += [f"- skipped: {p['part']}: {p['reason']}" for p in result["skipped_parts"]] + [""]
    if result["notes"]:
        lines += [f"- {note}" for note in result["notes"]] + [""]
    return lines


def markdown(meta: dict[str, Any], results: Sequence[dict[str, Any]]) -> str:
    lines = ["# megapipe GPU check", ""]
    lines += [f"- {key}: {value}" for key, value in meta.items()] + [""]
    for result in results:
        lines += section_markdown(result)
    if device_rows(results):
        lines += ["## On the device", "", "What each section would be allowed on the GPU with "
                  "this budget, at worst (every section before it using its whole allowance):",
                  ""] + _md_table(["section", "allowed"], device_rows(results)) + [""]
    lines += ["## Summary", ""]
    lines += _md_table(["section", "status", "seconds", "figures / reason"], summary_rows(results))
    lines += ["", summary_line(results)]
    return "\n".join(lines) + "\n"


def write(out: Path, meta: dict[str, Any], results: Sequence[dict[str, Any]]) -> None:
    """Rewrite ``gpu_check.json`` and ``gpu_check.md`` in ``out`` (atomically each)."""
    summary = {"summary": summary_line(results), **counts(results)}
    _write(
        out / "gpu_check.json",
        json.dumps({"meta": meta, **summary, "sections": list(results)}, indent=1),
    )
    _write(out / "gpu_check.md", markdown(meta, results))


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
