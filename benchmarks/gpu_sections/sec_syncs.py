"""syncs: every host sync during one combined step, and the one documented host read.

Two attention + MoE layers (ep = 1, dropless, bf16 with fp32 main gradients). After a warm-up,
one combined step (the forward of microbatch 1 beside the backward of microbatch 0):

- **host reads, by node** (CPU and GPU): under the project's own instrument
  (``tests/support/host_syncs.HostSyncs``: ``item``, ``tolist``, ``cpu``, ``nonzero``,
  ``bincount``, boolean indexing, ... with the node that made each). Every one must be the one
  documented read of the dispatch (docs/precision.md "The hot path and its one host read":
  ``HostCounts.wait`` in a forward dispatch node), one per MoE layer forward;
- **synchronizing CUDA calls** (GPU): the same step under
  ``torch.cuda.set_sync_debug_mode("warn")``, each charged to the innermost line of megapipe that
  led to it (``sync_sites.py``); then the plain path (forward, then backward, on the tape). The
  documented read waits on an event behind a non-blocking copy into pinned memory, which the
  sync-debug mode does not flag: both must show none (checked);
- **the host's wait in the documented read** (GPU): ``HostCounts.wait`` timed during that step,
  since it stalls the one host thread that issues both streams.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from gpu_sections.gpu_timing import synchronize
from gpu_sections.moe_bench import PairBench, Shape, build_layers
from gpu_sections.sync_sites import capture_syncs
from megapipe.moe.dispatcher import HostCounts
from megapipe.overlap.device_streams import make_streams
from megapipe.overlap.sequential import record_forward, run_backward

REAL = Shape(hidden=2048, heads=16, experts=8, top_k=2, ffn=1408, tokens=4096)
DRY = Shape(hidden=64, heads=4, experts=4, top_k=2, ffn=32, tokens=64, batch=2)
LAYERS = 2
ROOTS = ("megapipe", "kernels")


def run(ctx, result) -> None:  # noqa: ANN001
    shape, dtype = (REAL if ctx.cuda else DRY), torch.bfloat16
    result.figure("shape", f"{LAYERS} layers, {shape.describe()}, {str(dtype)[6:]}, dropless")
    layers = build_layers(shape, LAYERS, ctx.device, dtype)
    with make_streams(ctx.device) as streams:
        bench = PairBench(layers, shape, streams, ctx.device, dtype)
        warm = bench.traced(combined=True)  # warm-up: kernels compiled, allocator filled
        result.figure("warmup_ms", warm.device_ms, "ms", "warm-up combined step")
        _host_reads(ctx, result, bench)
        if not ctx.gpu_or_skip(result, "sync-debug warnings, the host's wait in the read"):
            return
        for label, combined in (("combined step", True), ("plain F then B", False)):
            log, waits = _sync_debug(ctx, bench, combined)
            key = "combined" if combined else "plain"
            result.figure(f"{key}_syncs", log.total, "syncs",
                          f"synchronizing CUDA calls, {label}", headline=combined)
            result.check(f"no synchronizing CUDA call in one {label} (the documented read "
                         "waits on an event, which is not one)", log.total == 0,
                         "; ".join(f"{site} x{n}" for site, n in log.table()[:5]))
            result.table(f"synchronizing CUDA calls in one {label} ({LAYERS} MoE layers each "
                         "side)", ["site (innermost megapipe line)", "count"], log.table())
            result.table(f"the same, by the line that raised the warning ({label})",
                         ["raised at", "count"],
                         [[site, n] for site, n in log.raised_at.most_common()])
            if combined:
                _read_waits(result, waits)
    result.note("warnings raised inside an autograd backward are replayed when backward "
                "returns: they name the line that called backward (overlap/combined.py)")


def _host_reads(ctx, result, bench: PairBench) -> None:  # noqa: ANN001
    """Every host read of one combined step, with its node: only the documented one."""
    sys.path.insert(0, str(ctx.repo / "tests"))
    from support.host_syncs import HostSyncs, the_one_point

    plans, tape = bench.prepare()
    with HostSyncs() as syncs:
        bench.issue(plans, tape, True)
    synchronize(ctx.device)
    rows = Counter((e.op, e.where, f"{e.direction} {e.node}") for e in syncs.events)
    result.table("host reads in one combined step (HostSyncs)", ["op", "where", "node", "count"],
                 [[*key, n] for key, n in rows.most_common()])
    result.figure("host_reads", len(syncs.events), "reads",
                  "host reads in a combined step", headline=True)
    others = syncs.outside(the_one_point)
    result.check("every host read of a combined step is the documented one (HostCounts.wait "
                 "in a forward dispatch)", not others,
                 "; ".join(f"{e.op} at {e.where} in {e.direction} {e.node}" for e in others[:5]))
    result.check(f"one documented read per MoE layer forward ({LAYERS})",
                 len(syncs.events) - len(others) == LAYERS,
                 f"{len(syncs.events) - len(others)} documented reads")


@contextmanager
def _timed_reads() -> Iterator[list[float]]:
    """The host milliseconds of every ``HostCounts.wait`` inside the block."""
    original = HostCounts.wait
    waits: list[float] = []

    def wait(self: HostCounts) -> list:
        start = time.perf_counter()
        try:
            return original(self)
        finally:
            waits.append((time.perf_counter() - start) * 1e3)

    # replaced for the run to count host reads
    HostCounts.wait = wait  # type: ignore[method-assign]
    try:
        yield waits
    finally:
        # replaced for the run to count host reads
        HostCounts.wait = original  # type: ignore[method-assign]


def _sync_debug(ctx, bench: PairBench, combined: bool):  # noqa: ANN001, ANN202
    """(sync warnings, ms of each documented read) during one run of the step."""
    plans, tape = bench.prepare(on_streams=combined)
    with capture_syncs(ROOTS, str(ctx.repo)) as log, _timed_reads() as waits:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            if combined:
                bench.issue(plans, tape, True)
            else:
                record_forward(plans, (bench.x_fwd,))
                run_backward(tape, (bench.grad,))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return log, waits


def _read_waits(result, waits: list[float]) -> None:  # noqa: ANN001
    result.figure("documented_reads", len(waits), "reads", "HostCounts.wait calls, combined step")
    if waits:
        result.figure("read_wait_ms", sum(waits) / len(waits), "ms",
                      "host blocked per documented read (mean)", headline=True)
        result.figure("read_wait_max_ms", max(waits), "ms", "host blocked, longest read")
