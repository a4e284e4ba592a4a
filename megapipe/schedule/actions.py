"""Actions: the entries of a rank's schedule, and their text form.

The text form of an action is torch.distributed.pipelining's, so schedules move between
megapipe, torch and torchtitan unchanged: ``2F0``, ``1B3``, ``0I1``, ``0W1``,
``1SEND_F2``, ``(0F3;3B1)OVERLAP_F_B``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


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
    """One action of one rank.

    A plain action has a stage, a kind and a microbatch. An OVERLAP action has neither stage nor
    microbatch: it holds two sub-actions, a forward first and a backward (B or I) second.
    """

    stage: int | None
    kind: Kind
    microbatch: int | None = None
    sub_actions: tuple[Action, ...] = ()

    def __post_init__(self) -> None:
        if self.kind is Kind.OVERLAP:
            subs = self.sub_actions
            if len(subs) != 2 or subs[0].kind is not Kind.F or subs[1].kind not in BACKWARD_KINDS:
                raise ValueError(f"an OVERLAP action holds exactly (forward; B or I), got {subs!r}")
        elif self.sub_actions:
            raise ValueError(f"only OVERLAP actions hold sub-actions, not {self.kind.value}")
        elif self.stage is None or self.microbatch is None:
            raise ValueError(f"a {self.kind.value} action needs a stage and a microbatch")

    @staticmethod
    def overlap(forward: Action, backward: Action) -> Action:
        return Action(None, Kind.OVERLAP, None, (forward, backward))

    @property
    def forward(self) -> Action:
        """The forward half of an OVERLAP action."""
        return self.sub_actions[0]

    @property
    def backward(self) -> Action:
        """The backward half of an OVERLAP action."""
        return self.sub_actions[1]

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def computations(self) -> tuple[Action, ...]:
        """The plain compute actions this action performs (the two halves of an OVERLAP)."""
        if self.kind is Kind.OVERLAP:
            return self.sub_actions
        return (self,)

    @classmethod
    def trusted(
        cls, stage: int | None, kind: Kind, microbatch: int | None, sub_actions: tuple = ()
    ) -> Action:
        """An action whose fields are known to be consistent (decoded from a schedule's table):
        made without ``__post_init__``'s checks, which would cost more than the rest."""
        action = object.__new__(cls)
        action.__dict__.update(
            stage=stage, kind=kind, microbatch=microbatch, sub_actions=sub_actions
        )
        return action

    def __str__(self) -> str:
        if self.kind is Kind.OVERLAP:
            return f"({';'.join(str(a) for a in self.sub_actions)}){self.kind.value}"
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    __repr__ = __str__


def plain_key(action: Action) -> tuple[int, int]:
    """(stage, microbatch) of a plain action (only an OVERLAP has neither)."""
    assert action.stage is not None and action.microbatch is not None, action
    return action.stage, action.microbatch


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
            f"cannot parse action {text!r}: expected [stage][kind][microbatch], "
            "e.g. 2F0 or 1SEND_F2"
        )
    stage, kind, mb = match.groups()
    return Action(int(stage), Kind(kind), int(mb))
