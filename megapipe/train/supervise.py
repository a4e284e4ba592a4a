"""The ranks ``megapipe pretrain`` starts itself, watched until they end, told as one line.

Each started rank trains; if it fails it writes a one-line report (``failures``) into a
folder the parent made, then exits 1. The parent polls the processes. At the first rank that
ends badly it waits a moment for the others to report, kills whatever still runs (a rank blocked
on a dead peer would otherwise wait out its timeout), and prints the line that explains the
failure, chosen in this order:

1. a rank killed by a signal without a report (SIGKILL, the OOM killer, a segfault), named with
   its signal;
2. the earliest report that is not a consequence of another failure (an exception, a timeout;
   after a timeout, the ranks still running when they were stopped are named: they hung);
3. the earliest report of a broken connection;
4. a rank that exited with an error code and no report.

Signals to the parent: SIGTERM is forwarded to the ranks with ``--exit-signal-handler`` (they
finish the step, save and exit 0, and so does the parent); otherwise the ranks are stopped and
the parent exits 143. Ctrl-C stops every rank and exits 130 with one line.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megapipe.train.failures import debug_enabled

GRACE_S = 1.0
POLL_S = 0.1
TIMEOUT_WORDS = ("timed out", "did not complete within")


class RankProcess(Protocol):
    """What supervision needs of a started rank (``multiprocessing.Process`` has it)."""

    pid: int | None

    @property
    def exitcode(self) -> int | None: ...

    def kill(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


@dataclass(frozen=True)
class Report:
    """What a failing rank said: its line, when, and whether another failure caused it."""

    rank: int
    line: str
    time: float
    secondary: bool


def write_report(folder: Path, rank: int, line: str, secondary: bool) -> None:
    """A rank's report, written atomically so the parent never reads half of one."""
    path = folder / f"rank{rank}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(
        json.dumps({"rank": rank, "line": line, "time": time.time(), "secondary": secondary})
    )
    tmp.replace(path)


def read_reports(folder: Path) -> list[Report]:
    reports = []
    for path in sorted(folder.glob("rank*.json")):
        try:
            data = json.loads(path.read_text())
            reports.append(
                Report(
                    int(data["rank"]),
                    str(data["line"]),
                    float(data["time"]),
                    bool(data["secondary"]),
                )
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return reports


def _death(rank: int, code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} was killed by {name} (it left no report: crashed or killed)"
    return f"rank {rank} exited with code {code} without a report"


def explain(codes: Sequence[int | None], reports: Sequence[Report], stopped: set[int]) -> str:
    """The one line for a failed run (module docstring); ``stopped``: ranks the parent killed."""
    reported = {r.rank for r in reports}
    unreported = [
        (rank, code)
        for rank, code in enumerate(codes)
        if code not in (None, 0) and rank not in reported | stopped
    ]
    for rank, code in unreported:
        if code < 0:
            return _death(rank, code)
    primary = sorted((r for r in reports if not r.secondary), key=lambda r: r.time)
    chosen = primary[0] if primary else min(reports, key=lambda r: r.time, default=None)
    if chosen is None:
        return _death(*unreported[0]) if unreported else "the ranks stopped without saying why"
    hung = sorted(stopped - reported)
    if hung and any(words in chosen.line for words in TIMEOUT_WORDS):
        return f"{chosen.line}; rank(s) {', '.join(map(str, hung))} still ran and were stopped"
    return chosen.line


def supervise(
    processes: Sequence[RankProcess], folder: Path, grace_s: float = GRACE_S, poll_s: float = POLL_S
) -> tuple[int, str | None]:
    """Wait for every rank; (0, None) if all succeeded, else (1, the line that explains)."""
    failed_at: float | None = None
    stopped: set[int] = set()
    while any(p.exitcode is None for p in processes):
        if failed_at is None and any(p.exitcode not in (None, 0) for p in processes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at >= grace_s:
            stopped = stop(processes)
            break
        time.sleep(poll_s)
    for process in processes:
        process.join()
    codes = [p.exitcode for p in processes]
    if all(code == 0 for code in codes):
        return 0, None
    return 1, explain(codes, read_reports(folder), stopped)


def stop(processes: Sequence[RankProcess]) -> set[int]:
    """Kill every rank still running; returns their ranks."""
    running = {rank for rank, p in enumerate(processes) if p.exitcode is None}
    for rank in running:
        processes[rank].kill()
    return running


class _ParentSignals:
    """SIGTERM while the ranks run: forward it (graceful exit) or stop them (module docstring)."""

    def __init__(self, processes: Sequence[RankProcess], forward: bool) -> None:
        self.processes, self.forward = processes, forward
        self.terminated = False
        self._previous: Any = None

    def __enter__(self) -> _ParentSignals:
        self._previous = signal.signal(signal.SIGTERM, self._on_term)
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    def _on_term(self, signum: int, frame: Any) -> None:
        if self.forward:
            for process in self.processes:
                if process.exitcode is None and process.pid is not None:
                    os.kill(process.pid, signal.SIGTERM)
            return
        self.terminated = True
        stop(self.processes)


def run_local(
    start: Callable[[Path], Sequence[RankProcess]],
    forward_sigterm: bool,
    say: Callable[[str], None],
) -> int:
    """Start the ranks (``start(report_folder)``), supervise them, say one line if they fail."""
    with tempfile.TemporaryDirectory(prefix="megapipe-reports-") as folder:
        processes = start(Path(folder))
        try:
            with _ParentSignals(processes, forward_sigterm) as signals:
                code, line = supervise(processes, Path(folder))
        except KeyboardInterrupt:
            stop(processes)
            for process in processes:
                process.join()
            say("interrupted; every rank stopped")
            return 130
        if signals.terminated:
            say("stopped by SIGTERM (pass --exit-signal-handler to save and exit cleanly)")
            return 143
        if line is not None:
            if debug_enabled():  # every rank's own line, then the one that explains
                for report in sorted(read_reports(Path(folder)), key=lambda r: r.time):
                    say(f"(debug) {report.line}")
            say(line)
        return code
