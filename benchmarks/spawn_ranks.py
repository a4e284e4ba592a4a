"""Start a benchmark's gloo ranks as processes and collect what rank 0 reports."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from megapipe.parallel.launch import start_local_ranks


def run_ranks(worker: Callable[..., None], world: int, settings: Any) -> Any:
    """Run ``worker(rank, settings, queue)`` on ``world`` local ranks (torchrun's variables set,
    so ``dist.init_process_group("gloo")`` meets); returns the one value rank 0 puts on
    ``queue``, after all have exited.

    A rank that exits with an error before rank 0 reported stops the run: the other ranks
    (possibly blocked in a collective with it) are terminated and SystemExit names the rank
    and its exit code (its traceback is already on stderr)."""
    out = mp.get_context("spawn").Queue()
    ranks = start_local_ranks(worker, world, (settings, out))
    while True:
        try:
            report = out.get(timeout=1.0)
            break
        except queue.Empty:
            failed = ranks.failure()
            if failed is not None:
                ranks.terminate()
                raise SystemExit(f"{failed} before rank 0 reported") from None
    ranks.join()
    return report
