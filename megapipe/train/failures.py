"""An error raised inside a rank, said in one line: which rank, what it was doing, what happened.

``describe_failure(error, rank)`` turns any exception into ``rank R: ...``. Errors megapipe
raises itself already name their value and rule (a pipeline ``P2PError`` names the action and
the peer). A backend error from torch.distributed (gloo's ``Timed out waiting 60000ms for recv``
or ``Connection closed by peer``) names neither, so the traceback is read for the innermost
megapipe function that issued the collective — the expert-parallel all-to-all, the gradient
reduction, ... (``WAITS``) — and the line says what the rank waited on, and whether the wait
timed out (a peer hung) or the connection broke (a peer died). The full traceback is printed
only with ``MEGAPIPE_DEBUG=1``. Importing this module does not import torch (the ``megapipe``
command's debug switch comes from here).
"""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Iterator

DEBUG_VARIABLE = "MEGAPIPE_DEBUG"

WAITS: tuple[tuple[str, str | None, str], ...] = (
    ("moe/dispatcher.py", "dispatch", "the expert-parallel all-to-all (dispatch)"),
    ("moe/dispatcher.py", "combine", "the expert-parallel all-to-all (combine)"),
    ("moe/dispatcher.py", "backward", "the expert-parallel all-to-all (backward)"),
    ("moe/dispatcher.py", None, "the expert-parallel all-to-all"),
    ("pipeline/grad_sync.py", "sum_mirrored_grads", "the DualPipe mirrored-gradient exchange"),
    ("pipeline/grad_sync.py", None, "the data-parallel gradient reduction"),
    ("pipeline/p2p.py", None, "a pipeline send or receive"),
    ("train/optim/adamw.py", None, "the gradient-norm all-reduce"),
    ("train/step.py", None, "the loss all-reduce"),
    ("train/exits.py", None, "the exit-flag all-reduce (--exit-signal-handler)"),
    ("train/checkpoint/state.py", None, "the checkpoint save or load"),
    ("train/loop.py", None, "the resume check"),
    ("train/job.py", None, "the job's start-up (placement)"),
    ("parallel/groups.py", None, "the creation of the process groups"),
)
"""(file, function or None for any, what the rank waited on): the innermost match names it."""

_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_PEER_GONE = re.compile(
    r"connection (closed|reset)|broken pipe|peer|ECONNRESET|EPIPE|"
    r"socket closed|unexpected end",
    re.IGNORECASE,
)


def debug_enabled() -> bool:
    """Whether ``MEGAPIPE_DEBUG`` asks for full tracebacks."""
    return os.environ.get(DEBUG_VARIABLE, "").strip() not in ("", "0")


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _file_of(path: str) -> str | None:
    """The ``WAITS`` file a traceback frame's path is, if any."""
    path = path.replace(os.sep, "/")
    return next((f for f, _, _ in WAITS if path.endswith("/megapipe/" + f)), None)


def waited_on(error: BaseException) -> str | None:
    """What the rank waited on (``WAITS``): the innermost megapipe file of the traceback that
    issues collectives, described by the innermost of its frames named in ``WAITS`` (so a
    helper's frame inside ``dispatch`` still reads as the dispatch), else by the file."""
    for link in _chain(error):
        frames = list(reversed(traceback.extract_tb(link.__traceback__)))
        known = next((f for f in map(lambda fr: _file_of(fr.filename), frames) if f), None)
        if known is None:
            continue
        names = [fr.name for fr in frames if _file_of(fr.filename) == known]
        for name in names:
            for file, function, what in WAITS:
                if file == known and function == name:
                    return what
        return next(what for file, function, what in WAITS if file == known and function is None)
    return None


def _backend_failure(error: BaseException) -> tuple[str, str] | None:
    """(``"timeout"``, ``"peer"`` or ``"other"``, short message) for a backend error, else None."""
    from megapipe.pipeline.p2p import backend_message, is_backend_error  # torch: lazily

    if not is_backend_error(error):
        return None
    message = backend_message(error)
    if _TIMEOUT.search(message):
        return "timeout", message
    return ("peer" if _PEER_GONE.search(message) else "other"), message


def describe_failure(error: BaseException, rank: int) -> str:
    """One line for ``error`` raised in ``rank`` (see the module docstring)."""
    from megapipe.pipeline.p2p import backend_message

    if isinstance(error, KeyboardInterrupt):
        return f"rank {rank}: interrupted"
    backend = _backend_failure(error)
    message = backend_message(error)
    if backend is not None:
        what = waited_on(error) or "a collective"
        kind, cause = backend
        if kind == "timeout":
            message = f"waited on {what} and timed out: a peer stopped calling ({cause})"
        elif kind == "peer":
            message = f"{what} failed: the connection to a peer broke, it probably died ({cause})"
        else:
            message = f"{what} failed: {cause}"
    elif not isinstance(error, (ValueError, TypeError, RuntimeError, OSError)):
        message = f"{type(error).__name__}: {message}"
    return message if message.startswith(f"rank {rank}:") else f"rank {rank}: {message}"


def is_secondary(error: BaseException) -> bool:
    """Whether ``error`` is a consequence of another rank's failure (its connection broke)."""
    from megapipe.pipeline.p2p import P2PPeerError

    backend = _backend_failure(error)
    return isinstance(error, P2PPeerError) or (backend is not None and backend[0] == "peer")
