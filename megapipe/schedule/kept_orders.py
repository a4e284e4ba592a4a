"""Kept orders: a runner's pair orders planned once per shape of combined step.

Without node times (the count rule) a combined step's order (``pair_order.IssueOrder``) depends
on its layers' kinds alone, and a training run repeats a few shapes of step: the executor keeps
what it planned (``PairOrders``) and a later step of the same shape takes those issues instead
of planning them again (``ReusedOrder``). Pure Python, no torch.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from .node_timing import LayerTimes
from .pair_order import Issue, IssueOrder, LayerKinds, LayerWalk, Side


class _Record(NamedTuple):
    order: IssueOrder  # finished
    forward_kinds: tuple[Any, ...]  # each forward layer's kinds, as given
    cuts: tuple[int, ...]  # the issues before each forward layer's, and before finish's


class PairOrders:
    """The orders a runner of many combined steps planned, kept for the steps that follow.

    Without node times (the count rule) an order depends on the layers' kinds alone, and a
    training run repeats a few shapes of step. ``order(backward_layers, defer_wgrad,
    host_runs_compute)`` returns what ``IssueOrder`` would, taking the issues of the last order
    planned for the same backward layers while the forward layers come with the same kinds, and
    planning afresh from the first one whose kinds differ: the same issues, planned once.
    Layers' kinds come as tuples (``LayerGraph.kinds``). Held by its runner (each executor has
    one) and used by one combined step at a time.
    """

    KEEP = 64  # orders kept at most (the oldest goes first)

    def __init__(self) -> None:
        self._records: dict[Any, _Record] = {}

    def order(self, backward_layers: Sequence[LayerKinds], defer_wgrad: bool = False,
              host_runs_compute: bool = False) -> "ReusedOrder":
        key = (tuple(backward_layers), defer_wgrad, host_runs_compute)
        return ReusedOrder(self, key, self._records.get(key))

    def _keep(self, key: Any, record: _Record) -> None:
        self._records.pop(key, None)
        if len(self._records) >= self.KEEP:
            del self._records[next(iter(self._records))]
        self._records[key] = record


class ReusedOrder:
    """An ``IssueOrder`` (count rule) that replays a recorded order while the forward layers'
    kinds are those it was planned with (``PairOrders``); ``issues``, ``position``,
    ``forward_layers`` and ``backward_layers`` read as an ``IssueOrder``'s."""

    clock = None  # the count rule: no node times

    def __init__(self, orders: PairOrders, key: Any, record: _Record | None) -> None:
        self._orders, self._key, self._record = orders, key, record
        self._forward_kinds: list[Any] = []
        self._cuts: list[int] = []
        self._live: IssueOrder | None = None if record is not None else self._planned(0)

    def _planned(self, layers: int) -> IssueOrder:
        """A fresh order, given the first ``layers`` forward layers seen so far."""
        backward, defer, host = self._key
        order = IssueOrder(backward, defer, host_runs_compute=host)
        for kinds in self._forward_kinds[:layers]:
            order.forward_layer(kinds)
        return order

    @property
    def _order(self) -> IssueOrder:
        return self._live if self._live is not None else self._record.order  # type: ignore

    @property
    def issues(self) -> list[Issue]:
        return self._order.issues

    @property
    def position(self) -> dict[tuple[Side, int, int], int]:
        return self._order.position

    @property
    def forward_layers(self) -> list[LayerWalk]:
        return self._order.forward_layers

    @property
    def backward_layers(self) -> list[LayerWalk]:
        return self._order.backward_layers

    def forward_layer(self, kinds: LayerKinds, times: LayerTimes | None = None) -> list[Issue]:
        layer = len(self._forward_kinds)
        self._forward_kinds.append(kinds)
        record = self._record
        if self._live is None:
            assert record is not None
            if layer < len(record.forward_kinds) and record.forward_kinds[layer] == kinds:
                self._cuts.append(record.cuts[layer])
                return record.order.issues[record.cuts[layer]:record.cuts[layer + 1]]
            self._live = self._planned(layer)  # differs from here on
        self._cuts.append(len(self._live.issues))
        return self._live.forward_layer(kinds)

    def finish(self) -> list[Issue]:
        record = self._record
        if self._live is None:
            assert record is not None
            if len(self._forward_kinds) == len(record.forward_kinds):
                return record.order.issues[record.cuts[-1]:]
            self._live = self._planned(len(self._forward_kinds))
        self._cuts.append(len(self._live.issues))
        issues = self._live.finish()
        self._orders._keep(self._key, _Record(self._live, tuple(self._forward_kinds),
                                              tuple(self._cuts)))
        return issues
