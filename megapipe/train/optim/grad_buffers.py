"""Flat gradient (and parameter) buffers of one stage, cut into buckets for data parallelism.

With ``--overlap-grad-reduce`` or ``--use-distributed-optimizer`` every trainable parameter's
float32 ``main_grad`` (``precision.main_grad``) is a view into one flat buffer per stage and kind
(dense parameters reduce over the DP group, experts over the expert-DP group), so a bucket of
consecutive parameters is one contiguous range that one collective reduces in place:

- parameters are laid out in reverse registration order (roughly the order the backward
  finishes them), each starting on a 64-element boundary (``ALIGN``);
- a bucket closes once it holds ``bucket_size`` elements (Megatron's rule; None: one bucket);
- sharded (the distributed optimizer), every bucket is padded to a multiple of ``ALIGN`` x the
  group size and split into one equal contiguous *shard* per rank of the group: rank r owns
  elements ``[start + r * n, start + (r + 1) * n)`` of every bucket. Gradients are
  reduce-scattered into the shards, the optimizer updates only its shards, and the updated
  parameters are all-gathered, so the parameters themselves are views into a flat buffer of
  the model's dtype too. Unsharded, a rank's shard of a bucket is the whole bucket.

``assign_buckets`` is the pure part (tested without processes); ``FlatBuffer`` allocates the
buffers and repoints the parameters; a ``Piece`` is where one parameter meets one of this rank's
shards (what the optimizer steps and a checkpoint stores).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

ALIGN = 64  # elements: parameter and shard starts (256 bytes in fp32, 128 in bf16)


def _pad(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Bucket:
    """Elements ``start..end`` of a buffer (``end`` padded), holding ``params`` (indices into
    the buffer's order)."""

    index: int
    start: int
    end: int
    params: tuple[int, ...]

    def shard(self, rank: int, shards: int) -> tuple[int, int]:
        """The element range of shard ``rank`` of ``shards`` equal ones."""
        size = (self.end - self.start) // shards
        return self.start + rank * size, self.start + (rank + 1) * size


def assign_buckets(
    numels: Sequence[int], bucket_size: int | None, shards: int = 1
) -> tuple[list[int], list[Bucket]]:
    """Start of every parameter (``numels`` in buffer order) and the buckets (module docstring).

    A bucket closes after the parameter that brings it to ``bucket_size`` elements or more;
    its end is padded to a multiple of ``ALIGN * shards``.
    """
    if bucket_size is not None and bucket_size < 1:
        raise ValueError(f"bucket_size={bucket_size} must be >= 1 (or None: one bucket)")
    starts: list[int] = []
    buckets: list[Bucket] = []
    bucket_start, members, position = 0, [], 0
    for index, numel in enumerate(numels):
        start = _pad(position, ALIGN)
        starts.append(start)
        members.append(index)
        position = start + numel
        if bucket_size is not None and position - bucket_start >= bucket_size:
            end = _pad(position, ALIGN * shards)
            buckets.append(Bucket(len(buckets), bucket_start, end, tuple(members)))
            bucket_start, members, position = end, [], end
    if members:
        buckets.append(
            Bucket(len(buckets), bucket_start, _pad(position, ALIGN * shards), tuple(members))
        )
    return starts, buckets


@dataclass(frozen=True)
class Piece:
    """Elements ``lo..hi`` of ``param`` (flattened) are elements ``start..start + hi - lo`` of
    the buffer, inside this rank's shard of bucket ``bucket``."""

    param: nn.Parameter
    lo: int
    hi: int
    start: int
    bucket: int

    @property
    def end(self) -> int:
        return self.start + self.hi - self.lo


class FlatBuffer:
    """One stage's dense (or expert) parameters over one group (module docstring).

    ``params`` in registration order; ``group`` the DP (or expert-DP) group, ``sharded`` the
    distributed optimizer's shards. Every parameter gets ``main_grad``, a float32 view into
    ``grad``; sharded, its data becomes a view into ``data`` (the model's dtype).
    """

    def __init__(
        self,
        kind: str,
        params: Sequence[nn.Parameter],
        group: dist.ProcessGroup | None,
        bucket_size: int | None,
        sharded: bool,
    ) -> None:
        if not params:
            raise ValueError(f"a {kind} buffer needs at least one parameter")
        self.kind = kind
        self.group = group
        self.group_size = dist.get_world_size(group) if group is not None else 1
        self.group_rank = dist.get_rank(group) if group is not None else 0
        self.sharded = sharded
        self.shards = self.group_size if sharded else 1
        self.params = list(reversed(params))  # buffer order: roughly the backward's
        starts, self.buckets = assign_buckets(
            [p.numel() for p in self.params], bucket_size, self.shards
        )
        self.starts = starts
        self.numel = self.buckets[-1].end
        first = self.params[0]
        self.grad = torch.zeros(self.numel, dtype=torch.float32, device=first.device)
        self.data: torch.Tensor | None = None
        if sharded:
            self.data = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
        self.bucket_of: dict[int, int] = {}
        for bucket in self.buckets:
            for index in bucket.params:
                self.bucket_of[id(self.params[index])] = bucket.index
        with torch.no_grad():
            for param, start in zip(self.params, starts):
                # main_grad: Megatron's fp32 gradient attribute on a Parameter
                param.main_grad = self.view(self.grad, param, start)  # type: ignore[attr-defined]
                if self.data is not None:
                    view = self.view(self.data, param, start)
                    view.copy_(param.detach())
                    param.data = view

    @staticmethod
    def view(flat: torch.Tensor, param: torch.Tensor, start: int) -> torch.Tensor:
        return flat[start : start + param.numel()].view(param.shape)

    def bucket_params(self, bucket: Bucket) -> list[nn.Parameter]:
        return [self.params[i] for i in bucket.params]

    def shard_range(self, bucket: Bucket) -> tuple[int, int]:
        """This rank's elements of ``bucket`` (all of them unsharded)."""
        if not self.sharded:
            return bucket.start, bucket.end
        return bucket.shard(self.group_rank, self.shards)

    def pieces(self, rank: int | None = None) -> Iterator[Piece]:
        """Where the parameters meet shard ``rank`` (default: this rank's) of every bucket, in
        buffer order; unsharded, every whole parameter."""
        rank = self.group_rank if rank is None else rank
        for bucket in self.buckets:
            lo, hi = bucket.shard(rank, self.shards) if self.sharded else (bucket.start, bucket.end)
            for index in bucket.params:
                param, start = self.params[index], self.starts[index]
                first, last = max(lo, start), min(hi, start + param.numel())
                if first < last:
                    yield Piece(param, first - start, last - start, first, bucket.index)

    def zero_grad(self) -> None:
        self.grad.zero_()


def stage_buffers(
    module: nn.Module,
    dense_group: dist.ProcessGroup | None,
    expert_group: dist.ProcessGroup | None,
    bucket_size: int | None,
    sharded: bool,
    is_expert: Callable[[torch.Tensor], bool],
) -> list[FlatBuffer]:
    """A stage's buffers: dense parameters over ``dense_group``, expert parameters
    (``is_expert(param)``) over ``expert_group``; a kind without parameters has none."""
    params = [p for p in module.parameters() if p.requires_grad]
    out = []
    for kind, group, mine in (
        ("dense", dense_group, [p for p in params if not is_expert(p)]),
        ("expert", expert_group, [p for p in params if is_expert(p)]),
    ):
        if mine:
            out.append(FlatBuffer(kind, mine, group, bucket_size, sharded))
    return out
