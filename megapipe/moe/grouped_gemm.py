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
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

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
                torch.cuda.get_device_capability(x.device)):
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
    x: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, counts: Sequence[int],
    offsets: torch.Tensor | None,
) -> torch.Tensor:
    """``stack_i(x_i^T @ grad_i)`` (zeros for an empty group), shaped like ``weight``."""
    kernel = _kernel()
    if kernel is not None and use_grouped_mm(x, weight, offsets):
        return kernel(x.contiguous().t(), grad.contiguous(), offs=offsets)
    x_blocks = torch.split(x, list(counts), dim=0)
    grad_blocks = torch.split(grad, list(counts), dim=0)
    return torch.stack([xc.t() @ g for xc, g in zip(x_blocks, grad_blocks)])
