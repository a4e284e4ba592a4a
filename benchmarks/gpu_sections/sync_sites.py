"""Host syncs by source line: capture torch's sync-debug warnings and count them per site.

With ``torch.cuda.set_sync_debug_mode("warn")`` every synchronizing CUDA call (a device-to-host
copy such as ``.tolist()`` or ``.item()``, ``torch.cuda.synchronize()``, ...) raises a Python
warning "called a synchronizing CUDA operation". ``capture_syncs`` collects them with the
Python stack at the moment each was raised, and ``site_of`` names the line responsible: the
innermost frame inside the project (``megapipe/``, ``kernels/``), since the frame that raised it
may be inside torch. Warnings raised during an autograd backward are replayed by the engine when
``backward`` returns, so they name the line that called the backward.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

SYNC_MESSAGE = "called a synchronizing CUDA operation"

Frame = tuple[str, int]  # (file name, line number)


def site_of(frames: Sequence[Frame], roots: Sequence[str], repo: str) -> str:
    """``file:line`` of the innermost frame under one of ``roots`` (folders relative to
    ``repo``); the innermost frame of all when none is (paths shown relative to ``repo`` when
    inside it)."""
    if not frames:
        return "<unknown>"
    repo = os.path.realpath(repo)
    prefixes = [os.path.join(repo, root) + os.sep for root in roots]
    for filename, line in reversed(frames):
        path = os.path.realpath(filename)
        if any(path.startswith(prefix) for prefix in prefixes):
            return f"{os.path.relpath(path, repo)}:{line}"
    filename, line = frames[-1]
    path = os.path.realpath(filename)
    shown = os.path.relpath(path, repo) if path.startswith(repo + os.sep) else filename
    return f"{shown}:{line}"


@dataclass
class SyncLog:
    """Every sync warning seen: the site it is charged to and the frame that raised it."""

    roots: Sequence[str]
    repo: str
    sites: Counter = field(default_factory=Counter)
    raised_at: Counter = field(default_factory=Counter)

    def add(self, frames: Sequence[Frame]) -> None:
        self.sites[site_of(frames, self.roots, self.repo)] += 1
        if frames:
            self.raised_at[f"{frames[-1][0]}:{frames[-1][1]}"] += 1

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def table(self) -> list[list[object]]:
        """Rows ``[site, count]``, most frequent first, then by site."""
        return [[site, count] for site, count in sorted(self.sites.items(), key=_by_count)]


def _by_count(item: tuple[str, int]) -> tuple[int, str]:
    return (-item[1], item[0])


@contextmanager
def capture_syncs(roots: Sequence[str], repo: str) -> Iterator[SyncLog]:
    """Collect sync warnings raised inside the block (other warnings are shown as usual).

    The caller switches the sync debug mode on and off; this only listens."""
    log = SyncLog(roots, repo)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def listen(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
            if SYNC_MESSAGE in str(message):
                stack = [(f.filename, f.lineno or 0) for f in traceback.extract_stack()[:-1]]
                # the warnings machinery's own frames sit on top: drop them
                while stack and stack[-1][0].endswith(os.path.join("", "warnings.py")):
                    stack.pop()
                log.add(stack or [(filename, lineno)])
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = listen
        yield log

