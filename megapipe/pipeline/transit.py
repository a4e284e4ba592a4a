"""One step's data in transit on one rank: what crosses between stages, and the pair's sends.

``StepTensors`` is what the executor knows of the data in transit while it walks one rank's
action list for one step, keyed by (stage, microbatch): a forward's output goes to the next
stage (locally when that stage lives on this rank, else into the outbox its SEND_F posts), a
backward's input gradient likewise (SEND_B); ``forward_input`` / ``grad_output`` give a compute
action what it consumes, waiting first for the batch that receives it (a first stage reads its
microbatch; a last stage has no output gradient: its backward starts from the loss).
``PairSends`` posts the gap after one OVERLAP as its halves' results are handed over, the sends
the early-send rule allows one by one (``schedule.p2p.early_sends``). ``track`` (a measured
step) is told of every tensor taken into transit (``activation_meter``). The batches go out
through ``p2p.PipelineP2P`` (the transport).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from megapipe.overlap.plan import Track
from megapipe.pipeline.p2p import CommOp, PipelineP2P, PostedBatch, SpecFn
from megapipe.schedule.actions import COMM_KINDS, plain_key
from megapipe.schedule.ir import Action, Kind, Schedule
from megapipe.schedule.p2p.early_sends import RECEIVES

Key = tuple[int, int]  # (stage, microbatch)


def stage_links(schedule: Schedule) -> tuple[dict[int, int | None], dict[int, int | None]]:
    """Per stage, the stage before and the stage after it in its pipeline (None at the ends)."""
    stages = range(schedule.num_stages)
    return (
        {s: schedule.prev_stage(s) for s in stages},
        {s: schedule.next_stage(s) for s in stages},
    )


@dataclass
class StepTensors:
    """One step's data in transit on one rank (see the module docstring)."""

    schedule: Schedule
    pp_rank: int
    microbatches: Sequence[Any] | None
    p2p: PipelineP2P | None = None
    spec: SpecFn | None = None
    forward_inputs: dict[Key, Any] = field(default_factory=dict)
    grad_outputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    outbox_forward: dict[Key, torch.Tensor] = field(default_factory=dict)
    outbox_backward: dict[Key, torch.Tensor] = field(default_factory=dict)
    pending: dict[tuple[Kind, int, int], PostedBatch] = field(default_factory=dict)
    sends: list[PostedBatch] = field(default_factory=list)
    posted: set[Action] = field(default_factory=set)  # comm actions already posted (early sends)
    # a profiled step times each wait for a receive (``step_profile.StepProfile.wait``)
    wait_span: Callable[[Kind, int, int], AbstractContextManager] | None = None
    track: Track | None = None  # a measured step's activation meter
    # stage -> the stage before / after it in its pipeline (None: a first / last stage)
    prev: dict[int, int | None] = field(default_factory=dict)
    next: dict[int, int | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.prev:
            self.prev, self.next = stage_links(self.schedule)

    def _tracked(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.track is not None:
            self.track((tensor,))
        return tensor

    # ------------------------------------------------------------------ hand-over
    def hand_forward(self, action: Action, output: torch.Tensor) -> None:
        """The output of F(s, i) (not a last stage) goes to stage s+1, here or via SEND_F."""
        s, i = plain_key(action)
        nxt = self.next[s]
        assert nxt is not None
        if self.schedule.stage_to_rank[nxt] == self.pp_rank:
            self.forward_inputs[(nxt, i)] = self._tracked(output.detach())
        else:
            self.outbox_forward[(s, i)] = self._tracked(output.detach())

    def hand_backward(self, action: Action, grad_input: torch.Tensor | None) -> None:
        """The input gradient of B/I(s, i) goes to stage s-1, here or via SEND_B (a first stage
        has none to hand on)."""
        s, i = plain_key(action)
        prev = self.prev[s]
        if prev is None:
            return
        if grad_input is None:
            raise RuntimeError(
                f"rank {self.pp_rank}: stage {s} produced no input gradient for {action}; its "
                "input must be a floating-point tensor that the output depends on"
            )
        if self.schedule.stage_to_rank[prev] == self.pp_rank:
            self.grad_outputs[(prev, i)] = self._tracked(grad_input)
        else:
            self.outbox_backward[(s, i)] = self._tracked(grad_input)

    def forward_input(self, action: Action) -> Any:
        """What F(s, i) computes on: microbatch i on a first stage, else stage s-1's output."""
        s, i = plain_key(action)
        if self.prev[s] is None:
            assert self.microbatches is not None
            return self.microbatches[i]
        self._wait_for(Kind.RECV_F, s, i)
        stage_input = self.forward_inputs.pop((s, i), None)
        if stage_input is None:
            raise RuntimeError(
                f"rank {self.pp_rank}: {action} has no input (no RECV_F and no local stage "
                f"{self.prev[s]} forward before it)"
            )
        return stage_input

    def grad_output(self, action: Action) -> torch.Tensor | None:
        """The gradient of stage s's output for B/I(s, i); None on a last stage (the loss)."""
        s, i = plain_key(action)
        if self.next[s] is None:
            return None
        self._wait_for(Kind.RECV_B, s, i)
        grad_output = self.grad_outputs.pop((s, i), None)
        if grad_output is None:
            raise RuntimeError(
                f"rank {self.pp_rank}: {action} has no output gradient (no RECV_B and no "
                f"local stage {self.next[s]} backward before it)"
            )
        return grad_output

    # ------------------------------------------------------------------ p2p
    def ready_to_send(self, action: Action) -> bool:
        """Whether the tensor a SEND action sends has been handed over."""
        outbox = self.outbox_forward if action.kind is Kind.SEND_F else self.outbox_backward
        return (action.stage, action.microbatch) in outbox

    def post_rest(self, actions: Sequence[Action]) -> None:
        """Post the actions of a gap that were not posted early, as one batch (if any)."""
        rest = [action for action in actions if action not in self.posted]
        if rest:
            self.post(rest)

    def post(self, actions: Sequence[Action]) -> None:
        """Post a gap's SEND/RECV actions as one batch."""
        self.posted.update(actions)
        p2p = self.p2p
        assert p2p is not None and self.spec is not None
        ops: list[CommOp] = []
        receives: list[tuple[Kind, int, int, torch.Tensor]] = []
        for action in actions:
            kind = action.kind
            if kind not in COMM_KINDS:
                raise ValueError(f"rank {self.pp_rank}: {action} is not a comm action")
            s, i = plain_key(action)
            where = partial(f"rank {self.pp_rank}, {{}}".format, action)  # read on an error
            if kind is Kind.SEND_F:
                tensor = self._take(self.outbox_forward, action, f"F({s},{i}) produced it")
                nxt = self.next[s]
                assert nxt is not None  # a SEND_F's stage has a next stage
                self.spec(s, i).check(tensor, where)
                ops.append(CommOp(action, p2p.peer_of(action, nxt), tensor))
            elif kind is Kind.SEND_B:
                tensor = self._take(self.outbox_backward, action, f"the backward of ({s},{i})")
                prev = self.prev[s]
                assert prev is not None  # a SEND_B's stage has a stage before it
                self.spec(prev, i).check(tensor, where)
                ops.append(CommOp(action, p2p.peer_of(action, prev), tensor))
            elif kind is Kind.RECV_F:
                prev = self.prev[s]
                assert prev is not None  # a RECV_F's stage has a stage before it
                buffer = self._tracked(p2p.receive_buffer(action, prev))
                ops.append(CommOp(action, p2p.peer_of(action, prev), buffer))
                receives.append((Kind.RECV_F, s, i, buffer))
            else:  # RECV_B
                nxt = self.next[s]
                assert nxt is not None  # a RECV_B's stage has a next stage
                buffer = self._tracked(p2p.receive_buffer(action, s))
                ops.append(CommOp(action, p2p.peer_of(action, nxt), buffer))
                receives.append((Kind.RECV_B, s, i, buffer))
        batch = p2p.post(ops)
        for kind, s, i, buffer in receives:
            self.pending[(kind, s, i)] = batch
            target = self.forward_inputs if kind is Kind.RECV_F else self.grad_outputs
            target[(s, i)] = buffer
        if any(op.is_send for op in ops):
            self.sends.append(batch)
            # drop completed sends so their tensors can be freed early
            self.sends = [b for b in self.sends if not b.is_completed()]

    def finish_sends(self) -> None:
        for batch in self.sends:
            batch.wait()

    def _take(self, outbox: dict[Key, torch.Tensor], action: Action, made_by: str) -> torch.Tensor:
        tensor = outbox.pop(plain_key(action), None)
        if tensor is None:
            raise RuntimeError(f"rank {self.pp_rank}: {action} before {made_by}")
        return tensor

    def _wait_for(self, kind: Kind, stage: int, microbatch: int) -> None:
        batch = self.pending.pop((kind, stage, microbatch), None)
        if batch is None:
            return
        if self.wait_span is None:
            batch.wait()
            return
        with self.wait_span(kind, stage, microbatch):
            batch.wait()


class PairSends:
    """Posts the gap after one OVERLAP as its halves finish (``post_ready`` after each hand-over).

    ``gap``: the SEND/RECV actions between the OVERLAP and the next computation (``comm_batch``).
    ``early``: the sends that go out one by one (``choose_early_sends``); empty: the whole gap goes
    once every send in it is ready. The executor posts whatever is left after the pair.
    ``backward_done`` is the combined step's hand-over (``CombinedStep(backward_done=...)``):
    ``end(grads)`` (the stage worker's ``end_backward``, for ``backward``) gives the stage's
    input gradient, which goes to the stage before (none on a first stage), then the sends go.
    ``end`` is dropped once called, so nothing of the backward half stays reachable from here.
    """

    def __init__(
        self,
        tensors: StepTensors,
        gap: Sequence[Action],
        early: Sequence[Action] = (),
        backward: Action | None = None,
        end: Callable[[Any], torch.Tensor | None] | None = None,
    ) -> None:
        self.tensors = tensors
        self.gap = list(gap)
        self.early = list(early)
        self.first = True
        self.backward = backward
        self.end = end

    def backward_done(self, grads: Any) -> None:
        action, end = self.backward, self.end
        assert action is not None and end is not None
        self.end = None  # told once; the half it holds is the step's, not ours to keep
        self.tensors.hand_backward(action, end(grads))
        self.post_ready()

    def post_ready(self) -> None:
        tensors = self.tensors
        if not self.early:
            sends = [a for a in self.gap if a.kind in (Kind.SEND_F, Kind.SEND_B)]
            if self.first and self.gap and all(tensors.ready_to_send(a) for a in sends):
                tensors.post(self.gap)
                self.first = False
            return
        ready = []
        while self.early and tensors.ready_to_send(self.early[0]):
            ready.append(self.early.pop(0))
        if not ready:
            return
        if self.first:  # the gap's receives go with the first early send (as in the proof)
            ready += [a for a in self.gap if a.kind in RECEIVES]
            self.first = False
        tensors.post(ready)
