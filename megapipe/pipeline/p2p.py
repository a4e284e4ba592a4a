"""What crosses between pipeline stages during a step, and the batched p2p that moves it.

``StepTensors`` is what the executor knows of the data in transit while it walks one rank's
action list for one step, keyed by (stage, microbatch): a forward's output goes to the next
stage (locally when that stage lives on this rank, else into the outbox its SEND_F posts), a
backward's input gradient likewise (SEND_B); ``forward_input`` / ``grad_output`` give a compute
action what it consumes, waiting first for the batch that receives it (a first stage reads its
microbatch; a last stage has no output gradient: its backward starts from the loss);
``PairSends`` posts the run after one OVERLAP as its halves' results are handed over, the sends
the early-send rule allows one by one (``schedule.p2p.early_sends``). ``track`` (a measured step)
is told of every tensor taken into transit (``activation_meter``).

**The p2p.** The comm actions of each gap of a lowered schedule (between two computations) go to
``PipelineP2P.post`` as one batch: all its sends and receives go out together through
``dist.batch_isend_irecv`` the moment the gap is reached, ahead of the computation that needs
them, so the transfer overlaps whatever the rank computes in between. A compute action that
needs a received tensor calls ``PostedBatch.wait`` first.

Receive buffers need their shape and dtype before the data arrives. Instead of a header
exchange (an extra round trip per message), the caller declares them: a ``SpecFn`` maps
``(stage, microbatch)`` to the ``TensorSpec`` of the activation that stage sends forward (the
gradient that comes back has the same spec). A function of the microbatch supports variable
sequence lengths. Sends are checked against the declaration, so a wrong declaration fails on the
sender with both shapes named instead of corrupting or hanging the receiver.

A wait has a deadline, ``timeout`` seconds after it starts. Backends differ in how they
honour one, so ``PostedBatch.wait`` has two ways to wait (``WAIT_MODES``):

- ``"block"`` (gloo): ``Work.wait(timeout)`` blocks and raises, at the deadline or as soon as the
  peer's connection breaks (gloo never marks a failed receive completed, so polling would miss
  a dead peer until the deadline);
- ``"poll"`` (NCCL and others): ``Work.is_completed()`` is polled against the deadline (NCCL's
  ``wait(timeout)`` does not raise on time), then ``Work.wait()`` orders the current stream
  after the transfer and raises the work's error, if any.

Either way a failure says what happened: ``P2PTimeoutError`` (nothing arrived by the deadline:
the peer hung, or runs another schedule) or ``P2PPeerError`` (the transfer failed before the
deadline: the connection to the peer broke, typically because it died), each naming the rank,
the actions and the peers. After either, the group's pending operations are undefined: the
error is meant to end the job with a clear message, not to be retried on the same group.
"""

from __future__ import annotations

