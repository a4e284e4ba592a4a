"""What each action of a schedule costs under a cost model, for every action at once.

ActionInputs with the same kinds and stage multipliers are timed by the same program of pieces
(``programs.action_ops``): a template. The simulation needs each action's end as a function of its
start, and the metrics need every piece. Both come from ``programs.op_times``
(``schedule.node_timing``), which runs a template's
program on one start or on the starts of all its actions together (the same float operations,
element by element), so the figures are those of timing each action on its own.

When every duration is a multiple of one power of two 1/q and every time stays below 2**53 / q,
float additions are exact: a action then simply ends at start + the template's duration, whatever
the start (``exact``). Otherwise the program is run for each action as it is simulated.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from ..pairing.timing import COMM, COMPUTE
from ..schedule.ir import Action, Kind
from ..schedule.table import KINDS, OVERLAP, ActionTable
from .costs import Costs
from .programs import action_ops, half_ends, op_times

_EXACT_LIMIT = 2**53


class ActionCosts:
    """The templates of a compute-only table's actions under ``costs``."""

    def __init__(self, table: ActionTable, costs: Costs, num_stages: int) -> None:
        self.costs = costs
        self.template, examples = self._templates(table, costs, num_stages)
        self.ops = [action_ops(self._example(table, row), costs) for row in examples]
        totals = [max([0.0] + [end for _, end in op_times(ops, 0.0)]) for ops in self.ops]
        self.totals = np.asarray(totals, dtype=np.float64)
        self.exact = self._exact(costs)

    @staticmethod
    def _templates(table: ActionTable, costs: Costs, num_stages: int):
        """Per action its template number, and per template the row of a action that has it."""
        if costs.nodes is not None:  # first and last stages hold the embedding and the head
            mult_class = np.array([costs.nodes.stage_class(s) for s in range(max(num_stages, 1))])
        elif costs.stage_multipliers:
            _, mult_class = np.unique(np.asarray(costs.stage_multipliers), return_inverse=True)
        else:
            mult_class = np.zeros(max(num_stages, 1), dtype=np.int64)
        classes = int(mult_class.max(initial=0)) + 1
        stage_class = mult_class[np.clip(table.stage, 0, len(mult_class) - 1)]
        back_class = np.where(
            table.kind == OVERLAP, mult_class[np.clip(table.back_stage, 0, len(mult_class) - 1)], 0
        )
        kind, back_kind = table.kind.astype(np.int64), table.back_kind.astype(np.int64)
        key = (
            (kind * (len(KINDS) + 1) + back_kind + 1) * classes + stage_class
        ) * classes + back_class
        first, template = _first_and_inverse(key)
        return template.reshape(-1), first

    @staticmethod
    def _example(table: ActionTable, row: int) -> Action:
        kind, stage, mb = KINDS[table.kind[row]], int(table.stage[row]), int(table.mb[row])
        if table.kind[row] != OVERLAP:
            return Action(stage, kind, mb)
        back = Action(
            int(table.back_stage[row]), KINDS[table.back_kind[row]], int(table.back_mb[row])
        )
        return Action.overlap(Action(stage, KINDS[0], mb), back)

    def _exact(self, costs: Costs) -> bool:
        """Whether every time of the simulation is an exact float (module docstring)."""
        values = [op.duration for ops in self.ops for op in ops] + [costs.p2p_latency]
        denominator = 1
        for value in values:
            denominator = max(denominator, Fraction(value).denominator)
        counts = np.bincount(self.template, minlength=len(self.ops))
        bound = float(counts @ self.totals) + costs.p2p_latency * len(self.template) * 3
        return denominator < _EXACT_LIMIT and bound * denominator < _EXACT_LIMIT

    def durations(self) -> np.ndarray:
        """Per action: end - start (only meaningful when ``exact``)."""
        return self.totals[self.template]

    def end_of(self, action: int, start: float) -> float:
        """When action ``action`` (a row) ends if it starts at ``start`` (the program run for this
        start)."""
        ends = [end for _, end in op_times(self.ops[self.template[action]], start)]
        return max([start] + ends)

    def made_at(self, action: int, start: float, end: float) -> tuple[float, float]:
        """When action ``action``'s (a row's) two products are handed on (an OVERLAP timed node by
        node: its halves' early sends, ``programs.half_ends``; anything else: at its end)."""
        ops = self.ops[self.template[action]]
        nodes = self.costs.nodes
        if nodes is None or not ops or ops[0].action.kind is Kind.W:
            return end, end
        if not any(op.action != ops[0].action for op in ops):  # one half: not an OVERLAP
            return end, end
        rule = nodes.early_sends
        assert rule is not None  # simulate sets the executor's rule for a schedule with OVERLAPs
        return half_ends(ops, op_times(ops, start), rule)

    def pieces(self, start: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Every piece, per stream (``COMPUTE``, ``COMM``): (begin, end, action), in action order
        and, within a action, in the order its program issues them. Each template's program is run
        once on all its actions' starts, for both streams."""
        streams = (COMPUTE, COMM)
        rows = [np.flatnonzero(self.template == t) for t in range(len(self.ops))]
        out, first = {}, {}
        for stream in streams:
            count = np.array([sum(op.stream == stream for op in ops) for ops in self.ops])
            per_action = count[self.template]
            first[stream] = np.concatenate([[0], np.cumsum(per_action)])
            total = int(first[stream][-1])
            action = np.repeat(np.arange(len(per_action)), per_action)
            out[stream] = (np.empty(total), np.empty(total), action)
        for t, ops in enumerate(self.ops):
            times = op_times(ops, start[rows[t]], np.maximum)
            nth = dict.fromkeys(streams, 0)
            for op, (b, e) in zip(ops, times):
                at = first[op.stream][rows[t]] + nth[op.stream]
                begin, end, _ = out[op.stream]
                begin[at], end[at] = b, e
                nth[op.stream] += 1
        return out


def _first_and_inverse(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(key, return_index=True, return_inverse=True)[1:]``: per distinct key (in
    increasing order) its first place, and per element its key's number. Keys taking a few
    small values (a schedule has a handful of templates) are counted instead of sorted."""
    if not len(key) or key.min() < 0 or key.max() >= _SMALL_KEYS:
        return np.unique(key, return_index=True, return_inverse=True)[1:]
    counts = np.bincount(key)
    values = np.flatnonzero(counts)
    if len(values) > _FEW_TEMPLATES:
        return np.unique(key, return_index=True, return_inverse=True)[1:]
    first = np.array([np.argmax(key == value) for value in values.tolist()], dtype=np.int64)
    return first, (np.cumsum(counts > 0) - 1)[key]


_SMALL_KEYS, _FEW_TEMPLATES = 1 << 16, 64

__all__ = ["ActionCosts", "COMM", "COMPUTE"]
