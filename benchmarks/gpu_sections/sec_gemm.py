"""gemm: the experts' matrix product two ways -- megapipe's per-expert loop
(``overlap.wgrad.grouped_matmul``: one GEMM per local expert) against one grouped GEMM
(``torch._grouped_mm``, where this torch has it) -- in TFLOP/s and host microseconds per call.

Rows per expert come from a random top-k routing of the tokens (uneven, as in training); bf16.
The grouped result is checked against the loop's (same products, fp32 accumulation each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megapipe.overlap.wgrad import grouped_matmul

from gpu_sections.gpu_timing import median_ms

CALLS = 10  # calls per timed run: host time per call = the run's host time / CALLS


@dataclass(frozen=True)
class GemmShape:
    hidden: int
    ffn: int
    experts: int
    tokens: int
    top_k: int

    def describe(self) -> str:
        return f"{self.tokens} tokens top-{self.top_k} -> {self.experts} experts, {self.hidden} x {self.ffn}"


REAL = (GemmShape(4096, 14336, 8, 4096, 2), GemmShape(7168, 2048, 32, 4096, 8),
        GemmShape(2048, 1408, 32, 8192, 8))
DRY = (GemmShape(64, 32, 4, 64, 2),)


def routed_counts(shape: GemmShape, device: torch.device) -> list[int]:
    """Rows per expert of a random top-k routing (host integers, as the loop needs them)."""
    generator = torch.Generator(device=device).manual_seed(0)
    scores = torch.randn(shape.tokens, shape.experts, device=device, generator=generator)
    chosen = scores.topk(shape.top_k, dim=-1).indices.reshape(-1)
    return torch.bincount(chosen, minlength=shape.experts).tolist()


def run(ctx, result) -> None:  # noqa: ANN001
    shapes = REAL if ctx.cuda else DRY
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is None:
        result.skip("grouped GEMM", f"torch {torch.__version__} has no torch._grouped_mm")
    rows = []
    for shape in shapes:
        if not ctx.enough_time(result, f"GEMM {shape.describe()}", 10.0 if ctx.cuda else 1.0):
            break
        rows.append(_compare(ctx, result, shape, grouped_mm))
        result.table("experts' GEMM, forward, bf16", ["shape", "way", "TFLOP/s", "GPU ms",
                                                      "host us per call"], [r for pair in rows for r in pair])


def _compare(ctx, result, shape: GemmShape, grouped_mm) -> list[list]:  # noqa: ANN001
    device, reps = ctx.device, (5 if ctx.cuda else 2)
    counts = routed_counts(shape, device)
    generator = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(sum(counts), shape.hidden, device=device, dtype=torch.bfloat16,
                    generator=generator)
    w = torch.randn(shape.experts, shape.hidden, shape.ffn, device=device, dtype=torch.bfloat16,
                    generator=generator) * 0.02
    flops = 2 * x.shape[0] * shape.hidden * shape.ffn
    ways = {"per-expert loop": lambda: grouped_matmul(x, counts, w)}
    if grouped_mm is not None:
        offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        ways["torch._grouped_mm"] = lambda: grouped_mm(x, w, offs=offsets)
    rows = []
    outputs = {}
    for way, fn in ways.items():
        try:
            outputs[way] = fn()
        except (RuntimeError, NotImplementedError, TypeError) as err:
            result.skip(f"{way} for {shape.describe()}", f"{type(err).__name__}: {str(err)[:200]}")
            continue
        timed = median_ms(lambda: [fn() for _ in range(CALLS)], device, reps=reps)
        ms = timed.device_ms / CALLS
        rows.append([shape.describe(), way, flops / (ms * 1e9), ms, timed.host_ms / CALLS * 1e3])
    if len(outputs) == 2:
        loop, grouped = outputs.values()
        error = (loop.float() - grouped.float()).abs().max().item()
        scale = loop.float().abs().max().item()
        result.check(f"grouped GEMM equals the loop ({shape.describe()})", error <= 1e-2 * scale,
                     f"max |difference| {error:.3g}, max |value| {scale:.3g}")
    if len(rows) == 2:
        key = f"grouped_speedup_{shape.hidden}_{shape.experts}"
        result.figure(key, rows[0][3] / rows[1][3], "x",
                      f"grouped vs loop, {shape.experts} experts h{shape.hidden}",
                      headline=shape is (REAL if ctx.cuda else DRY)[0])
    return rows
