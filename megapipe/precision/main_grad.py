"""Where a parameter's gradient accumulates: ``.grad``, or an fp32 ``main_grad`` (Megatron's).

A bf16 model keeps, per parameter, a float32 buffer ``param.main_grad`` (Megatron's name and
semantics). ``attach_main_grads`` creates it and hooks the parameter so that every gradient
autograd accumulates into ``param.grad`` (bf16) is added to ``main_grad`` in float32 right away
and ``param.grad`` is dropped: the microbatches of a step accumulate in float32, and the
data-parallel reduction, the norm, clipping and the optimizer read ``main_grad``
(``grad_buffer``). Code that makes a weight gradient outside autograd's accumulation (deferred
weight gradients, the zero-bubble W action) adds it with ``accumulate_grad``, which follows the
same rule, so the bits do not depend on whether a gradient was deferred. A Megatron-Core model
under Megatron's DDP already carries ``main_grad``; megapipe writes into it the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils.hooks import RemovableHandle


def has_main_grad(param: torch.Tensor) -> bool:
    return getattr(param, "main_grad", None) is not None


def grad_buffer(param: torch.Tensor) -> torch.Tensor:
    """The tensor ``param``'s gradient accumulates in: ``main_grad`` when it has one, else
    ``.grad`` (set to zeros first when no gradient has arrived yet)."""
    if has_main_grad(param):
        # main_grad: Megatron's fp32 gradient attribute on a Parameter
        return param.main_grad  # type: ignore[attr-defined]
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def accumulated_grad(param: torch.Tensor) -> torch.Tensor | None:
    """``main_grad`` when ``param`` has one, else ``.grad`` (None when nothing arrived)."""
    # main_grad: Megatron's fp32 gradient attribute on a Parameter
    return param.main_grad if has_main_grad(param) else param.grad  # type: ignore[attr-defined]


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``param``'s gradient as autograd's accumulation does (same bits):
    into ``main_grad`` when it has one, else into ``.grad``."""
    if has_main_grad(param):
        # main_grad: Megatron's fp32 gradient attribute on a Parameter
        param.main_grad.add_(grad)  # type: ignore[attr-defined]
    elif param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def accumulate_grad_rows(param: torch.Tensor, first: int, grad: torch.Tensor) -> None:
    """Add ``grad`` into rows ``first .. first + len(grad)`` of ``param``'s gradient (one
    wave's expert group of a MoE layer), which equals adding the gradient padded with zeros."""
    if first == 0 and grad.shape == param.shape:
        accumulate_grad(param, grad)
        return
    grad_buffer(param)[first : first + grad.shape[0]].add_(grad)


def _move_into_main_grad(param: torch.Tensor) -> None:
    # autograd calls this hook even when the backward gave the parameter no gradient (a
    # deferred weight gradient goes to main_grad later, through accumulate_grad)
    if param.grad is not None:
        # main_grad: Megatron's fp32 gradient attribute on a Parameter
        param.main_grad.add_(param.grad)  # type: ignore[attr-defined]
        param.grad = None


def attach_main_grads(params: Iterable[torch.Tensor]) -> list[RemovableHandle]:
    """Give every trainable parameter a float32 ``main_grad`` (zeros) and the hook that moves
    each gradient autograd accumulates into it; returns the hooks' handles."""
    handles = []
    for param in params:
        if not param.requires_grad or has_main_grad(param):
            continue
        # main_grad: Megatron's fp32 gradient attribute on a Parameter
        param.main_grad = torch.zeros_like(param, dtype=torch.float32)  # type: ignore[attr-defined]
        handles.append(param.register_post_accumulate_grad_hook(_move_into_main_grad))
    return handles


def zero_grads(params: Iterable[torch.Tensor]) -> None:
    """Start a step: ``main_grad`` to zeros (in place: the buffers are reused), ``.grad`` None."""
    for param in params:
        if has_main_grad(param):
            # main_grad: Megatron's fp32 gradient attribute on a Parameter
            param.main_grad.zero_()  # type: ignore[attr-defined]
        param.grad = None
