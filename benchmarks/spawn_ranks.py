"""Start a benchmark's gloo ranks as processes and collect what rank 0 reports."""

from __future__ import annotations

from typing import Any, Callable

import torch.multiprocessing as mp


def run_ranks(worker: Callable[..., None], world: int, settings: Any) -> Any:
    """Run ``worker(rank, port, settings, queue)`` on ``world`` spawned processes (they meet at
    127.0.0.1:port); returns the one value rank 0 puts on ``queue``, after all have exited."""
    from megapipe.parallel.testing import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, settings, out)) for r in range(world)]
    for p in procs:
        p.start()
    report = out.get()
    for p in procs:
        p.join()
    return report
