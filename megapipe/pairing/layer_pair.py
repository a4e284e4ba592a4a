"""One forward layer beside one backward layer, worked out once per pair of layer shapes.

The pair order (``order``) places each layer pair of a combined step slot by slot. What it
places depends on the two layers' node kinds alone: the slots (``slots_of``, what runs beside
what) and, for each node, the nodes of the pair it waits for on the other stream (the nodes it
reads; a backward node: the nodes that read it) and whether it waits for its side's previous
layer. ``layer_pair`` works that out once per pair of layer walks (cached) and ``IssueOrder``
puts it into each step with the issues' names. Pure Python, no torch.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

from .slots import LayerWalk, NodeRef, Side, slots_of
from .timing import COMM, COMPUTE


class PairEntry(NamedTuple):
    """One node of a layer pair (``layer_pair``): what it waits for inside the pair (entries
    on the other stream), and whether it waits for its side's previous layer."""

    stream: str
    side: Side
    node: int
    waits: tuple[int, ...]  # earlier entries of the pair, on the other stream
    after_previous: bool  # it reads its side's previous layer (its layer's input)
    reads_host: bool
    signals: bool  # an entry of the pair waits for it


class LayerPair(NamedTuple):
    """A layer pair's slots (``layer_pair``), with where each side ends."""

    # per slot: (its comm entries, its compute entries)
    slots: tuple[tuple[tuple[PairEntry, ...], tuple[PairEntry, ...]], ...]
    b_comm: tuple[int, ...]  # the slots holding a backward comm node
    f_end: int  # the entry of the forward's last node (-1: none)
    b_end: int  # the entry of the backward's first node (-1: none)


@cache
def layer_pair(forward: LayerWalk | None, backward: LayerWalk | None) -> LayerPair:
    """The slots of a layer pair with each node's waits inside the pair worked out once."""
    entries: list[PairEntry] = []  # in issue order: per slot its comm, then its compute entries
    entry_of: dict[NodeRef, int] = {}
    shape = []  # per slot: (comm entries, compute entries)
    for comm_refs, compute_refs in slots_of(forward, backward):
        for stream, refs in ((COMM, comm_refs), (COMPUTE, compute_refs)):
            for side, node in refs:
                walk = forward if side == "F" else backward
                assert walk is not None
                inputs = walk.reads[node] if side == "F" else walk.readers[node]
                waits = tuple(
                    sorted(entry_of[(side, n)] for n in inputs if walk.kinds[n] != stream)
                )
                entry_of[(side, node)] = len(entries)
                reads_host = side == "F" and walk.reads_host[node]  # its backward reads none
                entries.append(PairEntry(stream, side, node, waits, not inputs, reads_host, False))
        shape.append((len(comm_refs), len(compute_refs)))
    waited = {w for entry in entries for w in entry.waits}
    entries = [e._replace(signals=n in waited) for n, e in enumerate(entries)]
    slots, start = [], 0
    for comm, compute in shape:
        slots.append(
            (
                tuple(entries[start : start + comm]),
                tuple(entries[start + comm : start + comm + compute]),
            )
        )
        start += comm + compute
    b_comm = tuple(n for n, (comm, _) in enumerate(slots) if any(e.side == "B" for e in comm))
    f_end = entry_of[("F", len(forward.kinds) - 1)] if forward is not None else -1
    b_end = entry_of[("B", 0)] if backward is not None else -1
    return LayerPair(tuple(slots), b_comm, f_end, b_end)
