"""Every fused operator of ``megapipe.kernels`` (``torch.ops.megapipe.<name>``) on inputs of one
shape, ready to time: the kernels section's cases.

Each case is one operator call with its inputs made once (the backward operators' inputs come
from their forwards). ``moved_bytes`` counts every tensor the call reads (its tensor arguments)
and writes (its outputs) once: the least a kernel must move, so GB/s over the measured copy
bandwidth is the share of HBM bandwidth the kernel reaches. ``OPERATORS`` lists the operators
``megapipe.kernels`` defines; a test checks that the cases cover each of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megapipe import kernels

OPERATORS = ("permute", "sum_choices", "unpermute_backward", "rms_norm", "rms_norm_backward",
             "swiglu", "swiglu_backward", "router", "router_backward", "routing_rows")


@dataclass(frozen=True)
class Shape:
    """``tokens`` of ``hidden`` routed top-``top_k`` of ``experts``, expert FFN width ``ffn``."""

    tokens: int
    hidden: int
    experts: int
    top_k: int
    ffn: int

    def describe(self) -> str:
        return (f"{self.tokens} tokens x {self.hidden}, top-{self.top_k} of {self.experts}, "
                f"expert FFN {self.ffn}")


REAL = Shape(tokens=8192, hidden=4096, experts=32, top_k=8, ffn=2048)
DRY = Shape(tokens=64, hidden=32, experts=4, top_k=2, ffn=16)


@dataclass(frozen=True)
class Case:
    """One call of ``operator`` (``call()``); ``args`` are its inputs, for the byte count."""

    operator: str
    call: Callable[[], Any]
    args: tuple

    def moved_bytes(self, outputs: Any) -> int:
        """Bytes of every tensor argument and every output (module docstring)."""
        outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        return sum(t.numel() * t.element_size() for t in (*self.args, *outs)
                   if isinstance(t, torch.Tensor))


def _case(op: Any, name: str, *args: Any) -> Case:
    return Case(name, lambda: op(*args), args)


def cases(shape: Shape, device: torch.device) -> list[Case]:
    """One case per operator of ``OPERATORS``, in that order, in bf16 where the model is."""
    gen = torch.Generator(device=device).manual_seed(0)
    bf16 = torch.bfloat16

    def randn(*size: int, dtype: torch.dtype = bf16) -> torch.Tensor:
        return torch.randn(*size, device=device, dtype=dtype, generator=gen)

    t, h, e, k, f = shape.tokens, shape.hidden, shape.experts, shape.top_k, shape.ffn
    logits = randn(t, e, dtype=torch.float32)
    probs, indices, _ = kernels.router_op(logits, k, False)
    row_choice, choice_rows, counts = kernels.routing_rows_op(indices, e, -1)
    tokens = randn(t, h)
    rows = kernels.permute_op(tokens, row_choice, k)
    weight = torch.ones(h, device=device, dtype=bf16)
    _, rstd = kernels.rms_norm_op(tokens, weight, 1e-5)
    rows_per_expert = [t * k // e] * e  # balanced blocks: the expert layout the FFN sees
    rows_per_expert[-1] += t * k - sum(rows_per_expert)
    gate, up = randn(t * k, f), randn(t * k, f)
    grad_probs = torch.ones_like(probs)
    return [
        _case(kernels.permute_op, "permute", tokens, row_choice, k),
        _case(kernels.sum_choices_op, "sum_choices", rows, probs, choice_rows),
        _case(kernels.unpermute_backward_op, "unpermute_backward", tokens, rows, probs,
              row_choice, choice_rows),
        _case(kernels.rms_norm_op, "rms_norm", tokens, weight, 1e-5),
        _case(kernels.rms_norm_backward_op, "rms_norm_backward", tokens, tokens, weight, rstd,
              None),
        _case(kernels.swiglu_op, "swiglu", gate, up, rows_per_expert),
        _case(kernels.swiglu_backward_op, "swiglu_backward", gate, gate, up, rows_per_expert),
        _case(kernels.router_op, "router", logits, k, False),
        _case(kernels.router_backward_op, "router_backward", grad_probs, logits, counts, None, k,
              False, 1e-2, 1e-3),
        _case(kernels.routing_rows_op, "routing_rows", indices, e, -1),
    ]

