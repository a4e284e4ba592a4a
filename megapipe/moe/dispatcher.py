"""Token dispatcher: moves permuted tokens to the ranks holding their experts and back.

Expert e lives on EP rank ``e // num_local_experts``. Locally, tokens are first permuted into
expert order (``sort_by_expert``; rows for experts of EP rank 0 come first, and so on). Then:

- ``dispatch``: exchange the per-expert row counts (one small all-to-all), exchange the rows with
  ``all_to_all_single`` and uneven splits, and reorder what arrived from rank-major
  (source rank, then local expert) to expert-major (local expert, then source rank), the row
  arrangement the grouped experts expect;
- ``combine``: the exact inverse (expert-major -> rank-major, reverse all-to-all), returning the
  expert outputs in this rank's permuted order; the probability weighting happens in unpermute.

Both are differentiable: the all-to-all is an autograd Function whose backward is the reverse
all-to-all. With no EP group (or size 1) no collective is issued. Everything the backward or
``combine`` needs (split sizes) lives in a ``DispatchSplits`` that the layer keeps in its
``LayerState``. An optional ``EmulatedLink`` stretches every token all-to-all (forward and
backward) to its modelled time; a dispatch's modelled time covers its count exchange too (one
transfer per all-to-all node, whichever way it goes).

**The one host read.** ``all_to_all_single`` takes its split sizes as host integers, so a
dropless MoE layer must read its per-expert row counts back from the device once per forward.
That read happens at one point, inside the dispatch comm node (``HostCounts``): right after the
count exchange is issued, the exchanged counts start a non-blocking copy into pinned host
memory with an event behind it; the device-side work that needs no host sizes (the grouped
GEMM offsets) is issued next, and only then, as late as possible, the host waits on that event
and reads the sizes. On CUDA this stalls the host thread (not the compute stream: the
combined step has queued the slot's compute node before it) for the count exchange only. Every
other node, and the whole backward, runs without any host sync. With a capacity
(``sort_by_expert`` pads every expert to ``capacity`` rows) the split sizes are static and
there is no host read at all, nor a count exchange.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.moe.link import EmulatedLink
from megapipe.moe.permutation import sort_by_expert

__all__ = ["DispatchSplits", "HostCounts", "TokenDispatcher", "all_to_all", "sort_by_expert"]


@dataclass
class DispatchSplits:
    """Split sizes of one dispatch, needed by combine and by the backward passes."""

    input_splits: list[int]  # rows this rank sends to each EP rank
    output_splits: list[int]  # rows this rank receives from each EP rank
    received_counts: list[list[int]]  # [source rank][local expert] rows received
    tokens_per_local_expert: list[int]  # rows per local expert after dispatch
    local_offsets: torch.Tensor | None = None  # [local] int32 end row of each local expert,
    # on the device (for a grouped GEMM; made without reading anything back)


class HostCounts:
    """The one host read of a dropless MoE layer (module docstring): ``counts`` (int64, any
    shape) copied to pinned host memory without blocking; ``wait()`` returns them as lists.

    On CUDA the copy is issued on the current stream with an event behind it, and ``wait``
    blocks the host on that event only. On CPU the same copy runs at once (a CPU run issues the
    operators a GPU run does: the launch count, ``benchmarks/launch_count.py``).
    """

    def __init__(self, counts: torch.Tensor) -> None:
        self._ready: torch.cuda.Event | None = None
        if counts.is_cuda:
            self._host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self._host.copy_(counts, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = torch.empty_like(counts)
            self._host.copy_(counts)

    def wait(self) -> list:
        """The counts as (nested) lists of ints, once the copy has landed."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


def _end_offsets(rows_per_expert: torch.Tensor) -> torch.Tensor:
    """End row of each expert's contiguous block, int32 on the device (grouped GEMM offsets)."""
    return torch.cumsum(rows_per_expert, 0, dtype=torch.int32)


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
    def forward(ctx, rows, output_splits, input_splits, group, link, started):
        ctx.output_splits, ctx.input_splits = output_splits, input_splits
        ctx.group, ctx.link = group, link
        return _exchange(rows, output_splits, input_splits, group, link, started)

    @staticmethod
    def backward(ctx, grad):
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


