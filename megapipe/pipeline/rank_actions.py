"""What the executor's action loop walks on one rank: its actions, checked and lowered.

A broken schedule (hand-written, from a CSV) fails here, before any collective, naming rank,
action and rule (``checked_lowering``). Besides this rank's lowered list, ``RankActions`` holds
what the loop needs at each of its compute actions, worked out once: the gap after it and the
sends of an OVERLAP that go out from inside the pair (``early_sends``, proven deadlock-free
for the whole schedule), the forward-only list (evaluation lowered on its own) and the points
where each stage's gradients become final (``grad_points``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megapipe.pipeline.grad_points import GradPoints
from megapipe.schedule.ir import Action, Kind, Schedule
from megapipe.schedule.p2p.early_sends import EarlySends, choose_early_sends, comm_batch
from megapipe.schedule.rank_views import checked_lowering, forward_only_schedule


@dataclass(frozen=True)
class RankActions:
    """One rank's part of a schedule, lowered (module docstring)."""

    lowered: Schedule  # every rank's lowered list, checked
    actions: Sequence[Action]  # this rank's lowered list
    forward_only_actions: Sequence[Action]  # this rank's forward actions, lowered on their own
    has_overlap: bool  # a combined schedule: some rank has an OVERLAP action
    grad_points: GradPoints
    early_sends: EarlySends
    early_send_rule: str
    # per training compute action (its index in ``actions``): the gap after it, its early sends
    gaps: dict[int, tuple[list[Action], tuple[Action, ...]]]

    @classmethod
    def of(cls, schedule: Schedule, pp_rank: int, has_spec: bool) -> RankActions:
        """``pp_rank``'s actions of ``schedule``; ``has_spec``: the executor was told what the
        stages send (needed once a stage talks across ranks)."""
        lowered = checked_lowering(schedule)
        actions = lowered.actions[pp_rank]
        if not has_spec and any(not a.is_compute for a in actions):
            raise ValueError(
                "spec is required when stages talk across ranks: pass TensorSpec(shape, dtype) "
                "of the activation each stage sends forward, or spec(stage, microbatch)"
            )
        early_sends, early_send_rule = choose_early_sends(lowered)
        gaps = {
            i: (comm_batch(actions, i), early_sends.get((pp_rank, i), ()))
            for i, action in enumerate(actions)
            if action.is_compute
        }
        return cls(
            lowered,
            actions,
            forward_only_schedule(lowered).actions[pp_rank],
            any(a.kind is Kind.OVERLAP for row in lowered.actions for a in row),
            GradPoints.of(actions, schedule.bidirectional),
            early_sends,
            early_send_rule,
            gaps,
        )
