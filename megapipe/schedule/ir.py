"""Schedule IR: actions, per-rank action lists, placements, and the text and CSV forms.

The text form of an action is torch.distributed.pipelining's, so schedules move between
megapipe, torch and torchtitan unchanged: ``2F0``, ``1B3``, ``0I1``, ``0W1``,
``1SEND_F2``, ``(0F3;3B1)OVERLAP_F_B``.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, Sequence

from .errors import ScheduleError


class Kind(str, Enum):
    """What an action does. The value is its text form."""

    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # backward for the input gradient only  # noqa: E741
    W = "W"  # backward for the weight gradient only
    OVERLAP = "OVERLAP_F_B"  # forward of one microbatch beside the B or I of another
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.OVERLAP})
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
BACKWARD_KINDS = frozenset({Kind.B, Kind.I})

_SIMPLE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


@dataclass(frozen=True)
class Action:
    """One step of one rank.

    A plain action has a stage, a kind and a microbatch. An OVERLAP action has neither stage nor
    microbatch: it holds two sub-actions, a forward first and a backward (B or I) second.
    """

    stage: int | None
    kind: Kind
    microbatch: int | None = None
    sub_actions: tuple["Action", ...] = ()

    def __post_init__(self) -> None:
        if self.kind is Kind.OVERLAP:
            subs = self.sub_actions
            if len(subs) != 2 or subs[0].kind is not Kind.F or subs[1].kind not in BACKWARD_KINDS:
                raise ValueError(
                    f"an OVERLAP action holds exactly (forward; B or I), got {subs!r}"
                )
        elif self.sub_actions:
            raise ValueError(f"only OVERLAP actions hold sub-actions, not {self.kind.value}")
        elif self.stage is None or self.microbatch is None:
            raise ValueError(f"a {self.kind.value} action needs a stage and a microbatch")

    @staticmethod
    def overlap(forward: "Action", backward: "Action") -> "Action":
        return Action(None, Kind.OVERLAP, None, (forward, backward))

    @property
    def forward(self) -> "Action":
        """The forward half of an OVERLAP action."""
        return self.sub_actions[0]

    @property
    def backward(self) -> "Action":
        """The backward half of an OVERLAP action."""
        return self.sub_actions[1]

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def computations(self) -> tuple["Action", ...]:
        """The plain compute actions this action performs (the two halves of an OVERLAP)."""
        if self.kind is Kind.OVERLAP:
            return self.sub_actions
        return (self,)

    def __str__(self) -> str:
        if self.kind is Kind.OVERLAP:
            return f"({';'.join(str(a) for a in self.sub_actions)}){self.kind.value}"
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    __repr__ = __str__


def parse_action(text: str) -> Action:
    """Parse the text form of one action; the inverse of ``str(action)``."""
    text = text.strip()
    if text.startswith("("):
        close = text.find(")")
        kind = text[close + 1 :] if close > 0 else ""
        if kind != Kind.OVERLAP.value:
            raise ValueError(f"cannot parse action {text!r}: expected '(xFi;yBj)OVERLAP_F_B'")
        parts = [p for p in text[1:close].split(";")]
        if len(parts) != 2:
            raise ValueError(f"cannot parse action {text!r}: an OVERLAP holds two actions")
        return Action.overlap(parse_action(parts[0]), parse_action(parts[1]))
    match = _SIMPLE.match(text)
    if not match:
        raise ValueError(
            f"cannot parse action {text!r}: expected [stage][kind][microbatch], e.g. 2F0 or 1SEND_F2"
        )
    stage, kind, mb = match.groups()
    return Action(int(stage), Kind(kind), int(mb))


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
class Schedule:
    """Per-rank action lists and the facts needed to interpret them.

    ``stage_to_rank[s]`` is the rank that holds stage s. A bidirectional schedule (DualPipe) has
    two pipelines of ``num_stages // 2`` stages each: microbatches ``[0, M/2)`` flow through
    stages ``[0, S/2)`` and microbatches ``[M/2, M)`` through stages ``[S/2, S)``; stage
    ``S/2 + k`` holds a mirror copy of the model part of stage ``k`` (their gradients are summed).
    """

    actions: tuple[tuple[Action, ...], ...]
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    name: str = ""
    bidirectional: bool = False
    options: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(r) for r in self.actions))
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        if len(self.stage_to_rank) != self.num_stages:
            raise ValueError(
                f"stage_to_rank has {len(self.stage_to_rank)} entries for {self.num_stages} stages"
            )

    @property
    def pp(self) -> int:
        return len(self.actions)

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

    def replace_actions(self, actions: Sequence[Iterable[Action]], **changes) -> "Schedule":
        """A copy with other action lists (and optionally other fields)."""
        fields = dict(
            num_stages=self.num_stages,
            num_microbatches=self.num_microbatches,
            stage_to_rank=self.stage_to_rank,
            name=self.name,
            bidirectional=self.bidirectional,
            options=dict(self.options),
        )
        fields.update(changes)
        return Schedule(tuple(tuple(a) for a in actions), **fields)

    def format_grid(self) -> str:
        """A step (row) by rank (column) grid of the action texts."""
        cells = [[str(a) for a in row] for row in self.actions]
        width = max([len(c) for row in cells for c in row] + [6])
        steps = max((len(row) for row in cells), default=0)
        lines = ["step  " + " ".join(f"rank {r}".ljust(width) for r in range(self.pp))]
        for i in range(steps):
            row = [(cells[r][i] if i < len(cells[r]) else "").ljust(width) for r in range(self.pp)]
            lines.append(f"{i:<5} " + " ".join(row).rstrip())
        return "\n".join(lines)

    def to_text(self) -> str:
        """One line per rank, actions separated by spaces."""
        return "\n".join(" ".join(str(a) for a in row) for row in self.actions)


def write_csv(schedule: Schedule, path: str) -> None:
    """Write one row per rank, one action per cell: torch.distributed.pipelining's format."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for row in schedule.actions:
            writer.writerow([str(a) for a in row])


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
                if owner.setdefault(comp.stage, rank) != rank:
                    raise ValueError(
                        f"stage {comp.stage} appears on rank {owner[comp.stage]} and on rank "
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
        raise ScheduleError(f"{path} holds no actions: a schedule needs at least one rank with "
                            "one action (is the CSV empty?)")
    placement = infer_stage_to_rank(rows)
    mbs = {c.microbatch for row in rows for a in row for c in a.computations()}
    return Schedule(
        tuple(tuple(r) for r in rows),
        num_stages=len(placement),
        num_microbatches=(max(mbs) + 1) if mbs else 0,
        stage_to_rank=placement,
        name=name or path,
        bidirectional=bidirectional,
    )
