"""Deterministic kernels, for runs that must repeat bit for bit (``--deterministic-mode``).

megapipe's own operations give the same bits run to run (sorted routing, scatters to distinct
indices, no atomics). Some of torch's fastest GPU kernels do not: fused attention's backward
(flash, cuDNN, memory-efficient) sums dq with atomics, and cuBLAS picks workspace-dependent
algorithms. So on a GPU two runs of the same step differ in the low bits, and a resumed run
drifts away from the uninterrupted one, unless deterministic kernels are chosen.

``deterministic_kernels(strict=True)`` (what ``--deterministic-mode`` turns on, as Megatron's
flag of that name): ``torch.use_deterministic_algorithms(True)``, under which torch picks the
deterministic variants of its fused attention backward and raises on any operation that has none
(naming it: better an error than different numbers); cuDNN deterministic, no autotuning; and
``CUBLAS_WORKSPACE_CONFIG`` set for cuBLAS when the environment does not set it (cuBLAS reads it
when its first handle is made, so set it before the first GPU matmul of the process).

``strict=False`` instead warns on such operations and routes attention to the math backend of
``scaled_dot_product_attention`` (plain matmuls and softmax, deterministic under the cuBLAS
setting): a bitwise comparison then runs to the end and reports any remaining difference. The
GPU check uses it with a control run (the same thing twice) that tells kernel non-determinism
from a megapipe defect.

The settings are process-wide torch state; the context restores them on exit. On CPU nothing
megapipe runs is non-deterministic, so the mode changes no bit there (tested).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def _math_attention():  # noqa: ANN202
    """Attention through the math backend only (torch's ``sdpa_kernel`` context)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


@contextmanager
def deterministic_kernels(strict: bool = True) -> Iterator[None]:
    """Deterministic kernels inside the block (module docstring); the previous settings after."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.use_deterministic_algorithms(True, warn_only=not strict)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        with nullcontext() if strict else _math_attention():
            yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = previous[2:]
