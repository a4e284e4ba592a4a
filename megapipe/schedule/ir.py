"""Schedule IR: per-rank action lists, placements, and the text and CSV forms.

A ``Schedule`` holds its action lists as an ``ActionTable`` (integer columns) and makes
``Action`` objects (``actions``, ``row``) only when asked: the layers that build, lower, check and
simulate schedules work on the table. The text form of an action is torch.distributed.pipelining's
(``megapipe.schedule.actions``), so schedules move between megapipe, torch and torchtitan
unchanged.
"""

from __future__ import annotations

import csv
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import FrozenInstanceError, dataclass
from typing import Generic, TypeVar, cast

import numpy as np

from .actions import (  # noqa: F401 - the IR's public names
    BACKWARD_KINDS,
    COMM_KINDS,
    COMPUTE_KINDS,
    Action,
    Kind,
    parse_action,
    plain_key,
)
from .errors import ScheduleError
from .table import ActionTable

T = TypeVar("T")


def loop_placement(pp: int, num_stages: int) -> tuple[int, ...]:
    """Stage s on rank s % pp (interleaved 1F1B, looped BFS, ZB1P)."""
    return tuple(s % pp for s in range(num_stages))


def v_placement(pp: int, num_stages: int) -> tuple[int, ...]:
    """Zig-zag: stages 0..pp-1 down the ranks, pp..2pp-1 back up, and so on (ZBV, DualPipeV)."""
    placement = []
    for s in range(num_stages):
        lap, pos = divmod(s, pp)
        placement.append(pos if lap % 2 == 0 else pp - 1 - pos)
    return tuple(placement)


@dataclass(frozen=True)
class ScheduleOptions:
    """What ``build_schedule`` was asked for; None: not stated (e.g. a schedule read from a CSV)."""

    vpp: int | None = None
    overlap: bool | None = None
    microbatch_group_size_per_vp_stage: int | None = None
    max_extra_in_flight: int | None = None


class Derived(Generic[T]):
    """One kind of fact derived from a schedule, kept with it and worked out once (a schedule never
    changes). The module that derives it declares it with its type, so the IR imports none of
    them: ``timing.timeline.TIMELINES``, ``STRUCTURES``, ``timing.retime.SWEEP_SEQUENCE``,
    ``p2p.lower.LOWERED``, ``LOWERED_FROM``, ``p2p.comm_check.BATCHES_FINISH``,
    ``checks.validate.VALID``."""

    def __init__(self, default: Callable[[], T]) -> None:
        self._default = default

    def of(self, schedule: Schedule) -> T:
        """What ``schedule`` keeps (the default until ``keep``)."""
        kept = schedule._derived
        if self not in kept:
            kept[self] = self._default()
        return cast(T, kept[self])

    def keep(self, schedule: Schedule, value: T) -> None:
        schedule._derived[self] = value