import datetime
import re
import time
from functools import partial
from dataclasses import dataclass, field
from contextlib import AbstractContextManager
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from megapipe.overlap.plan import Track
from megapipe.schedule.p2p.early_sends import RECEIVES
from megapipe.schedule.ir import Action, Kind, Schedule


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor that crosses a stage boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if any(d < 0 for d in self.shape):
            raise ValueError(f"TensorSpec shape {self.shape} has a negative dimension")

    def empty(self, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def __call__(self, stage: int, microbatch: int) -> "TensorSpec":
        """One spec for every boundary is a ``SpecFn`` too."""
        return self

    def check(self, tensor: torch.Tensor, what: str | Callable[[], str]) -> None:
        """Raise if ``tensor`` does not match this spec; ``what`` (or ``what()``) names it."""
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            what = what if isinstance(what, str) else what()
            raise ValueError(
                f"{what}: tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype} does not "
                f"match the declared TensorSpec(shape={self.shape}, dtype={self.dtype}); fix the "
                "spec passed to the executor (it must describe every stage boundary)"
            )


SpecFn = Callable[[int, int], TensorSpec]
"""``spec(stage, microbatch)``: what ``stage`` sends forward for ``microbatch``."""


WAIT_MODES = ("block", "poll")
_POLL_FIRST_S, _POLL_MAX_S = 5e-5, 2e-3  # poll period: starts short, doubles up to the max


class P2PError(RuntimeError):
    """A pipeline send or receive failed; the message names the rank, the actions, the peers."""


class P2PTimeoutError(P2PError):
    """A send or receive did not complete within the configured timeout."""


class P2PPeerError(P2PError):
    """A send or receive failed before the timeout (the connection to a peer broke)."""


def wait_mode_for(group: dist.ProcessGroup | None) -> str:
    """``"block"`` on gloo, whose ``Work.wait(timeout)`` raises on time; ``"poll"`` elsewhere."""
    try:
        backend = dist.get_backend(group)
    except (RuntimeError, ValueError):
        return "poll"
    return "block" if str(backend) == "gloo" else "poll"


@dataclass
class CommOp:
    """One send or receive of a batch: the action it implements, the peer's global rank."""

    action: Action
    peer: int
    tensor: torch.Tensor

    @property
    def is_send(self) -> bool:
        return self.action.kind in (Kind.SEND_F, Kind.SEND_B)


@dataclass
class PostedBatch:
    """The works of one posted batch; ``wait`` completes all of them or raises a ``P2PError``."""

    ops: list[CommOp]
    works: list[dist.Work]
    rank: int
    timeout: datetime.timedelta
    wait_mode: str = "block"
    done: bool = field(default=False)

    def wait(self) -> None:
        """Wait for every op of the batch (module docstring: deadline, modes, errors)."""
        if self.done:
            return
        started = time.monotonic()
        deadline = started + self.timeout.total_seconds()
        per_op = len(self.works) == len(self.ops)
        for index, work in enumerate(self.works):
            ops = self.ops[index : index + 1] if per_op else self.ops
            if self.wait_mode == "poll" and not _poll(work, deadline):
                raise self._error(ops, started, None, timed_out=True)
            remaining = max(deadline - time.monotonic(), 1e-3)
            try:
                if self.wait_mode == "poll":
                    finished = work.wait()
                else:
                    finished = work.wait(datetime.timedelta(seconds=remaining))
            except RuntimeError as err:
                raise self._error(ops, started, err, _is_timeout(err, deadline)) from None
            if finished is False:  # backends that report a timeout by returning False
                raise self._error(ops, started, None, timed_out=True)
        self.done = True

    def is_completed(self) -> bool:
        if not self.done and all(w.is_completed() for w in self.works):
            self.done = True
        return self.done

    def _error(
        self, ops: Sequence[CommOp], started: float, cause: BaseException | None, timed_out: bool
    ) -> P2PError:
        what = "; ".join(
            f"{op.action} ({'send to' if op.is_send else 'receive from'} rank {op.peer})"
            for op in ops
        )
        detail = f" ({backend_message(cause)})" if cause is not None else ""
        if timed_out:
            return P2PTimeoutError(
                f"rank {self.rank}: pipeline communication did not complete within "
                f"{self.timeout.total_seconds():g}s: {what}. The peer never posted the matching "
                f"operation (hung, or runs a different schedule){detail}"
            )
        peers = sorted({op.peer for op in ops})
        return P2PPeerError(
            f"rank {self.rank}: pipeline communication failed after "
            f"{time.monotonic() - started:.1f}s: {what}. The connection to rank "
            f"{', '.join(map(str, peers))} broke (the rank has probably died){detail}"
        )


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*")


def backend_message(error: BaseException) -> str:
    """A backend's error as one short line: the first line, without gloo's ``[file:line]``
    prefix and the generic advice after its first sentence; the type name if empty."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    if _SOURCE_PREFIX.match(line):
        line = _SOURCE_PREFIX.sub("", line).split(". ")[0]
    return line or type(error).__name__


def is_backend_error(error: BaseException) -> bool:
    """An error of torch.distributed's backend (gloo, NCCL, the store), not one of ours."""
    return isinstance(error, dist.DistError) or (
        type(error) is RuntimeError and bool(_SOURCE_PREFIX.match(str(error).strip()))
    )


def _poll(work: dist.Work, deadline: float) -> bool:
    """Poll ``work`` until it completes (True) or the deadline passes (False)."""
    period = _POLL_FIRST_S
    while not work.is_completed():
        if time.monotonic() >= deadline:
            return False
        time.sleep(period)
        period = min(2 * period, _POLL_MAX_S)
    return True


def _is_timeout(error: BaseException, deadline: float) -> bool:
    """Whether a backend's error means "not done by the deadline" rather than a failure."""
    return time.monotonic() >= deadline - 0.05 or "timed out" in str(error).lower()


class PipelineP2P:
    """Posts batches of sends and receives over the pipeline-parallel group.

    ``pp_ranks[i]`` is the global rank of pipeline position i (``ProcessGroups.pp_ranks``);
    ``stage_to_rank`` maps a stage to its pipeline position; receive buffers are allocated on
    ``device`` (the stages' device: CPU for gloo, the GPU for NCCL).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        pp_ranks: Sequence[int],
        stage_to_rank: Sequence[int],
        spec: SpecFn,
        timeout: float = 300.0,
        device: torch.device | None = None,
        wait_mode: str | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be a positive number of seconds")
        if wait_mode is not None and wait_mode not in WAIT_MODES:
            raise ValueError(f"wait_mode={wait_mode!r} must be one of {', '.join(WAIT_MODES)}")
        self.group = group
        self.pp_ranks = tuple(pp_ranks)
        self.stage_to_rank = tuple(stage_to_rank)
        self.spec = spec
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout)
        self.rank = dist.get_rank()
        self.wait_mode = wait_mode or wait_mode_for(group)

    def peer_of(self, action: Action, neighbour_stage: int) -> int:
        """The global rank of the stage ``action`` exchanges data with."""
        return self.pp_ranks[self.stage_to_rank[neighbour_stage]]

    def receive_buffer(self, action: Action, sender_stage: int) -> torch.Tensor:
        """An empty tensor for what ``action`` receives (the sender stage's forward spec)."""
        return self.spec(sender_stage, action.microbatch).empty(self.device)

    def post(self, ops: Sequence[CommOp]) -> PostedBatch:
        """Post ``ops`` as one batch (sends and receives go out together)."""
        p2p_ops = [
            dist.P2POp(dist.isend if op.is_send else dist.irecv, op.tensor, op.peer, self.group)
            for op in ops
        ]
        works = dist.batch_isend_irecv(p2p_ops) if p2p_ops else []
        return PostedBatch(list(ops), list(works), self.rank, self.timeout, self.wait_mode)


Key = tuple[int, int]  # (stage, microbatch)


def stage_links(schedule: Schedule) -> tuple[dict[int, int | None], dict[int, int | None]]:
    """Per stage, the stage before and the stage after it in its pipeline (None at the ends)."""
    stages = range(schedule.num_stages)
    return ({s: schedule.prev_stage(s) for s in stages},
            {s: schedule.next_stage(s) for s in stages})


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
        s, i = action.stage, action.microbatch
        nxt = self.next[s]
        assert nxt is not None
        if self.schedule.stage_to_rank[nxt] == self.pp_rank:
            self.forward_inputs[(nxt, i)] = self._tracked(output.detach())
        else:
            self.outbox_forward[(s, i)] = self._tracked(output.detach())

    def hand_backward(self, action: Action, grad_input: torch.Tensor | None) -> None:
        """The input gradient of B/I(s, i) goes to stage s-1, here or via SEND_B (a first stage
        has none to hand on)."""
        s, i = action.stage, action.microbatch
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
        s, i = action.stage, action.microbatch
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
        s, i = action.stage, action.microbatch
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
            s, i, kind = action.stage, action.microbatch, action.kind
            where = partial(f"rank {self.pp_rank}, {{}}".format, action)  # read on an error
            if kind is Kind.SEND_F:
                tensor = self._take(self.outbox_forward, action, f"F({s},{i}) produced it")
                self.spec(s, i).check(tensor, where)
                ops.append(CommOp(action, p2p.peer_of(action, self.next[s]), tensor))
            elif kind is Kind.SEND_B:
                tensor = self._take(self.outbox_backward, action, f"the backward of ({s},{i})")
                prev = self.prev[s]
                self.spec(prev, i).check(tensor, where)
                ops.append(CommOp(action, p2p.peer_of(action, prev), tensor))
            elif kind is Kind.RECV_F:
                prev = self.prev[s]
                buffer = self._tracked(p2p.receive_buffer(action, prev))
                ops.append(CommOp(action, p2p.peer_of(action, prev), buffer))
                receives.append((Kind.RECV_F, s, i, buffer))
            elif kind is Kind.RECV_B:
                buffer = self._tracked(p2p.receive_buffer(action, s))
                ops.append(CommOp(action, p2p.peer_of(action, self.next[s]), buffer))
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


class PairSends:
    """Posts the run after one OVERLAP as its halves finish (``post_ready`` after each hand-over).

    ``early``: the sends that go out one by one (``choose_early_sends``); empty: the whole run goes
    once every send in it is ready. The executor posts whatever is left after the pair.
    ``backward_done`` is the combined step's hand-over (``CombinedStep(backward_done=...)``):
    ``end(grads)`` (the stage worker's ``end_backward``, for ``backward``) gives the stage's
    input gradient, which goes to the stage before (none on a first stage), then the sends go.
    ``end`` is dropped once called, so nothing of the backward half stays reachable from here.
    """

    def __init__(
        self, tensors: StepTensors, run: Sequence[Action], early: Sequence[Action] = (),
        backward: Action | None = None, end: Callable[[Any], torch.Tensor | None] | None = None,
    ) -> None:
        self.tensors = tensors
        self.run = list(run)
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
            sends = [a for a in self.run if a.kind in (Kind.SEND_F, Kind.SEND_B)]
            if self.first and self.run and all(tensors.ready_to_send(a) for a in sends):
                tensors.post(self.run)
                self.first = False
            return
        ready = []
        while self.early and tensors.ready_to_send(self.early[0]):
            ready.append(self.early.pop(0))
        if not ready:
            return
        if self.first:  # the gap's receives go with the first early send (as in the proof)
            ready += [a for a in self.run if a.kind in RECEIVES]
            self.first = False
        tensors.post(ready)
