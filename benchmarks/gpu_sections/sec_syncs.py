"""syncs: every host sync during one combined step, as file:line with counts.

Two attention + MoE layers (ep = 1, bf16 on the GPU): after a warm-up, one combined step (the
forward of microbatch 1 beside the backward of microbatch 0) runs under
``torch.cuda.set_sync_debug_mode("warn")`` and every synchronizing call is charged to the
innermost line of megapipe that led to it (``sync_sites.py``); then the same for the plain path
(the forward, then the backward, on the tape). The design allows one host read per MoE layer
forward (the all-to-all split sizes) and the wait at the end of the step.
"""

from __future__ import annotations

import torch

from megapipe.overlap.streams import make_streams
from megapipe.overlap.tape import record_forward, run_backward

from gpu_sections.moe_bench import PairBench, Shape, build_layers
from gpu_sections.sync_sites import capture_syncs

REAL = Shape(hidden=2048, heads=16, experts=8, top_k=2, ffn=1408, tokens=4096)
DRY = Shape(hidden=64, heads=4, experts=4, top_k=2, ffn=32, tokens=64, batch=2)
LAYERS = 2
ROOTS = ("megapipe", "kernels")


def run(ctx, result) -> None:  # noqa: ANN001
    shape = REAL if ctx.cuda else DRY
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    result.figure("shape", f"{LAYERS} layers, {shape.describe()}, {str(dtype)[6:]}")
    layers = build_layers(shape, LAYERS, ctx.device, dtype)
    with make_streams(ctx.device) as streams:
        bench = PairBench(layers, shape, streams, ctx.device, dtype)
        warm = bench.traced(None, combined=True)  # warm-up: kernels compiled, allocator filled
        result.figure("warmup_ms", warm.device_ms, "ms", "warm-up combined step")
        if not ctx.gpu_or_skip(result, "sync counting (torch.cuda.set_sync_debug_mode)"):
            return
        for label, combined in (("combined step", True), ("plain F then B", False)):
            log = _count(ctx, bench, combined)
            key = "combined" if combined else "plain"
            result.figure(f"{key}_syncs", log.total, "syncs", f"host syncs, {label}",
                          headline=combined)
            result.table(f"host syncs in one {label} ({LAYERS} MoE layers each side)",
                         ["site (innermost megapipe line)", "count"], log.table())
            result.table(f"the same, by the line that raised the warning ({label})",
                         ["raised at", "count"],
                         [[site, n] for site, n in log.raised_at.most_common()])
    result.note("warnings raised inside an autograd backward are replayed when backward "
                "returns: they name the line that called backward (overlap/tape.py)")


def _count(ctx, bench: PairBench, combined: bool):  # noqa: ANN001, ANN202
    """Sync warnings during one run of the step (the tape of microbatch 0 recorded before)."""
    plans, tape = bench.prepare(None, on_streams=combined)
    with capture_syncs(ROOTS, str(ctx.repo)) as log:
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
    return log