class Schedule:
    """Per-rank action lists and the facts needed to interpret them.

    ``stage_to_rank[s]`` is the rank that holds stage s. A bidirectional schedule (DualPipe) has
    two pipelines of ``num_stages // 2`` stages each: microbatches ``[0, M/2)`` flow through
    stages ``[0, S/2)`` and microbatches ``[M/2, M)`` through stages ``[S/2, S)``; stage
    ``S/2 + k`` holds a mirror copy of the model part of stage ``k`` (their gradients are summed).

    ``actions`` may be per-rank lists of ``Action`` or an ``ActionTable``. A schedule never
    changes, so what is derived from it (its timeline, its lowering, a passed validation) is
    kept with it and computed once (``Derived``).
    """

    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    name: str
    bidirectional: bool
    options: ScheduleOptions
    _table: ActionTable | None  # None until ``table`` makes it from the rows
    _rows: tuple[tuple[Action, ...], ...] | None  # None until ``actions`` makes them
    _derived: dict[Derived, object]  # what ``Derived.of`` finds
    _made_rows: dict[int, tuple[Action, ...]]  # what ``row`` made

    def __init__(
        self,
        actions: Sequence[Iterable[Action]] | ActionTable,
        num_stages: int,
        num_microbatches: int,
        stage_to_rank: Sequence[int],
        name: str = "",
        bidirectional: bool = False,
        options: ScheduleOptions | None = None,
    ) -> None:
        table, rows = (
            (actions, None)
            if isinstance(actions, ActionTable)
            else (None, tuple(tuple(r) for r in actions))
        )
        fields: dict[str, object] = dict(
            _table=table,
            _rows=rows,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            stage_to_rank=tuple(stage_to_rank),
            name=name,
            bidirectional=bidirectional,
            options=ScheduleOptions() if options is None else options,
            _derived={},
            _made_rows={},
        )
        for key, value in fields.items():
            object.__setattr__(self, key, value)
        if len(self.stage_to_rank) != self.num_stages:
            raise ValueError(
                f"stage_to_rank has {len(self.stage_to_rank)} entries for {self.num_stages} stages"
            )

    def __setattr__(self, name: str, value) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __reduce__(self):
        return (
            Schedule,
            (
                self.table,
                self.num_stages,
                self.num_microbatches,
                self.stage_to_rank,
                self.name,
                self.bidirectional,
                self.options,
            ),
        )

    def _facts(self) -> tuple:
        return (
            self.num_stages,
            self.num_microbatches,
            self.stage_to_rank,
            self.name,
            self.bidirectional,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        if self._facts() != other._facts():
            return False
        if self._table is None and other._table is None:
            return self._rows == other._rows
        return self.table.same_as(other.table)

    def __hash__(self) -> int:
        return hash((self._facts(), self.table.digest()))

    def __repr__(self) -> str:
        return (
            f"Schedule(name={self.name!r}, pp={self.pp}, num_stages={self.num_stages}, "
            f"num_microbatches={self.num_microbatches}, actions={len(self.table)})"
        )

    @property
    def table(self) -> ActionTable:
        """The action lists as integer columns."""
        table = self._table
        if table is None:
            assert self._rows is not None  # a schedule is made from one or the other
            table = ActionTable.from_rows(self._rows)
            object.__setattr__(self, "_table", table)
        return table

    @property
    def actions(self) -> tuple[tuple[Action, ...], ...]:
        """Every rank's action list (made on first use; ``row`` makes just one)."""
        rows = self._rows
        if rows is None:
            rows = tuple(self.row(rank) for rank in range(self.table.pp))
            object.__setattr__(self, "_rows", rows)
        return rows

    def row(self, rank: int) -> tuple[Action, ...]:
        """Rank ``rank``'s action list (made on first use, without the other ranks')."""
        if self._rows is not None:
            return self._rows[rank]
        rows = self._made_rows
        if rank not in rows:
            rows[rank] = self.table.actions_of(rank)
        return rows[rank]

    def action_at(self, row: int) -> Action:
        """The action in row ``row`` of the table (ranks one after another)."""
        rank = int(self.table.rank[row])
        return self.row(rank)[int(row) - int(self.table.offsets[rank])]

    @functools.cached_property
    def placement(self) -> np.ndarray:
        """``stage_to_rank`` as an array."""
        return np.asarray(self.stage_to_rank, dtype=np.int64).reshape(-1)

    @functools.cached_property
    def padded_placement(self) -> np.ndarray:
        """``placement`` with -1 on both ends: one clipped lookup (``timing.flows.stage_rank``)."""
        return np.concatenate([[-1], self.placement, [-1]])

    @property
    def pp(self) -> int:
        return len(self._rows) if self._rows is not None else self.table.pp

    @property
    def stages_per_pipeline(self) -> int:
        return self.num_stages // 2 if self.bidirectional else self.num_stages

    def stages_of_rank(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def model_part(self, stage: int) -> int:
        """Which slice of the model a stage holds (differs from the stage only for DualPipe)."""
        return stage % self.stages_per_pipeline

    def stages_for(self, microbatch: int) -> range:
        """The stages a microbatch flows through, in forward order."""
        n = self.stages_per_pipeline
        if self.bidirectional and microbatch >= self.num_microbatches // 2:
            return range(n, 2 * n)
        return range(n)

    def next_stage(self, stage: int) -> int | None:
        """The stage after ``stage`` in its pipeline, or None for a last stage."""
        n = self.stages_per_pipeline
        return None if (stage + 1) % n == 0 else stage + 1

    def prev_stage(self, stage: int) -> int | None:
        """The stage before ``stage`` in its pipeline, or None for a first stage."""
        n = self.stages_per_pipeline
        return None if stage % n == 0 else stage - 1

    def is_first_stage(self, stage: int) -> bool:
        return self.prev_stage(stage) is None

    def is_last_stage(self, stage: int) -> bool:
        return self.next_stage(stage) is None

    def replace_actions(
        self, actions: Sequence[Iterable[Action]] | ActionTable, **changes
    ) -> Schedule:
        """A copy with other action lists (and optionally other fields)."""
        fields = dict(
            num_stages=self.num_stages,
            num_microbatches=self.num_microbatches,
            stage_to_rank=self.stage_to_rank,
            name=self.name,
            bidirectional=self.bidirectional,
            options=self.options,
        )
        return Schedule(actions, **{**fields, **changes})

    def _texts(self) -> list[list[str]]:
        if self._rows is not None:
            return [[str(a) for a in row] for row in self._rows]
        return [self.table.texts_of(rank) for rank in range(self.pp)]

    def format_grid(self) -> str:
        """A grid of the action texts: the k-th action of each rank (column) in row k."""
        cells = self._texts()
        width = max([len(c) for row in cells for c in row] + [6])
        rows = max((len(row) for row in cells), default=0)
        lines = ["#     " + " ".join(f"rank {r}".ljust(width) for r in range(self.pp))]
        for i in range(rows):
            row = [(cells[r][i] if i < len(cells[r]) else "").ljust(width) for r in range(self.pp)]
            lines.append(f"{i:<5} " + " ".join(row).rstrip())
        return "\n".join(lines)

    def to_text(self) -> str:
        """One line per rank, actions separated by spaces."""
        return "\n".join(" ".join(row) for row in self._texts())


def write_csv(schedule: Schedule, path: str) -> None:
    """Write one row per rank, one action per cell: torch.distributed.pipelining's format."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for row in schedule._texts():
            writer.writerow(row)


def read_rows(path: str) -> list[list[Action]]:
    """Read per-rank action rows from a CSV in torch's format (empty cells are skipped)."""
    with open(path, newline="") as f:
        return [[parse_action(c) for c in row if c.strip()] for row in csv.reader(f)]


def infer_stage_to_rank(rows: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    """The placement implied by which rank runs which stage; an error if a stage is on two ranks."""
    owner: dict[int, int] = {}
    for rank, row in enumerate(rows):
        for action in row:
            for comp in action.computations():
                stage, _ = plain_key(comp)
                if owner.setdefault(stage, rank) != rank:
                    raise ValueError(
                        f"stage {stage} appears on rank {owner[stage]} and on rank "
                        f"{rank} (action {action})"
                    )
    if not owner:
        return ()
    stages = sorted(owner)
    if stages != list(range(len(stages))):
        raise ValueError(f"stages must be numbered 0..S-1, found {stages}")
    return tuple(owner[s] for s in stages)


def read_csv(path: str, name: str = "", bidirectional: bool = False) -> Schedule:
    """Load a schedule from a CSV in torch's format; placement and counts are inferred."""
    rows = read_rows(path)
    if not any(rows):
        raise ScheduleError(
            f"{path} holds no actions: a schedule needs at least one rank with "
            "one action (is the CSV empty?)"
        )
    placement = infer_stage_to_rank(rows)
    mbs = {plain_key(c)[1] for row in rows for a in row for c in a.computations()}
    return Schedule(
        tuple(tuple(r) for r in rows),
        num_stages=len(placement),
        num_microbatches=(max(mbs) + 1) if mbs else 0,
        stage_to_rank=placement,
        name=name or path,
        bidirectional=bidirectional,
    )
