"""Routing choices into expert order, on the device, with shapes known before the data.

On CUDA one host thread issues the work of both streams, so a compute node must never wait for
the device. Everything here is therefore device-side and static-shape: no ``bincount`` (it reads
the minimum and maximum back to the host on CUDA), no boolean masks that select rows (their
result has a data-dependent length), no ``nonzero``. Counting uses ``searchsorted`` on the
sorted expert ids (no atomics, deterministic); rows are placed with scatters to distinct
indices (deterministic too).

- Dropless (``capacity`` None): every routing choice becomes one row; ``n = t * k`` rows.
- With a capacity: every expert gets exactly ``capacity`` rows, the earliest choices routed to
  it first and padding rows after them (Megatron's ``--moe-pad-expert-input-to-capacity``);
  ``n = E * capacity``. The row counts are then known on the host without reading anything
  back, so the all-to-all split sizes need no host read either. A padding row has
  ``row_choice = -1``: permute writes zeros there and unpermute ignores it.

The routing rows are one operator, ``megapipe::routing_rows`` (``megapipe.kernels``): on CUDA one
Triton kernel (a stable counting sort, one program per expert); on CPU the sort and scatters of
its reference (``kernels/reference_fused.py``).
"""

from __future__ import annotations

import torch

from megapipe.kernels import routing_rows_op
from megapipe.kernels.reference_fused import expert_counts

__all__ = ["expert_counts", "sort_by_expert"]


def sort_by_expert(
    indices: torch.Tensor, num_experts: int, capacity: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Order routing choices ``indices [t, k]`` by expert (see the module docstring).

    Returns ``row_choice [n]`` (flat slot t*k+j of each row, expert-major, token order within an
    expert; -1 for a padding row), ``choice_rows [t, k]`` (row of each choice, -1 if dropped)
    and ``rows_per_expert [E]`` (int64; all equal to ``capacity`` when one is given).
    """
    row_choice, choice_rows, counts = routing_rows_op(
        indices, num_experts, -1 if capacity is None else capacity
    )
    if capacity is not None:
        counts = torch.full_like(counts, capacity)
    return row_choice, choice_rows, counts
