"""Start a benchmark's gloo ranks as processes and collect what rank 0 reports."""

from __future__ import annotations

import queue
from typing import Any, Callable

import torch.multiprocessing as mp


def run_ranks(worker: Callable[..., None], world: int, settings: Any) -> Any:
    """Run ``worker(rank, port, settings, queue)`` on ``world`` spawned processes (they meet at
    127.0.0.1:port); returns the one value rank 0 puts on ``queue``, after all have exited.

    A rank that exits with an error before rank 0 reported stops the run: the other ranks
    (possibly blocked in a collective with it) are terminated and SystemExit names the rank
    and its exit code (its traceback is already on stderr)."""
    from megapipe.parallel.testing import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, settings, out)) for r in range(world)]
    for p in procs:
        p.start()
    report = _report_of_rank_0(out, procs)
    for p in procs:
        p.join()
    return report


def _report_of_rank_0(out: Any, procs: list) -> Any:
    """Wait for rank 0's report; if a rank fails first, terminate the others and exit."""
    while True:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                for p in procs:
                    if p.is_alive():
                        p.terminate()
                    p.join()
                rank, code = failed[0]
                raise SystemExit(f"rank {rank} exited with code {code} before rank 0 reported")
