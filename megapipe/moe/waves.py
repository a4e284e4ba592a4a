"""Expert groups: one MoE layer's all-to-alls in k waves, so that waves overlap each other.

A forward or backward action with no other microbatch beside it hides nothing behind its
all-to-alls. Split into waves, one wave's dispatch or combine runs beside another wave's
expert compute (``megapipe.pairing.order.wave_slots``). The waves here are *expert groups*:
the experts each EP rank holds are cut into k contiguous groups, and wave g carries the rows of
every token routed to an expert of group g, on every rank:

- route sorts the rows group-major (group, destination rank, local expert, token) instead of
  expert-major, by relabelling expert e = r * local + l to ``ep * first_g + r * size_g + (l -
  first_g)`` before the usual stable sort (so capacity still keeps each expert's earliest tokens);
- wave g's dispatch sends the group's block of those rows (wave 0 also exchanges the counts of
  all groups: the one host read of the layer stays in its first comm node), its experts node runs
  the group's experts, its combine sends the results back;
- finish concatenates the waves' results, which lie where the permutation expects them.

Every expert receives exactly the rows of the one-wave layer, in the same order (source rank,
then token), and runs the same per-expert GEMMs, so outputs, input gradients and expert weight
gradients are bitwise those of the one-wave layer (a group's weight gradient lands in its slice
of the parameter's gradient; the other slices add exact zeros). Routing and the auxiliary loss
are computed once over all tokens, as before. The price: k exchanges instead of one (each pays
a link's latency), and k cannot exceed the experts a rank holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megapipe.moe.dispatcher import HostCounts, TokenDispatcher, _reorder_blocks, all_to_all
from megapipe.overlap.plan import NodeFn

Tensors = tuple[torch.Tensor, ...]


def expert_groups(num_local_experts: int, waves: int) -> list[tuple[int, int]]:
    """``waves`` contiguous groups of a rank's local experts, as even as possible: (first,
    size) each."""
    if not 1 <= waves <= num_local_experts:
        raise ValueError(
            f"moe_a2a_waves={waves} must be between 1 and the {num_local_experts} experts each "
            "EP rank holds (waves split a rank's experts into groups)"
        )
    base, extra = divmod(num_local_experts, waves)
    groups, first = [], 0
    for g in range(waves):
        size = base + (1 if g < extra else 0)
        groups.append((first, size))
        first += size
    return groups


@dataclass
class WaveSplits:
    """Split sizes of one expert group's exchange (see ``DispatchSplits``)."""

    rows: tuple[int, int]  # its block [start, end) of the layer's group-major rows
    input_splits: list[int]  # rows sent to each EP rank
    output_splits: list[int]  # rows received from each EP rank
    received_counts: list[list[int]]  # [source rank][expert of the group]
    tokens_per_local_expert: list[int]


