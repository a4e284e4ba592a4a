"""Run the sections one by one, each in its own process under its own timeout.

(A dry run ignores the sections' caps: on a shared CPU its times say nothing of a GPU run's;
only the budget and the minimums apply. It records instead what each section would be allowed
on the device with the same budget, ``on_device``.)

Every section runs as ``python -m gpu_sections.child NAME`` in a new process session, with its
stdout and stderr appended to the one log (``gpu_check.log``, under a header per section), and
writes its result JSON as it goes to ``gpu_check.current.json`` in the output folder itself
(``IN_PROGRESS``), so a kill of the whole check at any moment leaves the finished sections in
the reports and the running one's partial figures beside them. The runner gives it the time the
budget allows (``budget.py``); the child is told a little less so it can stop early and keep
what it measured; past the full allowance its whole process group is stopped (TERM, then KILL)
and the section fails with "timed out", keeping the partial results. After each section the
reports are rewritten (``report.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_sections.budget import Budget, device_plan
from gpu_sections.registry import SectionSpec
from gpu_sections.result import empty, status_of

IN_PROGRESS = "gpu_check.current.json"  # the running section's result, in the output folder
WRAP_UP_S = 8.0  # the child's own limit is this much shorter than the runner's
KILL_GRACE_S = 5.0  # between TERM and KILL


@dataclass(frozen=True)
class RunSettings:
    out: Path
    scratch: Path
    dry_run: bool
    repo: Path
    python: str = sys.executable

    @property
    def log(self) -> Path:
        return self.out / "gpu_check.log"


def child_env(spec: SectionSpec, settings: RunSettings) -> dict[str, str]:
    """The section's environment: ``benchmarks/`` and the checkout itself on ``PYTHONPATH``
    (so the section, and every process it starts, script or pytest, imports megapipe from this
    checkout however the check was set up), unbuffered output, no GPU in a dry run, and the
    section's own variables."""
    env = dict(os.environ)
    paths = (str(settings.repo / "benchmarks"), str(settings.repo), env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["PYTHONUNBUFFERED"] = "1"
    if settings.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    for key, value in spec.env:
        env[key] = value.replace("{scratch}", str(settings.scratch))
    return env


def command(spec: SectionSpec, settings: RunSettings, result: Path, seconds: float) -> list[str]:
    cmd = [settings.python, "-m", "gpu_sections.child", spec.name, "--result", str(result),
           "--out", str(settings.out), "--scratch", str(settings.scratch),
           "--time-limit", f"{max(seconds - WRAP_UP_S, 1.0):.1f}"]
    return cmd + (["--dry-run"] if settings.dry_run else [])


def stop_group(process: subprocess.Popen) -> None:
    """Stop the child's whole process group (it may have started ranks of its own)."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(cmd: list[str], env: dict[str, str], cwd: Path, log: Path,
              seconds: float) -> tuple[int | None, bool]:
    """Run ``cmd`` with output appended to ``log``; (exit code, timed out)."""
    with open(log, "a") as sink:
        process = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                   start_new_session=True)
        try:
            return process.wait(timeout=seconds), False
        except subprocess.TimeoutExpired:
            stop_group(process)
            return process.returncode, True


def finish_result(data: dict[str, Any], code: int | None, timed_out: bool, seconds: float,
                  allowed: float) -> dict[str, Any]:
    """The section's result after its process ended: a timeout or a crash becomes its error."""
    if timed_out:
        data["error"] = (f"timed out after {allowed:.0f} s (the section's allowance); the "
                         "figures above are what it had measured by then")
    elif code != 0 and not data.get("error") and not any(not c["ok"] for c in data["checks"]):
        data["error"] = f"the section's process exited with code {code} (see gpu_check.log)"
    data["seconds"] = seconds
    return data


def run_section(spec: SectionSpec, settings: RunSettings, allowed: float) -> dict[str, Any]:
    result_path = settings.out / IN_PROGRESS
    result_path.unlink(missing_ok=True)
    with open(settings.log, "a") as log:
        log.write(f"\n===== section {spec.name} (allowed {allowed:.0f} s) =====\n")
    started = time.monotonic()
    code, timed_out = run_child(command(spec, settings, result_path, allowed),
                                child_env(spec, settings), settings.repo, settings.log, allowed)
    data = empty(spec.name)
    if result_path.exists():
        data = json.loads(result_path.read_text())
        result_path.unlink()  # folded into the reports by the caller
    elif not timed_out:
        data["error"] = f"the section wrote no result (exit code {code}; see gpu_check.log)"
    data["what"] = spec.what
    return finish_result(data, code, timed_out, time.monotonic() - started, allowed)


def device_words(spec: SectionSpec, seconds: float | None) -> str:
    """What ``spec`` is allowed on the device at worst (``budget.device_plan``), in words."""
    if seconds is None:
        return (f"cap {spec.cap_s:.0f} s; runs only in time the sections before it leave "
                f"(needs {spec.min_s:.0f} s)")
    if seconds < spec.cap_s:
        return f"{seconds:.0f} s at worst (cap {spec.cap_s:.0f} s)"
    return f"{seconds:.0f} s (its cap)"


def run_all(specs: Sequence[SectionSpec], settings: RunSettings, budget: Budget,
            on_result: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Run ``specs`` in order within ``budget``; ``on_result(results so far)`` after each."""
    results: list[dict[str, Any]] = []
    # the caps plan a GPU run; a dry run's times depend on how busy the CPU is: budget only,
    # and it states what each section would be allowed on the device instead
    plan = device_plan([s.cap_s for s in specs], [s.min_s for s in specs], budget.seconds)
    for spec, on_device in zip(specs, plan):
        cap = budget.seconds if settings.dry_run else spec.cap_s
        allowance = budget.for_section(cap, spec.min_s)
        if allowance.seconds is None:
            data = empty(spec.name)
            data.update(skipped_reason=allowance.reason, what=spec.what, seconds=0.0)
        else:
            data = run_section(spec, settings, allowance.seconds)
        if settings.dry_run:
            data["on_device"] = device_words(spec, on_device)
        results.append(data)
        on_result(results)
        print(f"[gpu_check] {spec.name}: {status_of(data)} ({data['seconds']:.0f} s)", flush=True)
    return results
