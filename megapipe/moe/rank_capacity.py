"""Sync-free dispatch: the dropless exchange in fixed-size buffers, counts kept on the device.

Megatron's ``--moe-expert-rank-capacity-factor F`` sizes each EP rank's expert buffer at
``F x`` its own routed rows (local tokens x top-k), so shapes are static and nothing is read
back to the host; a step in which any rank's rows do not fit runs again without the capacity.
This module is the exchange of that mode (``RankCapacityDispatch``), for gloo and NCCL alike:

- every (source, destination) pair of EP ranks gets a lane of ``lane_rows`` =
  ceil(F x rows / ep) rows, so both all-to-alls (rows, and the [ep, local] counts) have equal,
  static splits and the receive buffer holds ep x lane_rows rows (about F x rows). A pair that
  needs more rows than its lane overflows: the rows past the lane are not sent and the
  ``overflow`` tensor (a device bool) says so. Overflow is stricter per pair than a budget on
  the receiver's total, and costs only a step run again;
- on the receiver the rows are gathered, on the device, into the dropless expert-major order
  (local expert, then source rank) at the front of the buffer, zeros after; ``offsets`` (int32,
  each local expert's end row) drive a grouped GEMM;
- ``combine`` is the exact inverse. Every movement is an index gather whose backward is the
  matching index add, and each all-to-all's backward is the reverse all-to-all.

Without overflow the first rows of ``dispatch``'s output are bitwise the dropless dispatcher's
(``TokenDispatcher.dispatch``) and ``combine`` returns bitwise its rows (tested). The MoE layer
(``moe.layer``) runs the phases in its nodes: ``place_sends`` in route, ``exchange`` in
dispatch, ``expert_order`` and the gathers in experts, ``return_exchange`` in combine, the last
gather in finish, so its all-to-all nodes hold nothing but all-to-alls and its compute nodes can be
captured whole (static shapes, device tensors only); it ORs ``overflow`` into a device flag
per layer, which the training step reads once, after the step (``train.step``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.moe.dispatcher import TokenDispatcher, all_to_all
from megapipe.moe.link import EmulatedLink


def lane_rows(rows: int, factor: float, ep: int) -> int:
    """Rows of one (source, destination) lane: ceil(``factor`` x ``rows`` / ep), at least 1."""
    if not factor > 0:
        raise ValueError(f"rank capacity factor={factor} must be > 0")
    return max(1, math.ceil(factor * rows / ep))


def buffer_bytes(lane: int, ep: int, hidden: int, element_size: int) -> int:
    """Bytes of one MoE layer's fixed buffers for one microbatch: the send and receive buffers
    of the dispatch and of the combine, and the expert rows in and out (six of ep x lane rows
    of ``hidden`` elements)."""
    return 6 * ep * lane * hidden * element_size


@dataclass
class LaneSends:
    """The sending side of one dispatch (``RankCapacityDispatch.place_sends``); device tensors."""

    counts: torch.Tensor  # [ep, local] int64 rows this rank sends to each expert
    send_index: torch.Tensor  # [ep * lane] input row sent in each buffer row (n: zeros)
    return_index: torch.Tensor  # [n] buffer row each input row comes back in (ep * lane: zeros)
    overflow: torch.Tensor  # bool scalar: some lane of this rank's sends was too small


@dataclass
class RankCapacitySplits:
    """What ``combine`` and the backward need of one dispatch; device tensors only."""

    send_index: torch.Tensor  # [ep * lane] input row sent in each buffer row (n: zeros)
    return_index: torch.Tensor  # [n] buffer row each input row comes back in (ep * lane: zeros)
    expert_index: torch.Tensor  # [ep * lane] received row of each expert row (ep * lane: zeros)
    received_index: torch.Tensor  # [ep * lane] expert row of each received row (same)
    offsets: torch.Tensor  # [local] int32 end row of each local expert in the expert rows
    overflow: torch.Tensor  # bool scalar: some lane of this rank's sends was too small


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows[index]`` where ``index == len(rows)`` reads a row of zeros (one differentiable
    gather; its backward adds into ``rows`` by the same index)."""
    padded = torch.cat([rows, rows.new_zeros((1,) + tuple(rows.shape[1:]))])
    return padded.index_select(0, index)


