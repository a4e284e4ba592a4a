"""Token dispatcher: moves permuted tokens to the ranks holding their experts and back.

Expert e lives on EP rank ``e // num_local_experts``. Locally, tokens are first permuted into
expert order (``plan_permutation``; rows for experts of EP rank 0 come first, and so on). Then:

- ``dispatch``: exchange the per-expert row counts (one small all-to-all), exchange the rows with
  ``all_to_all_single`` and uneven splits, and reorder what arrived from rank-major
  (source rank, then local expert) to expert-major (local expert, then source rank), the layout
  the grouped experts expect;
- ``combine``: the exact inverse (expert-major -> rank-major, reverse all-to-all), returning the
  expert outputs in this rank's permuted order; the probability weighting happens in unpermute.

Both are differentiable: the all-to-all is an autograd Function whose backward is the reverse
all-to-all. With no EP group (or size 1) no collective is issued. Everything the backward or
``combine`` needs (split sizes) lives in a ``DispatchPlan`` that the layer keeps in its
``LayerState``. An optional ``EmulatedLink`` stretches every token all-to-all (forward and
backward) to its modelled time; a dispatch's modelled time covers its count exchange too (one
transfer per all-to-all node, whichever way it goes).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.moe.link import EmulatedLink


def plan_permutation(
    indices: torch.Tensor, num_experts: int, capacity: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Order routing choices ``indices [t, k]`` by expert, dropping over ``capacity``.

    Returns ``row_slot [n]`` (flat slot t*k+j of each permuted row, expert-major, token order
    within an expert), ``token_slots [t, k]`` (row of each choice, -1 if dropped) and
    ``tokens_per_expert [E]`` (int64). With a capacity, each expert keeps its earliest tokens.
    """
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    if capacity is not None:
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        order = order[position < capacity]
        counts = counts.clamp(max=capacity)
    token_slots = torch.full((flat.numel(),), -1, dtype=torch.int64, device=flat.device)
    token_slots[order] = torch.arange(order.numel(), device=flat.device)
    return order, token_slots.view_as(indices), counts


@dataclass
class DispatchPlan:
    """Split sizes of one dispatch, needed by combine and by the backward passes."""

    input_splits: list[int]  # rows this rank sends to each EP rank
    output_splits: list[int]  # rows this rank receives from each EP rank
    received_counts: list[list[int]]  # [source rank][local expert] rows received
    tokens_per_local_expert: list[int]  # rows per local expert after dispatch


def _exchange(
    rows: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup,
    link: EmulatedLink | None,
    started: float | None = None,
) -> torch.Tensor:
    """The uneven exchange; with a link, it ends no earlier than the link's modelled time
    after ``started`` (default: now; a dispatch passes the start of its count exchange)."""
    rows = rows.contiguous()
    received = rows.new_empty((sum(output_splits),) + tuple(rows.shape[1:]))
    if started is None:
        started = time.perf_counter()
    dist.all_to_all_single(
        received,
        rows,
        output_split_sizes=output_splits,
        input_split_sizes=input_splits,
        group=group,
    )
    if link is not None:
        own = dist.get_rank(group)
        rows_to_others = sum(input_splits) - input_splits[own]
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
        link.wait_rest(rows_to_others * row_bytes, started, rows.device)
    return received


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, group, link, started):  # type: ignore[override]
        ctx.output_splits, ctx.input_splits = output_splits, input_splits
        ctx.group, ctx.link = group, link
        return _exchange(rows, output_splits, input_splits, group, link, started)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad_rows = _exchange(grad, ctx.input_splits, ctx.output_splits, ctx.group, ctx.link)
        return grad_rows, None, None, None, None, None


def all_to_all(
    rows: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup,
    link: EmulatedLink | None = None,
    started: float | None = None,
) -> torch.Tensor:
    """Differentiable uneven all-to-all of ``rows`` along dim 0 over ``group``. With a
    ``link``, the forward exchange's modelled time counts from ``started`` (a
    ``time.perf_counter()`` value; default: the exchange's own start)."""
    return _AllToAll.apply(rows, output_splits, input_splits, group, link, started)


def _reorder_chunks(rows: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    chunks = torch.split(rows, sizes, dim=0)
    return torch.cat([chunks[i] for i in order], dim=0)


class TokenDispatcher:
    """Dispatch/combine of expert-ordered rows over an expert-parallel group."""

    def __init__(
        self,
        num_experts: int,
        ep_group: dist.ProcessGroup | None = None,
        link: EmulatedLink | None = None,
    ) -> None:
        self.ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if num_experts % self.ep_size != 0:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by the EP group size {self.ep_size}"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.group = ep_group if self.ep_size > 1 else None
        self.link = link

    def describe(self) -> str:
        """One line naming the EP size and whether the emulated link is on."""
        link = self.link.describe() if self.link is not None else "emulated link off"
        return f"ep={self.ep_size}, {self.num_local_experts} local experts, {link}"

    def dispatch(
        self, rows: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> tuple[torch.Tensor, DispatchPlan]:
        """Send expert-ordered ``rows`` to their experts' ranks; returns expert-major local rows."""
        if self.group is None:
            counts = [int(c) for c in tokens_per_expert.tolist()]
            if self.link is not None:
                rows = self.link.delay(rows)  # ep = 1: a link that every row crosses
            return rows, DispatchPlan([len(rows)], [len(rows)], [counts], counts)
        ep, local = self.ep_size, self.num_local_experts
        send_counts = tokens_per_expert.reshape(ep, local).contiguous()
        recv_counts = torch.empty_like(send_counts)
        # the link models one transfer per dispatch: its time covers the count exchange too
        started = time.perf_counter()
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        received_counts = [[int(c) for c in row] for row in recv_counts.tolist()]
        plan = DispatchPlan(
            input_splits=[int(c) for c in send_counts.sum(dim=1).tolist()],
            output_splits=[sum(row) for row in received_counts],
            received_counts=received_counts,
            tokens_per_local_expert=[sum(row[e] for row in received_counts) for e in range(local)],
        )
        received = all_to_all(
            rows, plan.output_splits, plan.input_splits, self.group, self.link, started
        )
        if local > 1:
            sizes = [c for row in received_counts for c in row]  # rank-major chunks
            expert_major = [r * local + e for e in range(local) for r in range(ep)]
            received = _reorder_chunks(received, sizes, expert_major)
        return received, plan

    def combine(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Inverse of ``dispatch``: expert outputs back to this rank, in its permuted order."""
        if self.group is None:
            return rows if self.link is None else self.link.delay(rows)
        ep, local = self.ep_size, self.num_local_experts
        if local > 1:
            sizes = [plan.received_counts[r][e] for e in range(local) for r in range(ep)]
            rank_major = [e * ep + r for r in range(ep) for e in range(local)]
            rows = _reorder_chunks(rows, sizes, rank_major)
        return all_to_all(rows, plan.input_splits, plan.output_splits, self.group, self.link)
