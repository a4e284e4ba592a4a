"""The three GEMMs of a grouped matmul, as one torch kernel where this torch has one.

``x [n, in]`` is split into row groups of ``counts`` (group i multiplies ``weight[i]``,
``weight [groups, in, out]``). Forward ``y_i = x_i @ w_i``, input gradient
``dx_i = dy_i @ w_i^T``, weight gradient ``dw_i = x_i^T @ dy_i``.

With ``torch.nn.functional.grouped_mm`` (or ``torch._grouped_mm``; looked up with ``hasattr``)
each is one kernel over all groups, driven by the groups' end offsets as an int32 *device*
tensor, so nothing is read back to the host. It is used when the caller passes those offsets
and the kernel takes the operands without reading them on the host: on CUDA, bf16 operands on
compute capability 9.x or 10.x (Hopper, datacenter Blackwell: torch's CUTLASS kernel; on any
other GPU, and for other dtypes, torch 2.9-2.11 fall back to a loop that copies the offsets to
the host, a sync in the hot path); on CPU float32/bf16/float16; every row stride a multiple of
16 bytes. Otherwise a Python loop over the groups (the host ``counts`` the dispatch already
read) does the same products. The two give the same bits (tested on CPU, and on an H100 by the
GPU check), so a run does not change when torch gains the kernel.

``grouped_matmul`` is the experts' op over them: it computes in the operands' dtype (bf16 in a
bf16 model) and, under ``torch.autocast``, in the autocast dtype, returning each gradient in its
input's dtype; its weight gradient can be deferred into a ``WeightGradQueue``
(``overlap.wgrad``) and is added into ``.grad`` or ``main_grad`` (``precision.main_grad``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from megapipe.overlap.wgrad import queue_of
from megapipe.precision.main_grad import accumulate_grad_rows

_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernel() -> Callable[..., torch.Tensor] | None:
    if hasattr(F, "grouped_mm"):
        return F.grouped_mm
    return getattr(torch, "_grouped_mm", None)


def _aligned(*sizes: int, element_size: int) -> bool:
    return all(size * element_size % 16 == 0 for size in sizes)


def cuda_kernel_reads_no_offsets(capability: tuple[int, int]) -> bool:
    """Whether torch's CUDA ``grouped_mm`` runs its device kernel (no host read of the offsets)
    on a GPU of this compute capability: 9.x and 10.x only (module docstring)."""
    return capability[0] in (9, 10)


def use_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor | None) -> bool:
    """Whether the one-kernel path applies to ``x`` and ``weight`` (module docstring)."""
    if offsets is None or _kernel() is None or x.dtype != weight.dtype:
        return False
    if x.is_cuda:
        if x.dtype != torch.bfloat16 or not cuda_kernel_reads_no_offsets(
            torch.cuda.get_device_capability(x.device)
        ):
            return False
    elif x.device.type != "cpu" or x.dtype not in _CPU_DTYPES:
        return False
    return _aligned(weight.shape[1], weight.shape[2], element_size=x.element_size())


def grouped_forward(
    x: torch.Tensor, weight: torch.Tensor, counts: Sequence[int], offsets: torch.Tensor | None
) -> torch.Tensor:
    """``cat_i(x_i @ weight[i])``."""
    kernel = _kernel()
    if kernel is not None and use_grouped_mm(x, weight, offsets):
        return kernel(x.contiguous(), weight, offs=offsets)
    blocks = torch.split(x, list(counts), dim=0)
    return torch.cat([block @ weight[i] for i, block in enumerate(blocks)], dim=0)


def grouped_input_grad(
    grad: torch.Tensor, weight: torch.Tensor, counts: Sequence[int], offsets: torch.Tensor | None
) -> torch.Tensor:
    """``cat_i(grad_i @ weight[i]^T)``."""
    kernel = _kernel()
    if kernel is not None and use_grouped_mm(grad, weight, offsets):
        return kernel(grad.contiguous(), weight.transpose(-2, -1), offs=offsets)
    blocks = torch.split(grad, list(counts), dim=0)
    return torch.cat([g @ weight[i].t() for i, g in enumerate(blocks)], dim=0)


def grouped_weight_grad(
    x: torch.Tensor,
    grad: torch.Tensor,
    weight: torch.Tensor,
    counts: Sequence[int],
    offsets: torch.Tensor | None,
) -> torch.Tensor:
    """``stack_i(x_i^T @ grad_i)`` (zeros for an empty group), shaped like ``weight``."""
    kernel = _kernel()
    if kernel is not None and use_grouped_mm(x, weight, offsets):
        return kernel(x.contiguous().t(), grad.contiguous(), offs=offsets)
    x_blocks = torch.split(x, list(counts), dim=0)
    grad_blocks = torch.split(grad, list(counts), dim=0)
    return torch.stack([xc.t() @ g for xc, g in zip(x_blocks, grad_blocks)])


class _GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, weight, state, offsets, first):
        dtype = _compute_dtype(x, weight)
        used = (
            weight
            if first == 0 and len(counts) == weight.shape[0]
            else (weight[first : first + len(counts)])
        )
        x_c, w_c = x.to(dtype), used.to(dtype)
        ctx.save_for_backward(x_c, w_c, offsets)
        # the parameter itself, not saved: under saved-tensor hooks (the activation meter's) a
        # saved tensor comes back as a new tensor object, whose .grad / main_grad are not the
        # parameter's, so a deferred gradient accumulated there would be lost
        ctx.weight = weight
        ctx.counts, ctx.state, ctx.first = counts, state, first
        ctx.x_dtype = x.dtype
        with torch.autocast(x.device.type, enabled=False):
            return grouped_forward(x_c, w_c, counts, offsets)

    @staticmethod
    def backward(ctx, grad_out):
        x, w, offsets = ctx.saved_tensors
        weight = ctx.weight
        counts = ctx.counts
        grad_out = grad_out.to(w.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_input_grad(grad_out, w, counts, offsets).to(ctx.x_dtype)
        if not ctx.needs_input_grad[2]:
            return grad_x, None, None, None, None, None
        first = ctx.first

        def weight_grad() -> torch.Tensor:
            return grouped_weight_grad(x, grad_out, w, counts, offsets).to(weight.dtype)

        queue = queue_of(ctx.state)
        ctx.state = None
        if queue is None:
            grad_w = weight_grad()
            if grad_w.shape != weight.shape:  # a group of the weight's groups: zeros elsewhere
                padded = torch.zeros_like(weight)
                padded[first : first + len(counts)] = grad_w
                grad_w = padded
            return grad_x, None, grad_w, None, None, None
        if weight.grad_fn is not None or not weight.is_leaf:
            raise RuntimeError(
                "grouped_matmul can defer the weight gradient only for a leaf weight "
                "(a Parameter); "
                f"got a weight with grad_fn {type(weight.grad_fn).__name__}"
            )
        queue.put(
            lambda: accumulate_grad_rows(weight, first, weight_grad()),
            name="grouped_matmul",
            keeps=(x, grad_out, w, offsets),
        )
        return grad_x, None, None, None, None, None


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for ``x``'s device, else the operands' own."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    if x.dtype != weight.dtype:
        raise TypeError(
            f"grouped_matmul: x is {x.dtype} but weight is {weight.dtype}; cast the model "
            "(e.g. to bf16 with fp32 main weights) or run under torch.autocast"
        )
    return x.dtype


def grouped_matmul(
    x: torch.Tensor,
    counts: Sequence[int],
    weight: torch.Tensor,
    state: Any = None,
    offsets: torch.Tensor | None = None,
    first: int = 0,
) -> torch.Tensor:
    """``cat_i(x_i @ weight[first + i])`` for ``x`` split into row groups of ``counts``.

    ``weight`` is ``[groups, in, out]``; ``counts`` has one entry per group used, from group
    ``first`` on (zeros allowed; all groups by default).
    ``offsets`` (int32 on ``x``'s device: each group's end row) allows the one-kernel grouped
    GEMM; without them a loop over the groups runs. Its backward defers the weight gradient
    into ``state.wgrad_queue`` when that is set.
    """
    counts = tuple(int(c) for c in counts)
    if weight.dim() != 3 or not counts or first < 0 or first + len(counts) > weight.shape[0]:
        raise ValueError(
            f"grouped_matmul: weight of shape {tuple(weight.shape)} needs one count per group, "
            f"got {len(counts)} counts (for the groups from {first} on)"
        )
    if sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_matmul: counts sum to {sum(counts)} but x has {x.shape[0]} rows")
    if offsets is not None and (
        first != 0 or len(counts) != weight.shape[0] or offsets.shape != (len(counts),)
    ):
        raise ValueError(
            f"grouped_matmul: offsets of shape {tuple(offsets.shape)} need one entry per group "
            f"({weight.shape[0]}) and all groups (first={first})"
        )
    return _GroupedMatmul.apply(x, counts, weight, state, offsets, first)