def _reorder_blocks(rows: torch.Tensor, sizes: list[int], sequence: list[int]) -> torch.Tensor:
    blocks = torch.split(rows, sizes, dim=0)
    return torch.cat([blocks[i] for i in sequence], dim=0)


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
        self, rows: torch.Tensor, rows_per_expert: torch.Tensor, capacity: int | None = None
    ) -> tuple[torch.Tensor, DispatchSplits]:
        """Send expert-ordered ``rows`` to their experts' ranks; returns expert-major local rows.

        ``rows_per_expert [E]`` (device) counts this rank's rows per expert; ``capacity``, when
        the rows are padded to it (every expert exactly ``capacity`` rows on every EP rank),
        makes the split sizes static: no count exchange, no host read.
        """
        # the link models one transfer per dispatch: its time covers the count exchange too
        started = time.perf_counter()
        if capacity is not None:
            splits = self._padded_splits(capacity, rows.device)
        elif self.group is None:
            splits = self._local_splits(rows_per_expert)
        else:
            splits = self._exchange_counts(rows_per_expert)
        if self.group is None:
            if self.link is not None:
                rows = self.link.delay(rows)  # ep = 1: a link that every row crosses
            return rows, splits
        ep, local = self.ep_size, self.num_local_experts
        received = all_to_all(
            rows, splits.output_splits, splits.input_splits, self.group, self.link, started
        )
        if local > 1:
            sizes = [c for row in splits.received_counts for c in row]  # rank-major blocks
            expert_major = [r * local + e for e in range(local) for r in range(ep)]
            received = _reorder_blocks(received, sizes, expert_major)
        return received, splits

    def _local_splits(self, rows_per_expert: torch.Tensor) -> DispatchSplits:
        """Every expert is local: read the row counts on the host (the one host read)."""
        host = HostCounts(rows_per_expert)
        offsets = _end_offsets(rows_per_expert)  # device work that needs no host sizes
        counts = host.wait()
        total = sum(counts)
        return DispatchSplits([total], [total], [counts], counts, offsets)

    def _exchange_counts(self, rows_per_expert: torch.Tensor) -> DispatchSplits:
        """Exchange per-expert counts over EP and read them on the host (the one host read)."""
        send_counts = rows_per_expert.reshape(self.ep_size, self.num_local_experts).contiguous()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        host = HostCounts(torch.stack([send_counts, recv_counts]))  # issued right after
        offsets = _end_offsets(recv_counts.sum(dim=0))  # device work that needs no host sizes
        sent, received_counts = host.wait()  # as late as possible: the sizes are needed now
        return DispatchSplits(
            input_splits=[sum(row) for row in sent],
            output_splits=[sum(row) for row in received_counts],
            received_counts=received_counts,
            tokens_per_local_expert=[
                sum(row[e] for row in received_counts) for e in range(self.num_local_experts)
            ],
            local_offsets=offsets,
        )

    def _padded_splits(self, capacity: int, device: torch.device) -> DispatchSplits:
        """Every expert has ``capacity`` rows on every EP rank: the sizes need no exchange."""
        ep, local = self.ep_size, self.num_local_experts
        per_expert = capacity * ep  # rows of one local expert after dispatch
        offsets = torch.arange(1, local + 1, device=device, dtype=torch.int32) * per_expert
        return DispatchSplits(
            input_splits=[local * capacity] * ep,
            output_splits=[local * capacity] * ep,
            received_counts=[[capacity] * local for _ in range(ep)],
            tokens_per_local_expert=[per_expert] * local,
            local_offsets=offsets,
        )

    def combine(self, rows: torch.Tensor, splits: DispatchSplits) -> torch.Tensor:
        """Inverse of ``dispatch``: expert outputs back to this rank, in its permuted order."""
        if self.group is None:
            return rows if self.link is None else self.link.delay(rows)
        ep, local = self.ep_size, self.num_local_experts
        if local > 1:
            sizes = [splits.received_counts[r][e] for e in range(local) for r in range(ep)]
            rank_major = [e * ep + r for r in range(ep) for e in range(local)]
            rows = _reorder_blocks(rows, sizes, rank_major)
        return all_to_all(rows, splits.input_splits, splits.output_splits, self.group, self.link)
