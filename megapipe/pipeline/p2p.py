"""The batched p2p that moves tensors between pipeline stages (the transport).

The comm actions of each gap of a lowered schedule (between two computations) go to
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megapipe.schedule.actions import plain_key
from megapipe.schedule.ir import Action, Kind


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

    def __call__(self, stage: int, microbatch: int) -> TensorSpec:
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
        _, microbatch = plain_key(action)
        return self.spec(sender_stage, microbatch).empty(self.device)

    def post(self, ops: Sequence[CommOp]) -> PostedBatch:
        """Post ``ops`` as one batch (sends and receives go out together)."""
        p2p_ops = [
            dist.P2POp(dist.isend if op.is_send else dist.irecv, op.tensor, op.peer, self.group)
            for op in ops
        ]
        works = dist.batch_isend_irecv(p2p_ops) if p2p_ops else []
        return PostedBatch(list(ops), list(works), self.rank, self.timeout, self.wait_mode)
