"""Batched asynchronous point-to-point transfers between pipeline ranks.

The executor hands each maximal run of consecutive comm actions of a lowered schedule to
``PipelineP2P.post`` as one batch: all its sends and receives go out together through
``dist.batch_isend_irecv`` the moment the run is reached, ahead of the computation that needs
them, so the transfer overlaps whatever the rank computes in between. A compute action that
needs a received tensor calls ``PostedBatch.wait`` first.

Receive buffers need their shape and dtype before the data arrives. Instead of a header
exchange (an extra round trip per message), the caller declares them: a ``SpecFn`` maps
``(stage, microbatch)`` to the ``TensorSpec`` of the activation that stage sends forward (the
gradient that comes back has the same spec). A function of the microbatch supports variable
sequence lengths. Sends are checked against the declaration, so a wrong declaration fails on the
sender with both shapes named instead of corrupting or hanging the receiver.

A wait that outlives ``timeout`` raises ``P2PTimeoutError`` naming the rank, the action and the
peer (gloo's ``Work.wait(timeout)`` raises; see ``PostedBatch.wait``). After a timeout the
process group's pending operations are undefined: the error is meant to end the job with a
clear message, not to be retried on the same group.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

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

    def check(self, tensor: torch.Tensor, what: str) -> None:
        """Raise if ``tensor`` does not match this spec; ``what`` names it in the message."""
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"{what}: tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype} does not "
                f"match the declared TensorSpec(shape={self.shape}, dtype={self.dtype}); fix the "
                "spec passed to the executor (it must describe every stage boundary)"
            )


SpecFn = Callable[[int, int], TensorSpec]
"""``spec(stage, microbatch)``: what ``stage`` sends forward for ``microbatch``."""


class P2PTimeoutError(RuntimeError):
    """A send or receive did not complete within the configured timeout."""


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
    """The works of one posted batch; ``wait`` completes all of them or raises."""

    ops: list[CommOp]
    works: list[dist.Work]
    rank: int
    timeout: datetime.timedelta
    done: bool = field(default=False)

    def wait(self) -> None:
        """Wait for every op of the batch; a stuck op raises ``P2PTimeoutError`` naming it."""
        if self.done:
            return
        per_op = len(self.works) == len(self.ops)
        for index, work in enumerate(self.works):
            try:
                finished = work.wait(self.timeout)
            except RuntimeError as err:
                raise self._timeout_error(self.ops[index : index + 1] if per_op else self.ops, err)
            if finished is False:  # backends that report a timeout by returning False
                raise self._timeout_error(self.ops[index : index + 1] if per_op else self.ops, None)
        self.done = True

    def is_completed(self) -> bool:
        if not self.done and all(w.is_completed() for w in self.works):
            self.done = True
        return self.done

    def _timeout_error(self, ops: Sequence[CommOp], cause: BaseException | None) -> P2PTimeoutError:
        what = "; ".join(
            f"{op.action} ({'send to' if op.is_send else 'receive from'} rank {op.peer})"
            for op in ops
        )
        seconds = self.timeout.total_seconds()
        detail = f" ({cause})" if cause is not None else ""
        return P2PTimeoutError(
            f"rank {self.rank}: pipeline communication did not complete within {seconds:g}s: "
            f"{what}. The peer never posted the matching operation (crashed, hung, or runs a "
            f"different schedule){detail}"
        )


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
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be a positive number of seconds")
        self.group = group
        self.pp_ranks = tuple(pp_ranks)
        self.stage_to_rank = tuple(stage_to_rank)
        self.spec = spec
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout)
        self.rank = dist.get_rank()

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
        return PostedBatch(list(ops), list(works), self.rank, self.timeout)
