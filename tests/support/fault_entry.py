"""The pretrain entry point with injected faults and recorded losses, for the crash tests.

Run as a script (``python tests/support/fault_entry.py FLAGS``) under torchrun or on its own;
ranks started by ``megapipe pretrain``'s local launcher re-import this file (spawn), so the
patches below apply in every rank. Environment:

- ``MEGAPIPE_FAULT="kill:RANK:ITERATION[:ATTEMPT]"``: that rank SIGKILLs itself in the middle of
  that iteration's step (after a few of its compute actions), only in torchrun restart ATTEMPT
  (default 0); ``hang:...`` sleeps there instead (it stops calling);
- ``MEGAPIPE_LOSSES=DIR``: every rank writes the exact losses it trained
  (``DIR/attemptA-rankR.json``, floats written as ``repr``) when training returns; with
  ``MEGAPIPE_REFERENCE=1`` the first attempt first trains the same flags without ``--save`` and
  ``--load`` in the same processes, uninterrupted, and writes ``DIR/reference-rankR.json``
  (the reference a restarted run is compared with, without starting more processes).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import replace

import megapipe.train.loop as loop
import megapipe.train.main as entry
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.train.checkpoint.resume import ResumeChoice

ACTIONS_BEFORE_FAULT = 3
_REFERENCE_RUNNING = {"now": False}


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _parse_fault() -> tuple[str, int, int, int] | None:
    text = os.environ.get("MEGAPIPE_FAULT")
    if not text:
        return None
    kind, rank, iteration, *attempt = text.split(":")
    return kind, int(rank), int(iteration), int(attempt[0]) if attempt else 0


def _install_fault(kind: str, rank: int, iteration: int, attempt: int) -> None:
    real_step, real_compute = loop.train_step, PipelineExecutor._run_compute
    armed = {"on": False, "count": 0}

    def train_step(job, batch, it, *rest):
        # RANK is read here: ranks of the local launcher set it after importing this file
        mine = int(os.environ.get("RANK", "-1")) == rank and _attempt() == attempt
        mine = mine and not _REFERENCE_RUNNING["now"]
        armed["on"] = mine and it == iteration
        return real_step(job, batch, it, *rest)

    def run_compute(self, *args):
        if armed["on"]:
            armed["count"] += 1
            if armed["count"] == ACTIONS_BEFORE_FAULT:
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)  # hang: stop calling, stay alive
        return real_compute(self, *args)

    loop.train_step = train_step
    PipelineExecutor._run_compute = run_compute


def _record(folder: str, name: str, result) -> None:
    path = os.path.join(folder, f"{name}-rank{os.environ.get('RANK', '0')}.json")
    with open(path, "w") as handle:
        json.dump({"first": result.first_iteration, "losses": [repr(x) for x in result.losses]},
                  handle)


def _install_loss_recorder(folder: str, reference: bool) -> None:
    real_train = entry.train

    def train(args, write=print, choice=None):
        if reference and _attempt() == 0:
            alone = replace(args, checkpoint=replace(args.checkpoint, save=None, load=None))
            _REFERENCE_RUNNING["now"] = True  # no fault in the reference
            try:
                _record(
                    folder, "reference", real_train(alone, lambda line: None, ResumeChoice(None))
                )
            finally:
                _REFERENCE_RUNNING["now"] = False
        result = real_train(args, write, choice)
        _record(folder, f"attempt{_attempt()}", result)
        return result

    entry.train = train


_fault = _parse_fault()
if _fault is not None:
    _install_fault(*_fault)
if os.environ.get("MEGAPIPE_LOSSES"):
    _install_loss_recorder(
        os.environ["MEGAPIPE_LOSSES"], os.environ.get("MEGAPIPE_REFERENCE") == "1"
    )

if __name__ == "__main__":
    sys.exit(entry.main())
