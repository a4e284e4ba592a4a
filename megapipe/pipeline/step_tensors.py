"""The tensors that move during one step: stage inputs, outputs, gradients and their p2p.

``StepTensors`` is what the executor knows about data in transit while it walks one rank's
action list for one step, keyed by (stage, microbatch):

- a forward's output goes to the next stage: locally when that stage lives on this rank, else
  into the outbox its SEND_F will post; a backward's input gradient likewise (SEND_B);
- ``post(actions)`` posts one run of comm actions as one ``batch_isend_irecv`` batch
  (``p2p.PipelineP2P``), with receive buffers from the declared ``TensorSpec``s; part of a run
  may have gone out earlier, from inside an OVERLAP (``early_sends``), and ``post_rest`` posts
  the rest;
- ``forward_input`` / ``grad_output`` give a compute action what it consumes, waiting first for
  the batch that receives it (a first stage reads its microbatch; a last stage has no output
  gradient: its backward starts from the loss);
- ``finish_sends`` completes the sends still in flight at the end of the step.

``track`` (a measured step) is told of every tensor taken into transit: a received buffer, a
hand-over to a local stage or to a send (``activation_meter`` counts it until it is freed).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from megapipe.overlap.plan import Track
from megapipe.pipeline.p2p import CommOp, PipelineP2P, PostedBatch, SpecFn
from megapipe.schedule.ir import Action, Kind, Schedule

Key = tuple[int, int]  # (stage, microbatch)


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

    def _tracked(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.track is not None:
            self.track((tensor,))
        return tensor

    # ------------------------------------------------------------------ hand-over
    def hand_forward(self, action: Action, output: torch.Tensor) -> None:
        """The output of F(s, i) (not a last stage) goes to stage s+1, here or via SEND_F."""
        s, i = action.stage, action.microbatch
        nxt = self.schedule.next_stage(s)
        assert nxt is not None
        if self.schedule.stage_to_rank[nxt] == self.pp_rank:
            self.forward_inputs[(nxt, i)] = self._tracked(output.detach())
        else:
            self.outbox_forward[(s, i)] = self._tracked(output.detach())

    def hand_backward(self, action: Action, grad_input: torch.Tensor) -> None:
        """The input gradient of B/I(s, i) (not stage 0) goes to stage s-1, here or via SEND_B."""
        s, i = action.stage, action.microbatch
        prev = self.schedule.prev_stage(s)
        assert prev is not None
        if self.schedule.stage_to_rank[prev] == self.pp_rank:
            self.grad_outputs[(prev, i)] = self._tracked(grad_input)
        else:
            self.outbox_backward[(s, i)] = self._tracked(grad_input)

    def forward_input(self, action: Action) -> Any:
        """What F(s, i) computes on: microbatch i on a first stage, else stage s-1's output."""
        s, i = action.stage, action.microbatch
        if self.schedule.is_first_stage(s):
            assert self.microbatches is not None
            return self.microbatches[i]
        self._wait_for(Kind.RECV_F, s, i)
        stage_input = self.forward_inputs.pop((s, i), None)
        if stage_input is None:
            raise RuntimeError(
                f"rank {self.pp_rank}: {action} has no input (no RECV_F and no local stage "
                f"{self.schedule.prev_stage(s)} forward before it)"
            )
        return stage_input

    def grad_output(self, action: Action) -> torch.Tensor | None:
        """The gradient of stage s's output for B/I(s, i); None on a last stage (the loss)."""
        s, i = action.stage, action.microbatch
        if self.schedule.is_last_stage(s):
            return None
        self._wait_for(Kind.RECV_B, s, i)
        grad_output = self.grad_outputs.pop((s, i), None)
        if grad_output is None:
            raise RuntimeError(
                f"rank {self.pp_rank}: {action} has no output gradient (no RECV_B and no "
                f"local stage {self.schedule.next_stage(s)} backward before it)"
            )
        return grad_output

    # ------------------------------------------------------------------ p2p
    def ready_to_send(self, action: Action) -> bool:
        """Whether the tensor a SEND action sends has been handed over."""
        outbox = self.outbox_forward if action.kind is Kind.SEND_F else self.outbox_backward
        return (action.stage, action.microbatch) in outbox

    def post_rest(self, actions: Sequence[Action]) -> None:
        """Post the actions of a run that were not posted early, as one batch (if any)."""
        rest = [action for action in actions if action not in self.posted]
        if rest:
            self.post(rest)

    def post(self, actions: Sequence[Action]) -> None:
        """Post one run of SEND/RECV actions as one batch."""
        self.posted.update(actions)
        p2p = self.p2p
        assert p2p is not None and self.spec is not None
        sched = self.schedule
        ops: list[CommOp] = []
        receives: list[tuple[Kind, int, int, torch.Tensor]] = []
        for action in actions:
            s, i, kind = action.stage, action.microbatch, action.kind
            where = f"rank {self.pp_rank}, {action}"
            if kind is Kind.SEND_F:
                tensor = self._take(self.outbox_forward, action, f"F({s},{i}) produced it")
                self.spec(s, i).check(tensor, where)
                ops.append(CommOp(action, p2p.peer_of(action, sched.next_stage(s)), tensor))
            elif kind is Kind.SEND_B:
                tensor = self._take(self.outbox_backward, action, f"the backward of ({s},{i})")
                prev = sched.prev_stage(s)
                self.spec(prev, i).check(tensor, where)
                ops.append(CommOp(action, p2p.peer_of(action, prev), tensor))
            elif kind is Kind.RECV_F:
                prev = sched.prev_stage(s)
                buffer = self._tracked(p2p.receive_buffer(action, prev))
                ops.append(CommOp(action, p2p.peer_of(action, prev), buffer))
                receives.append((Kind.RECV_F, s, i, buffer))
            elif kind is Kind.RECV_B:
                buffer = self._tracked(p2p.receive_buffer(action, s))
                ops.append(CommOp(action, p2p.peer_of(action, sched.next_stage(s)), buffer))
                receives.append((Kind.RECV_B, s, i, buffer))
            else:
                raise ValueError(f"rank {self.pp_rank}: {action} is not a comm action")
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
        tensor = outbox.pop((action.stage, action.microbatch), None)
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

