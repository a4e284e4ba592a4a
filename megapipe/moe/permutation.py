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
"""

from __future__ import annotations

import torch


def expert_counts(sorted_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Choices per expert ``[E]`` (int64) from the expert ids sorted in increasing order."""
    bounds = torch.arange(num_experts + 1, device=sorted_experts.device, dtype=sorted_experts.dtype)
    edges = torch.searchsorted(sorted_experts, bounds)
    return edges[1:] - edges[:-1]


def order_by_expert(
    indices: torch.Tensor, num_experts: int, capacity: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Order routing choices ``indices [t, k]`` by expert (see the module docstring).

    Returns ``row_choice [n]`` (flat slot t*k+j of each row, expert-major, token order within an
    expert; -1 for a padding row), ``choice_rows [t, k]`` (row of each choice, -1 if dropped)
    and ``rows_per_expert [E]`` (int64; all equal to ``capacity`` when one is given).
    """
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    counts = expert_counts(sorted_experts, num_experts)
    num_choices = flat.numel()
    if capacity is None:
        choice_rows = torch.empty(num_choices, dtype=torch.int64, device=flat.device)
        choice_rows.scatter_(0, order, torch.arange(num_choices, device=flat.device))
        return order, choice_rows.view_as(indices), counts
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(num_choices, device=flat.device) - starts[sorted_experts]
    kept = position < capacity
    padded_rows = num_experts * capacity
    # dropped choices go to distinct scratch rows past the end, so every index is unique
    row = torch.where(
        kept,
        sorted_experts * capacity + position,
        padded_rows + torch.arange(num_choices, device=flat.device),
    )
    row_choice = torch.full((padded_rows + num_choices,), -1, dtype=torch.int64, device=flat.device)
    row_choice.scatter_(0, row, order)
    choice_rows = torch.empty(num_choices, dtype=torch.int64, device=flat.device)
    choice_rows.scatter_(0, order, torch.where(kept, row, -1))
    rows_per_expert = torch.full_like(counts, capacity)
    return row_choice[:padded_rows], choice_rows.view_as(indices), rows_per_expert
