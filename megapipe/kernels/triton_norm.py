"""Triton kernels for RMSNorm and the SwiGLU activation, forward and backward: one launch each.

Same definitions as ``reference_fused`` (float32 inside, one rounding per output); float64 runs
the reference (there is no float64 path here). Each RMSNorm backward program owns its outputs:
the first ceil(h / col_block) programs each sum dweight for a block of columns over every row,
tile after tile in row order, so dweight is deterministic with no atomics and no second kernel;
the next ``rows`` programs write one row of dx each. The column block shrinks with the hidden
size so the dweight programs alone fill an H100 (256 of them at hidden 1024, each 16 tiles at
4096 rows), and they come first, so they run beside the dx rows instead of after them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference_fused
from .library import KERNEL_OPTIONS

MAX_BLOCK = 4096  # columns a row program holds at once
DWEIGHT_PROGRAMS = 264  # at least, when the columns allow: 2 per SM of an H100 (132 SMs)
DWEIGHT_TILE = 1024  # elements a dweight program reads at once
ELEMENTS = 1024  # elements per SwiGLU program


@triton.jit
def _rms_norm_kernel(x, weight, y, rstd, hidden, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x + row * hidden + cols, mask=cols < hidden, other=0.0).to(tl.float32)
        squares += v * v
    r = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / hidden + eps)
    tl.store(rstd + row, r)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden
        v = tl.load(x + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y + row * hidden + cols, (v * r * w).to(y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_backward_kernel(
    grad,
    x,
    weight,
    rstd,
    residual_grad,
    dx,
    dweight,
    rows,
    hidden,
    column_programs,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    COL_BLOCK: tl.constexpr,
    ROW_TILE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    if pid < column_programs:
        cols = pid * COL_BLOCK + tl.arange(0, COL_BLOCK)
        col_mask = cols < hidden
        sums = tl.zeros([ROW_TILE, COL_BLOCK], dtype=tl.float32)
        for first in range(0, rows, ROW_TILE):
            tile = first + tl.arange(0, ROW_TILE)
            row_mask = tile < rows
            mask = row_mask[:, None] & col_mask[None, :]
            offsets = tile[:, None].to(tl.int64) * hidden + cols[None, :]
            dy = tl.load(grad + offsets, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(rstd + tile, mask=row_mask, other=0.0)
            sums += dy * (v * r[:, None])
        tl.store(dweight + cols, tl.sum(sums, axis=0).to(dweight.dtype.element_ty), mask=col_mask)
    else:
        row = pid - column_programs
        r = tl.load(rstd + row)
        dots = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < hidden
            dy = tl.load(grad + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(x + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            dots += dy * w * (v * r)
        mean = tl.sum(dots, axis=0) / hidden
        for start in range(0, hidden, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < hidden
            dy = tl.load(grad + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(x + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            out = r * (dy * w - (v * r) * mean)
            if HAS_RESIDUAL:
                out += tl.load(residual_grad + row * hidden + cols, mask=mask, other=0.0).to(
                    tl.float32
                )
            tl.store(dx + row * hidden + cols, out.to(dx.dtype.element_ty), mask=mask)


def dweight_columns(hidden: int) -> int:
    """Columns of dweight a program sums: a power of two from 4 up, as few as gives
    ``DWEIGHT_PROGRAMS`` programs."""
    return max(4, triton.next_power_of_2(triton.cdiv(max(hidden, 1), DWEIGHT_PROGRAMS)))


def _row_block(hidden: int) -> dict[str, int]:
    block = min(MAX_BLOCK, triton.next_power_of_2(max(hidden, 1)))
    return {"BLOCK": block, "num_warps": 8 if block >= 2048 else 4 if block >= 512 else 2}


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference_fused.rms_norm``: one launch."""
    if x.dtype == torch.float64:
        return reference_fused.rms_norm(x, weight, eps)
    hidden = x.shape[-1]
    rows = x.numel() // max(hidden, 1)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](
            x.contiguous(),
            weight.contiguous(),
            y,
            rstd,
            hidden,
            eps,
            **_row_block(hidden),
            **KERNEL_OPTIONS,
        )
    return y, rstd


def rms_norm_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    residual_grad: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference_fused.rms_norm_backward``: one launch."""
    if x.dtype == torch.float64:
        return reference_fused.rms_norm_backward(grad, x, weight, rstd, residual_grad)
    hidden = x.shape[-1]
    rows = x.numel() // max(hidden, 1)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dweight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    residual = residual_grad.contiguous() if residual_grad is not None else grad
    columns = dweight_columns(hidden)
    column_programs = triton.cdiv(hidden, columns)
    if hidden:
        _rms_norm_backward_kernel[(column_programs + rows,)](
            grad.contiguous(),
            x.contiguous(),
            weight.contiguous(),
            rstd,
            residual,
            dx,
            dweight,
            rows,
            hidden,
            column_programs,
            HAS_RESIDUAL=residual_grad is not None,
            COL_BLOCK=columns,
            ROW_TILE=DWEIGHT_TILE // columns,
            **_row_block(hidden),
            **KERNEL_OPTIONS,
        )
    return dx, dweight


@triton.jit
def _swiglu_kernel(gate, up, out, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(gate + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + offsets, (g * tl.sigmoid(g) * u).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(grad, gate, up, d_gate, d_up, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    dy = tl.load(grad + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + offsets, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    tl.store(
        d_gate + offsets,
        (dy * u * sig * (1.0 + g * (1.0 - sig))).to(d_gate.dtype.element_ty),
        mask=mask,
    )
    tl.store(d_up + offsets, (dy * g * sig).to(d_up.dtype.element_ty), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``silu(gate) * up`` in float32, rounded once (every element alike: ``counts`` unused)."""
    if gate.dtype == torch.float64:
        return reference_fused.swiglu(gate, up, counts)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.numel()
    if n:
        _swiglu_kernel[(triton.cdiv(n, ELEMENTS),)](
            gate.contiguous(), up.contiguous(), out, n, BLOCK=ELEMENTS, **KERNEL_OPTIONS
        )
    return out


def swiglu_backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, counts: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of ``swiglu``: one launch."""
    if gate.dtype == torch.float64:
        return reference_fused.swiglu_backward(grad, gate, up, counts)
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    n = gate.numel()
    if n:
        _swiglu_backward_kernel[(triton.cdiv(n, ELEMENTS),)](
            grad.contiguous(),
            gate.contiguous(),
            up.contiguous(),
            d_gate,
            d_up,
            n,
            BLOCK=ELEMENTS,
            **KERNEL_OPTIONS,
        )
    return d_gate, d_up