class WaveDispatch:
    """Dispatch and combine of one MoE layer in expert groups, over ``dispatcher``'s group."""

    def __init__(self, dispatcher: TokenDispatcher, waves: int) -> None:
        self.dispatcher = dispatcher
        self.groups = expert_groups(dispatcher.num_local_experts, waves)

    def relabel(self, indices: torch.Tensor) -> torch.Tensor:
        """Routing choices as group-major labels (sorting them orders rows group-major),
        computed on the device from the group sizes (no table: a CUDA graph of the route
        reads no memory made outside it)."""
        ep, local = self.dispatcher.ep_size, self.dispatcher.num_local_experts
        base, extra = divmod(local, len(self.groups))
        edge = extra * (base + 1)  # the first ``extra`` groups hold base + 1 experts
        rank, offset = indices // local, indices % local
        low = offset < edge
        first = torch.where(
            low, offset // (base + 1) * (base + 1), edge + (offset - edge) // base * base
        )
        size = torch.where(low, base + 1, base)
        return ep * first + rank * size + (offset - first)

    def splits(self, rows_per_label: torch.Tensor, capacity: int | None = None) -> list[WaveSplits]:
        """Plan every group: with a ``capacity`` (every expert padded to it on every rank) the
        sizes are static; else exchange the per-expert counts (one small all-to-all) and read
        them on the host once (the layer's one host read, ``dispatcher.HostCounts``)."""
        d = self.dispatcher
        ep, local = d.ep_size, d.num_local_experts
        if capacity is not None:
            send_counts = recv_counts = [[capacity] * local for _ in range(ep)]
        else:
            experts = torch.arange(ep * local, device=rows_per_label.device)
            counts = rows_per_label[self.relabel(experts)]  # per expert, in expert order
            send = counts.reshape(ep, local).contiguous()
            recv = send
            if d.group is not None:
                recv = torch.empty_like(send)
                dist.all_to_all_single(recv, send, group=d.group)
            send_counts, recv_counts = HostCounts(torch.stack([send, recv])).wait()
        splits, start = [], 0
        for first, size in self.groups:
            members = range(first, first + size)
            sent = [sum(send_counts[r][e] for e in members) for r in range(ep)]
            received = [[recv_counts[r][e] for e in members] for r in range(ep)]
            splits.append(
                WaveSplits(
                    rows=(start, start + sum(sent)),
                    input_splits=sent,
                    output_splits=[sum(row) for row in received],
                    received_counts=received,
                    tokens_per_local_expert=[sum(row[i] for row in received) for i in range(size)],
                )
            )
            start += sum(sent)
        return splits

    def dispatch(
        self, group: int, rows: torch.Tensor, splits: list[WaveSplits], started: float | None = None
    ) -> torch.Tensor:
        """Send group ``group``'s block of the group-major ``rows``; returns its rows
        expert-major (local expert, then source rank)."""
        d, wave = self.dispatcher, splits[group]
        block = rows[wave.rows[0] : wave.rows[1]]
        if d.group is None:
            return block if d.link is None else d.link.delay(block)
        received = all_to_all(
            block, wave.output_splits, wave.input_splits, d.group, d.link, started
        )
        size, ep = self.groups[group][1], d.ep_size
        if size > 1:
            sizes = [c for row in wave.received_counts for c in row]  # rank-major blocks
            expert_major = [r * size + e for e in range(size) for r in range(ep)]
            received = _reorder_blocks(received, sizes, expert_major)
        return received

    def combine(self, group: int, rows: torch.Tensor, splits: list[WaveSplits]) -> torch.Tensor:
        """Inverse of ``dispatch``: the group's expert outputs back, in this rank's order."""
        d, wave = self.dispatcher, splits[group]
        if d.group is None:
            return rows if d.link is None else d.link.delay(rows)
        size, ep = self.groups[group][1], d.ep_size
        if size > 1:
            sizes = [wave.received_counts[r][e] for e in range(size) for r in range(ep)]
            rank_major = [e * ep + r for r in range(ep) for e in range(size)]
            rows = _reorder_blocks(rows, sizes, rank_major)
        return all_to_all(rows, wave.input_splits, wave.output_splits, d.group, d.link)


class WaveNodes:
    """The node functions of a MoE layer in waves (``MoELayer.wave_plan`` lays them out; the
    state is its ``MoEState``, which imports this module):
    route (the layer's, relabelled group-major, its rows handed to every wave), and per group
    its dispatch (wave 0 plans every group: the count exchange and the layer's one host read),
    experts and combine."""

    def __init__(self, by_wave: WaveDispatch, experts: Callable[..., torch.Tensor]) -> None:
        self.by_wave, self.expert_fn = by_wave, experts
        self.count = len(by_wave.groups)

    def route(self, layer_route: Callable[..., Tensors]) -> NodeFn:
        def fn(state: Any, tensors: Tensors) -> Tensors:
            *lead, rows = layer_route(state, tensors, relabel=self.by_wave.relabel)
            return tuple(lead) + (rows,) * self.count  # each wave's dispatch takes its block

        return fn

    def dispatch(self, g: int) -> NodeFn:
        def fn(state: Any, tensors: Tensors) -> Tensors:
            started = None
            if g == 0:  # the count exchange (and the layer's one host read) of all groups
                started = time.perf_counter()
                assert state.rows_per_expert is not None  # route wrote it
                state.wave_splits = self.by_wave.splits(state.rows_per_expert, state.capacity)
            return (self.by_wave.dispatch(g, tensors[0], _splits(state), started),)

        return fn

    def experts(self, g: int) -> NodeFn:
        def fn(state: Any, tensors: Tensors) -> Tensors:
            counts = _splits(state)[g].tokens_per_local_expert
            first = self.by_wave.groups[g][0]
            return (self.expert_fn(tensors[0], counts, state=state, group_first=first),)

        return fn

    def combine(self, g: int) -> NodeFn:
        def fn(state: Any, tensors: Tensors) -> Tensors:
            return (self.by_wave.combine(g, tensors[0], _splits(state)),)

        return fn


def _splits(state: Any) -> list[WaveSplits]:
    assert state.wave_splits is not None  # wave 0's dispatch wrote it
    return state.wave_splits
