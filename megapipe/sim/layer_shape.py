"""A layer as the pair planner sees it: its nodes' kinds, what each reads, and its walks.

``layer_shape`` numbers the nodes of a ``Shape`` (the kinds of a layer plan's nodes, a fork as
the kinds of each branch: ``megapipe.overlap.plan.LayerGraph.shape``) and finds what each node
reads; ``LayerShape.steps`` walks a layer that has a partner, ``lone_slots`` one that has none
(a fork's branches pipelined by ``chunk_slots``). Pure Python, used by ``pair_plan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

from .wgrad_fill import COMM, COMPUTE

Side = str  # "F" forward node, "B" backward node, "W" deferred weight gradients
Shape = Sequence[Any]
"""A layer for the planner: per plan item, a node kind, or for a fork the kinds of each branch
(``megapipe.overlap.plan.LayerGraph.shape``). Nodes are numbered in that order, branch by branch."""
NodeRef = tuple[Side, int]  # (side, node index in its layer, forward order)
Step = tuple[str, tuple[int, ...]]  # (kind, nodes of one layer issued back to back)
Slot = tuple[tuple[NodeRef, ...], tuple[NodeRef, ...]]  # (comm nodes, compute nodes) side by side


@dataclass(frozen=True)
class LayerShape:
    """A layer's nodes as the planner sees them: kinds, what each reads, and walk orders."""

    kinds: tuple[str, ...]
    reads: tuple[tuple[int, ...], ...]  # the nodes of the layer each node reads (forward)
    readers: tuple[tuple[int, ...], ...]  # the nodes that read each node
    forks: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...]  # (item position, branch nodes)
    items: tuple[tuple[int, ...] | None, ...]  # per plan item: its node (a 1-tuple) or None (fork)

    @property
    def has_comm(self) -> bool:
        return COMM in self.kinds

    def steps(self, direction: str) -> list[Step]:
        """The walk of a layer that has a partner: node by node, a fork's branches grouped by
        position (the branches' i-th nodes back to back, branch 0 first); backward in reverse."""
        steps: list[Step] = []
        for position, item in enumerate(self.items):
            if item is not None:
                steps.append((self.kinds[item[0]], item))
                continue
            branches = dict(self.forks)[position]
            for i in range(len(branches[0])):
                group = tuple(branch[i] for branch in branches)
                steps.append((self.kinds[group[0]], group))
        return steps if direction == "F" else steps[::-1]

    def lone_slots(self, side: Side) -> list[Slot]:
        """The walk of a layer without a partner: nodes alone, a fork's branches pipelined
        (``chunk_slots``: one branch's comm node beside another's compute node)."""
        forks = dict(self.forks)
        per_item: list[list[Slot]] = []
        for position, item in enumerate(self.items):
            if item is None:
                chains = [list(b) if side == "F" else list(b)[::-1] for b in forks[position]]
                per_item.append(chunk_slots(chains, self.kinds, side))
                continue
            ref = ((side, item[0]),)
            per_item.append([(ref, ()) if self.kinds[item[0]] == COMM else ((), ref)])
        if side == "B":
            per_item.reverse()
        return [slot for slots in per_item for slot in slots]


def chunk_slots(chains: list[list[int]], kinds: Sequence[str], side: Side) -> list[Slot]:
    """Slots for parallel chains with no other microbatch beside them: in each slot the ready
    comm node and the ready compute node that come earliest in their chains (then the lowest
    branch), a node being ready once its chain predecessor ran in an earlier slot. For k chains
    of (dispatch, experts, combine) this is dispatch 0 | -, dispatch 1 | experts 0, ...,
    combine 0 | experts k-1, ..., combine k-1: the comm stream never waits for a whole chunk."""
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


def layer_shape(shape: Shape) -> LayerShape:
    """Number the nodes of a shape and find what each reads (see ``Shape``). A shape given as
    a tuple is looked up in a small cache first: the engine asks for the same few shapes for
    every layer of every step, and a ``LayerShape`` is immutable."""
    if isinstance(shape, tuple):
        try:
            return _cached_layer_shape(shape)
        except TypeError:  # a list somewhere inside: not hashable
            pass
    return _layer_shape(shape)


def _layer_shape(shape: Shape) -> LayerShape:
    kinds: list[str] = []
    reads: list[tuple[int, ...]] = []
    forks: list[tuple[int, tuple[tuple[int, ...], ...]]] = []
    items: list[tuple[int, ...] | None] = []
    last: tuple[int, ...] = ()
    for position, item in enumerate(shape):
        if isinstance(item, str):
            if item not in (COMPUTE, COMM):
                raise ValueError(f"node kind {item!r} is not {COMPUTE!r} or {COMM!r}")
            kinds.append(item)
            reads.append(last)
            last = (len(kinds) - 1,)
            items.append(last)
            continue
        before, ends, branches = last, [], []
        for branch in item:
            nodes, previous = [], before
            for kind in branch:
                kinds.append(kind)
                reads.append(previous)
                previous = (len(kinds) - 1,)
                nodes.append(len(kinds) - 1)
            ends += previous
            branches.append(tuple(nodes))
        forks.append((position, tuple(branches)))
        items.append(None)
        last = before + tuple(ends)
    readers = tuple(tuple(m for m, r in enumerate(reads) if n in r) for n in range(len(kinds)))
    return LayerShape(tuple(kinds), tuple(reads), readers, tuple(forks), tuple(items))


_cached_layer_shape = lru_cache(maxsize=256)(_layer_shape)
