"""gemm: the experts' three GEMMs two ways -- the per-expert loop against one grouped GEMM
(``torch.nn.functional.grouped_mm`` or ``torch._grouped_mm``) -- through megapipe's own
``moe/grouped_gemm.py``, in TFLOP/s and host microseconds per call.

The loop is what ``grouped_forward`` and friends run without device offsets (host ``counts``);
the grouped kernel is what they run with them, where ``use_grouped_mm`` says this torch and
device take the operands (CUDA bf16 on compute capability >= 8.0; CPU bf16). Rows per expert
come from a random top-k routing of the tokens (uneven, as in training); bf16. Each grouped
result is checked against the loop's (bf16 rounding apart).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_sections.gpu_timing import median_ms
from megapipe.moe.grouped_gemm import (
    grouped_forward,
    grouped_input_grad,
    grouped_weight_grad,
    use_grouped_mm,
)

CALLS = 10  # calls per timed run: host time per call = the run's host time / CALLS
GEMMS = ("forward", "input grad", "weight grad")


@dataclass(frozen=True)
class GemmShape:
    hidden: int
    ffn: int
    experts: int
    tokens: int
    top_k: int

    def describe(self) -> str:
        return (f"{self.tokens} tokens top-{self.top_k} -> {self.experts} experts, "
                f"{self.hidden} x {self.ffn}")


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
    rows: list[list] = []
    for index, shape in enumerate(shapes):
        if not ctx.enough_time(result, f"GEMMs {shape.describe()}", 10.0 if ctx.cuda else 1.0):
            break
        rows += _compare(ctx, result, shape, headline=index == 0)
        result.table("experts' GEMMs, bf16", ["shape", "GEMM", "way", "TFLOP/s", "GPU ms",
                                              "host us per call"], rows)


def _gemms(shape: GemmShape,
           device: torch.device) -> tuple[dict[str, Callable], torch.Tensor, bool]:
    """The three GEMMs as ``fn(offsets)`` (None: the loop), the offsets, and whether the
    grouped kernel takes these operands."""
    counts = routed_counts(shape, device)
    generator = torch.Generator(device=device).manual_seed(1)

    def draw(*size: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*size, device=device, dtype=torch.bfloat16, generator=generator) * scale

    x, dy = draw(sum(counts), shape.hidden), draw(sum(counts), shape.ffn)
    w = draw(shape.experts, shape.hidden, shape.ffn, scale=0.02)
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    gemms = {
        "forward": lambda offs: grouped_forward(x, w, counts, offs),
        "input grad": lambda offs: grouped_input_grad(dy, w, counts, offs),
        "weight grad": lambda offs: grouped_weight_grad(x, dy, w, counts, offs),
    }
    return gemms, offsets, use_grouped_mm(x, w, offsets)


def _compare(ctx, result, shape: GemmShape, headline: bool) -> list[list]:  # noqa: ANN001
    device, reps = ctx.device, (5 if ctx.cuda else 2)
    gemms, offsets, grouped = _gemms(shape, device)
    if not grouped:
        result.skip(f"grouped GEMM for {shape.describe()}",
                    f"torch {torch.__version__} has no grouped_mm for these operands here "
                    "(megapipe.moe.grouped_gemm.use_grouped_mm)")
    flops = 2 * shape.tokens * shape.top_k * shape.hidden * shape.ffn
    rows, speedups = [], []
    for name, gemm in gemms.items():
        ways = {"per-expert loop": None, **({"grouped_mm": offsets} if grouped else {})}
        times = {}
        for way, offs in ways.items():
            timed = median_ms(lambda: [gemm(offs) for _ in range(CALLS)], device, reps=reps)
            times[way] = ms = timed.device_ms / CALLS
            rows.append([shape.describe(), name, way, flops / (ms * 1e9), ms,
                         timed.host_ms / CALLS * 1e3])
        if grouped:
            loop, kernel = gemm(None).float(), gemm(offsets).float()
            error, scale = (loop - kernel).abs().max().item(), loop.abs().max().item()
            result.check(f"grouped {name} equals the loop ({shape.describe()})",
                         error <= 1e-2 * scale,
                         f"max |difference| {error:.3g}, max |value| {scale:.3g}")
            speedups.append(times["per-expert loop"] / times["grouped_mm"])
    if speedups:
        result.figure(f"grouped_speedup_{shape.hidden}_{shape.experts}",
                      sum(speedups) / len(speedups), "x",
                      f"grouped vs loop, {shape.experts} experts h{shape.hidden} (mean of "
                      f"{', '.join(GEMMS)})", headline=headline)
    return rows
