"""What runs beside what in a combined step: a layer's walk and the slots of a layer pair.

Part 2 of the pair order (``order``'s docstring). ``layer_walk`` numbers a layer's nodes (its
``LayerKinds``: per plan item a node kind, or for a fork the kinds of each branch) and finds
what each reads; ``slots_of`` walks the forward layer's node groups in forward order and the
backward layer's in backward order (a group: one node, or the same node of every branch of a
fork): a comm group of one side and a compute group of the other go side by side, one *slot*;
otherwise the backward's group goes alone (the forward's once the backward is done). A layer
without a partner runs alone, a fork's chains pipelined (``wave_slots``). Pure Python, cached
per layer shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from .timing import COMM, COMPUTE

COMM_READS_HOST = "comm_reads_host"
"""The kind of a comm node that reads values back to the host (a dropless dispatch's split
sizes): a comm node for the order, issued after its slot's compute on a queuing host."""

Side = str  # "F" forward node, "B" backward node, "W" deferred weight gradients
LayerKinds = Sequence[Any]
"""A layer for the pair order: per plan item a node kind, or for a fork the kinds of each
branch (``megapipe.overlap.plan.LayerGraph.kinds``). Nodes are numbered in that order, branch by
branch."""
NodeRef = tuple[Side, int]  # (side, node index in its layer, forward order)
Slot = tuple[tuple[NodeRef, ...], tuple[NodeRef, ...]]  # (comm nodes, compute nodes)


@dataclass(frozen=True, eq=False)  # one walk per shape (``layer_walk``): compared by identity
class LayerWalk:
    """A layer's nodes as the pair order sees them: kinds, what each reads, and its walks."""

    kinds: tuple[str, ...]  # COMPUTE or COMM per node
    reads_host: tuple[bool, ...]
    reads: tuple[tuple[int, ...], ...]  # the nodes of the layer each node reads (forward)
    readers: tuple[tuple[int, ...], ...]  # the nodes that read each node
    groups: tuple[tuple[str, tuple[int, ...]], ...]  # (kind, nodes issued together), in order
    lone: tuple[Any, ...]  # per plan item: (node,) or, for a fork, its chains
    has_comm: bool  # a comm node among them (read per layer: a field, not a computation)

    def lone_slots(self, side: Side) -> list[Slot]:
        """The walk of a layer without a partner: its nodes alone, a fork's chains pipelined
        (``wave_slots``: one chain's comm node beside another's compute node)."""
        per_item: list[list[Slot]] = []
        for item in self.lone:
            if item and isinstance(item[0], tuple):  # a fork's chains
                chains = [list(c) if side == "F" else list(c)[::-1] for c in item]
                per_item.append(wave_slots(chains, self.kinds, side))
            else:
                ref = ((side, item[0]),)
                per_item.append([(ref, ()) if self.kinds[item[0]] == COMM else ((), ref)])
        if side == "B":
            per_item.reverse()
        return [slot for slots in per_item for slot in slots]


def _kind(kind: str) -> tuple[str, bool]:
    if kind == COMM_READS_HOST:
        return COMM, True
    if kind not in (COMPUTE, COMM):
        raise ValueError(f"node kind {kind!r} is not {COMPUTE!r}, {COMM!r} or {COMM_READS_HOST!r}")
    return kind, False


@cache
def layer_walk(kinds: tuple) -> LayerWalk:
    """Number the nodes of a layer's kinds (``LayerKinds`` as tuples; ``walk_of`` takes lists)
    and find what each reads. Cached: a run has a few shapes of layer, each walked once."""
    flat: list[tuple[str, bool]] = []
    reads: list[tuple[int, ...]] = []
    groups: list[tuple[str, tuple[int, ...]]] = []
    lone: list[Any] = []
    last: tuple[int, ...] = ()
    for item in kinds:
        if isinstance(item, str):
            flat.append(_kind(item))
            reads.append(last)
            last = (len(flat) - 1,)
            groups.append((flat[-1][0], last))
            lone.append(last)
            continue
        before = last
        ends: list[int] = []
        chains: list[tuple[int, ...]] = []
        for branch in item:
            chain, previous = [], before
            for kind in branch:
                flat.append(_kind(kind))
                reads.append(previous)
                previous = (len(flat) - 1,)
                chain.append(len(flat) - 1)
            ends += previous
            chains.append(tuple(chain))
        for i in range(len(chains[0])):  # the branches' i-th nodes back to back
            group = tuple(chain[i] for chain in chains)
            groups.append((flat[group[0]][0], group))
        lone.append(tuple(chains))
        last = before + tuple(ends)
    readers = tuple(tuple(m for m, r in enumerate(reads) if n in r) for n in range(len(flat)))
    kinds_flat = tuple(k for k, _ in flat)
    return LayerWalk(
        kinds_flat,
        tuple(h for _, h in flat),
        tuple(reads),
        readers,
        tuple(groups),
        tuple(lone),
        COMM in kinds_flat,
    )


def wave_slots(chains: list[list[int]], kinds: Sequence[str], side: Side) -> list[Slot]:
    """Slots for parallel chains with no other microbatch beside them: in each slot the ready
    comm node and the ready compute node that come earliest in their chains (then the lowest
    chain), a node being ready once its chain predecessor ran in an earlier slot. For k chains
    of (dispatch, experts, combine): dispatch 0 | -, dispatch 1 | experts 0, ..., combine 0 |
    experts k-1, ..., combine k-1: the comm stream never waits for a whole wave."""
    position = [0] * len(chains)
    slots: list[Slot] = []
    while any(p < len(chain) for p, chain in zip(position, chains)):
        chosen: dict[str, tuple[int, int]] = {}
        for c, chain in enumerate(chains):
            if position[c] < len(chain):
                kind = kinds[chain[position[c]]]
                if kind not in chosen or (position[c], c) < chosen[kind]:
                    chosen[kind] = (position[c], c)
        slot: list[tuple[NodeRef, ...]] = [(), ()]
        for kind, (_, c) in chosen.items():
            slot[0 if kind == COMM else 1] = ((side, chains[c][position[c]]),)
            position[c] += 1
        slots.append((slot[0], slot[1]))
    return slots


@cache
def slots_of(forward: LayerWalk | None, backward: LayerWalk | None) -> tuple[Slot, ...]:
    """One forward layer beside one backward layer (module docstring); cached per shape."""
    if forward is None or backward is None:  # a layer without a partner runs alone
        if backward is not None:
            return tuple(backward.lone_slots("B"))
        return tuple(forward.lone_slots("F")) if forward is not None else ()
    f_groups = list(forward.groups)  # forward order
    b_groups = list(reversed(backward.groups))  # backward order
    slots: list[Slot] = []
    while f_groups or b_groups:
        f = f_groups[0] if f_groups else None
        b = b_groups[0] if b_groups else None
        if f is not None and b is not None and f[0] != b[0]:  # comm beside compute
            f_groups.pop(0)
            b_groups.pop(0)
            f_refs = tuple(("F", n) for n in f[1])
            b_refs = tuple(("B", n) for n in b[1])
            slots.append((f_refs, b_refs) if f[0] == COMM else (b_refs, f_refs))
        elif b is not None:  # same kind (or no forward left): the backward's group alone
            b_groups.pop(0)
            refs = tuple(("B", n) for n in b[1])
            slots.append((refs, ()) if b[0] == COMM else ((), refs))
        else:  # the forward's group alone
            assert f is not None
            f_groups.pop(0)
            refs = tuple(("F", n) for n in f[1])
            slots.append((refs, ()) if f[0] == COMM else ((), refs))
    return tuple(slots)
