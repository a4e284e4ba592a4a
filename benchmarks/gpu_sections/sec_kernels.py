"""kernels: the Triton token permute and unpermute, forward and backward, against the plain
torch reference and against the measured copy bandwidth; compile times.

Bandwidth counts the bytes each operation must move at least (``moved_bytes``), so 100% of the
copy bandwidth is the best a kernel could do. Compile time is the first call's host time minus
a steady call's, with a Triton cache of its own for this section (the runner points
``TRITON_CACHE_DIR`` at a fresh folder), so it is a cold compile. Target (issue 12, reported,
never asserted): Triton at least 70% of the copy bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megapipe.kernels import HAS_TRITON, reference
from megapipe.moe.dispatcher import sort_by_expert

from gpu_sections.gpu_timing import median_ms, time_ms
from gpu_sections.measure import copy_gbs

OPS = ("permute forward", "permute backward", "unpermute forward", "unpermute backward")


@dataclass(frozen=True)
class Routing:
    tokens: int
    hidden: int
    experts: int
    top_k: int

    def describe(self) -> str:
        return f"{self.tokens} tokens x {self.hidden}, top-{self.top_k} of {self.experts}"


REAL = (Routing(8192, 4096, 32, 8), Routing(8192, 7168, 32, 8), Routing(8192, 4096, 8, 2))
DRY = (Routing(64, 32, 4, 2),)


def moved_bytes(op: str, tokens: int, rows: int, hidden: int, element: int) -> int:
    """The least bytes ``op`` reads and writes: permute forward reads and writes the rows;
    the backward of permute and the forward of unpermute read the rows and write the tokens;
    unpermute's backward reads the output gradient and the rows and writes the rows' gradient
    (index and probability tensors are negligible and left out)."""
    per = {"permute forward": 2 * rows, "permute backward": rows + tokens,
           "unpermute forward": rows + tokens, "unpermute backward": tokens + 2 * rows}
    return per[op] * hidden * element


def _operations(module, r: Routing, device: torch.device) -> dict[str, Callable[[], object]]:  # noqa: ANN001
    """The four operations of ``module`` (triton_permute or reference: the implementations of
    the operators ``megapipe::permute``, ``sum_choices`` and ``unpermute_backward``) on one
    routing."""
    generator = torch.Generator(device=device).manual_seed(0)
    scores = torch.randn(r.tokens, r.experts, device=device, generator=generator)
    probs, indices = scores.softmax(-1).topk(r.top_k, dim=-1)
    row_choice, choice_rows, _ = sort_by_expert(indices, r.experts)
    tokens = torch.randn(r.tokens, r.hidden, device=device, dtype=torch.bfloat16,
                         generator=generator)
    rows_in = torch.randn(row_choice.numel(), r.hidden, device=device, dtype=torch.bfloat16,
                          generator=generator)
    grad_rows = torch.ones_like(rows_in)
    grad_tokens = torch.ones_like(tokens)
    module.permute(tokens, row_choice, r.top_k)  # compiles the forwards' kernels
    module.sum_choices(rows_in, probs, choice_rows)
    return {
        "permute forward": lambda: module.permute(tokens, row_choice, r.top_k),
        "permute backward": lambda: module.sum_choices(grad_rows, None, choice_rows),
        "unpermute forward": lambda: module.sum_choices(rows_in, probs, choice_rows),
        "unpermute backward": lambda: module.unpermute_backward(grad_tokens, rows_in, probs,
                                                                row_choice, choice_rows),
    }


def run(ctx, result) -> None:  # noqa: ANN001
    routings = REAL if ctx.cuda else DRY
    copy = copy_gbs(ctx.device, 2**30 if ctx.cuda else 2**24)
    result.figure("copy_gbs", copy, "GB/s", "copy bandwidth (read + write)")
    triton_module = None
    if ctx.gpu_or_skip(result, "Triton kernels"):
        if HAS_TRITON:
            from megapipe.kernels import triton_permute as triton_module
        else:
            result.skip("Triton kernels", "Triton is not installed")
    rows, worst = [], None
    for routing in routings:
        if not ctx.enough_time(result, f"kernels on {routing.describe()}", 15.0 if ctx.cuda else 1.0):
            break
        for name, module in (("torch reference", reference), ("triton", triton_module)):
            if module is None:
                continue
            for op, gbs, ms, compile_s in _measure(module, routing, ctx.device):
                rows.append([routing.describe(), name, op, ms, gbs, gbs / copy, compile_s])
                if name == "triton" and (worst is None or gbs < worst[0]):
                    worst = (gbs, f"{op}, {routing.describe()}")
        result.table("permute / unpermute, bf16", ["routing", "kernels", "operation", "GPU ms",
                                                  "GB/s", "of copy bandwidth", "first-call extra s"], rows)
    if worst is not None:
        share = worst[0] / copy
        result.figure("triton_worst_share", share * 100, "%",
                      f"slowest Triton op vs copy bandwidth ({worst[1]})", headline=True)
        result.target("Triton permute/unpermute, slowest op, share of copy bandwidth", share * 100,
                      ">= 70 %", share >= 0.7)


def _measure(module, routing: Routing, device: torch.device):  # noqa: ANN001, ANN202
    """(op, GB/s, ms, first-call extra seconds) for each operation. The inputs' set-up runs
    both forwards once (compiling their kernels): its extra time is charged to the forwards
    (on the permute forward row); a backward's extra time is its own first call's."""
    made: list = []
    cold = time_ms(lambda: made.append(_operations(module, routing, device)), device)
    warm = time_ms(lambda: _operations(module, routing, device), device)
    operations = made[0]
    rows = routing.tokens * routing.top_k
    reps = 5 if device.type == "cuda" else 2
    out = []
    for op in OPS:
        first = time_ms(operations[op], device)
        timed = median_ms(operations[op], device, reps=reps, warmup=0)
        extra = cold.host_ms - warm.host_ms if op == "permute forward" else (
            None if op == "unpermute forward" else first.host_ms - timed.host_ms)
        gbs = moved_bytes(op, routing.tokens, rows, routing.hidden, 2) / (timed.device_ms * 1e6)
        out.append((op, gbs, timed.device_ms, None if extra is None else max(0.0, extra) / 1e3))
    return out