class RankCapacityDispatch:
    """Dispatch and combine of expert-ordered rows in fixed-size lanes (module docstring).

    ``group``: the EP group (None: one rank, no exchange); ``num_experts`` divisible by its
    size; ``lane``: rows per (source, destination) lane (``lane_rows``).
    """

    def __init__(
        self,
        num_experts: int,
        lane: int,
        group: dist.ProcessGroup | None = None,
        link: EmulatedLink | None = None,
    ) -> None:
        self.ep = 1 if group is None else dist.get_world_size(group)
        if num_experts % self.ep:
            raise ValueError(f"num_experts={num_experts} must be divisible by ep={self.ep}")
        if lane < 1:
            raise ValueError(f"lane={lane} rows must be >= 1")
        self.local = num_experts // self.ep
        self.lane = lane
        self.group = group if self.ep > 1 else None
        self.link = link

    @property
    def buffer_rows(self) -> int:
        """Rows of the receive (and expert) buffer: ep x lane."""
        return self.ep * self.lane

    def buffer_bytes(self, hidden: int, dtype: torch.dtype) -> int:
        """Bytes of one layer's fixed buffers per microbatch (``buffer_bytes``)."""
        return buffer_bytes(self.lane, self.ep, hidden, torch.empty((), dtype=dtype).element_size())

    def place_sends(self, rows_per_expert: torch.Tensor, n: int) -> LaneSends:
        """The sending side of a dispatch of ``n`` expert-ordered rows with ``rows_per_expert
        [E]`` (device): which row goes in each lane slot, each row's way back, the overflow.
        Device work only, no exchange: the MoE layer runs it in its route node (compute)."""
        device, ep, local, lane = rows_per_expert.device, self.ep, self.local, self.lane
        counts = rows_per_expert.reshape(ep, local).to(torch.int64)
        per_dest = counts.sum(dim=1)  # [ep] rows this rank sends to each EP rank
        first = torch.cumsum(per_dest, 0) - per_dest  # each destination's first row
        position = torch.arange(lane, device=device)
        valid = position.unsqueeze(0) < per_dest.unsqueeze(1)  # [ep, lane]
        send_index = torch.where(valid, first.unsqueeze(1) + position, n).reshape(-1)
        overflow = (per_dest > lane).any()
        # each input row's way back: its destination's lane, or a zero row past the lane
        dest = torch.repeat_interleave(torch.arange(ep, device=device), per_dest, output_size=n)
        within = torch.arange(n, device=device) - first[dest]
        return_index = torch.where(within < lane, dest * lane + within, ep * lane)
        return LaneSends(counts, send_index, return_index, overflow)

    def exchange(
        self, send: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The all-to-alls of a dispatch (the only part on the comm stream): the lanes ``send
        [ep * lane, h]`` and the ``counts [ep, local]``; (received lanes, received counts)."""
        started = time.perf_counter()
        if self.group is None:
            return (send if self.link is None else self.link.delay(send)), counts
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts.contiguous(), group=self.group)
        splits = [self.lane] * self.ep
        return all_to_all(send, splits, splits, self.group, self.link, started), received_counts

    def return_exchange(self, back: torch.Tensor) -> torch.Tensor:
        """The all-to-all of a combine: the lanes back to the ranks that sent them."""
        if self.group is None:
            return back if self.link is None else self.link.delay(back)
        sizes = [self.lane] * self.ep
        return all_to_all(back, sizes, sizes, self.group, self.link)

    def dispatch(
        self, rows: torch.Tensor, rows_per_expert: torch.Tensor
    ) -> tuple[torch.Tensor, RankCapacitySplits]:
        """``rows [n, h]`` in expert order with ``rows_per_expert [E]`` (device) -> the expert
        rows ``[ep * lane, h]`` of this rank's local experts (expert-major at the front, zeros
        after) and the splits. No host read, static shapes. The phases in one call
        (``place_sends``, ``exchange``, ``expert_order``), as the MoE layer runs them in its
        nodes."""
        sends = self.place_sends(rows_per_expert, rows.shape[0])
        received, received_counts = self.exchange(gather_rows(rows, sends.send_index), sends.counts)
        expert_index, received_index, offsets = self.expert_order(received_counts)
        return gather_rows(received, expert_index), RankCapacitySplits(
            sends.send_index,
            sends.return_index,
            expert_index,
            received_index,
            offsets,
            sends.overflow,
        )

    def expert_order(
        self, received_counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where each received row goes in the expert-major order (local expert, then source
        rank), both ways, and the experts' end rows; past-the-buffer positions (an overflowed
        step's) read zeros."""
        device, ep, lane, total = received_counts.device, self.ep, self.lane, self.buffer_rows
        sent_by = received_counts.sum(dim=1)  # [ep] rows each source sent (claimed)
        ends = torch.cumsum(received_counts, dim=1)  # [ep, local] end of each expert per source
        position = torch.arange(lane, device=device).expand(ep, lane).contiguous()
        expert = torch.searchsorted(ends, position, right=True).clamp(max=self.local - 1)
        within = position - (ends - received_counts).gather(1, expert)
        per_expert = received_counts.sum(dim=0)  # [local]
        expert_start = torch.cumsum(per_expert, 0) - per_expert
        before = torch.cumsum(received_counts, dim=0) - received_counts  # earlier sources' rows
        target = expert_start[expert] + before.gather(1, expert) + within
        valid = (position < sent_by.unsqueeze(1)) & (target < total)
        received_index = torch.where(valid, target, total).reshape(-1)  # received row -> expert row
        expert_index = torch.full((total + 1,), total, dtype=torch.int64, device=device)
        expert_index.index_copy_(0, received_index, torch.arange(total, device=device))
        expert_index = expert_index[:total]
        # a dropped row wrote its own number at position ``total`` only, sliced off above
        offsets = torch.cumsum(per_expert, 0).clamp(max=total).to(torch.int32)
        return expert_index, received_index, offsets

    def combine(self, expert_rows: torch.Tensor, splits: RankCapacitySplits) -> torch.Tensor:
        """Inverse of ``dispatch``: expert outputs ``[ep * lane, h]`` back to this rank's rows,
        in its expert order (rows past a lane, an overflowed step's, come back as zeros)."""
        back = gather_rows(expert_rows, splits.received_index)
        return gather_rows(self.return_exchange(back), splits.return_index)


class LaneExchanges:
    """A MoE layer's rank-capacity exchanges over ``dispatcher``'s group, one per lane size
    (a microbatch's row count sets it), made on first use: ``lanes(lane)``."""

    def __init__(self, dispatcher: TokenDispatcher) -> None:
        self.dispatcher = dispatcher
        self._by_lane: dict[int, RankCapacityDispatch] = {}

    def __call__(self, lane: int) -> RankCapacityDispatch:
        exchange = self._by_lane.get(lane)
        if exchange is None:
            d = self.dispatcher
            exchange = self._by_lane[lane] = RankCapacityDispatch(
                d.num_experts, lane, d.group, d.link
            )
        return exchange
