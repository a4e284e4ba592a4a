"""The hook points of a data-parallel gradient reduction inside one training step.

A reduction that overlaps the backward needs to know, for each stage (model chunk) of this
rank, when in the step its gradients become final. The rank's action list says it:

- *before* and *after its last backward*: around the action holding the stage's last B or I.
  There the stage's gradients are being finished (Megatron's DDP leaves ``no_sync`` for that
  action, so its hooks start each bucket's reduction as the bucket fills);
- *its gradients are final*: after the last action that adds to them (its last B, I or W; an
  OVERLAP counts for the stage of its backward half). The chunk's last backward of the step is
  done; its reduction can start.

Gathering updated parameters needs the other end: the action holding the stage's *first
forward*, and the order in which the stages first run forward.

``GradPoints.of(actions, bidirectional)`` reads these points from the rank's lowered action
list once. During a training step the executor tells a ``GradSyncHooks`` object of each point
through ``StepGradEvents`` (``step_started``, ``before_first_forward``,
``before_last_backward``, ``after_last_backward``, ``stage_grads_final``, ``step_finished``);
forward-only steps tell it nothing. DualPipe's two copies of a model part (bidirectional
schedules) sum their gradients only after the last action (``grad_sync.sum_mirrored_grads``),
so there every stage's last-backward and final points come at the end of the step, after that
sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from megapipe.schedule.actions import plain_key
from megapipe.schedule.ir import Action, Kind

_GRAD_KINDS = (Kind.B, Kind.I, Kind.W)
_BACKWARD_KINDS = (Kind.B, Kind.I)


class GradSyncHooks(Protocol):
    """What the executor tells a gradient reduction during a training step (module docstring).

    ``step_started(forward_stages)``: the step begins; ``forward_stages`` lists this rank's stages
    in the order of their first forward. Then, as the actions run, ``before_first_forward(s)``,
    ``before_last_backward(s)``, ``after_last_backward(s)`` and ``stage_grads_final(s)`` once
    per stage, and last ``step_finished()``, after DualPipe's mirrored gradients were summed.
    """

    def step_started(self, forward_stages: Sequence[int]) -> None: ...

    def before_first_forward(self, stage: int) -> None: ...

    def before_last_backward(self, stage: int) -> None: ...

    def after_last_backward(self, stage: int) -> None: ...

    def stage_grads_final(self, stage: int) -> None: ...

    def step_finished(self) -> None: ...


@dataclass(frozen=True)
class GradPoints:
    """Per action index of one rank's action list: which stages reach which point there."""

    forward_stages: tuple[int, ...]
    first_forward: dict[int, tuple[int, ...]] = field(default_factory=dict)  # before action i
    last_backward: dict[int, tuple[int, ...]] = field(default_factory=dict)  # around action i
    grads_final: dict[int, tuple[int, ...]] = field(default_factory=dict)  # after action i
    at_end: tuple[int, ...] = ()  # stages whose two points come after the mirrored sum

    @classmethod
    def of(cls, actions: Sequence[Action], bidirectional: bool = False) -> GradPoints:
        """The points of ``actions`` (one rank's list, lowered or compute-only)."""
        first_forward: dict[int, int] = {}
        last_backward: dict[int, int] = {}
        last_grad: dict[int, int] = {}
        for index, action in enumerate(actions):
            for comp in action.computations() if action.is_compute else ():
                stage, _ = plain_key(comp)
                if comp.kind is Kind.F:
                    first_forward.setdefault(stage, index)
                if comp.kind in _BACKWARD_KINDS:
                    last_backward[stage] = index
                if comp.kind in _GRAD_KINDS:
                    last_grad[stage] = index
        order = tuple(sorted(first_forward, key=first_forward.__getitem__))
        if bidirectional:
            return cls(order, _by_index(first_forward), at_end=tuple(sorted(last_grad)))
        return cls(order, _by_index(first_forward), _by_index(last_backward), _by_index(last_grad))


def _by_index(points: dict[int, int]) -> dict[int, tuple[int, ...]]:
    out: dict[int, list[int]] = {}
    for stage, index in sorted(points.items()):
        out.setdefault(index, []).append(stage)
    return {index: tuple(stages) for index, stages in out.items()}


class StepGradEvents:
    """One training step's calls into ``hooks`` (none at all when ``hooks`` is None)."""

    def __init__(self, points: GradPoints, hooks: GradSyncHooks | None) -> None:
        self.points = points
        self.hooks = hooks

    def start(self) -> None:
        if self.hooks is not None:
            self.hooks.step_started(self.points.forward_stages)

    def before(self, index: int) -> None:
        """Before action ``index`` runs."""
        if self.hooks is None:
            return
        for stage in self.points.first_forward.get(index, ()):
            self.hooks.before_first_forward(stage)
        for stage in self.points.last_backward.get(index, ()):
            self.hooks.before_last_backward(stage)

    def after(self, index: int) -> None:
        """After action ``index`` ran."""
        if self.hooks is None:
            return
        for stage in self.points.last_backward.get(index, ()):
            self.hooks.after_last_backward(stage)
        for stage in self.points.grads_final.get(index, ()):
            self.hooks.stage_grads_final(stage)

    def finish(self) -> None:
        """After the last action and the mirrored-gradient sum."""
        if self.hooks is None:
            return
        for stage in self.points.at_end:
            self.hooks.before_last_backward(stage)
            self.hooks.after_last_backward(stage)
            self.hooks.stage_grads_final(stage)
        self.hooks.step_finished()
