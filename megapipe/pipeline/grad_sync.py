"""Gradient synchronisation after the last backward action of a training step.

- DualPipe mirrors: stage ``n + k`` holds a copy of model part ``k`` (``n`` stages per
  pipeline). Both copies must end the step with the same gradient, the sum of the two, so an
  optimizer keeps them identical. The two ranks exchange flattened gradients over the pipeline
  group and each adds the other's to its own; fp addition commutes, so both copies are bitwise
  equal. When both copies live on one rank (odd pp) the sum is local.
- Data parallelism: each rank's loss is its own microbatches' mean, and the global loss is the
  mean over the ``dp`` ranks, so dense gradients are summed over the DP group and divided by
  ``dp``. An expert parameter (megapipe's ``param.expert_parallel = True``, or Megatron's
  ``param.allreduce = False``) already holds the contributions of every rank of its EP block
  (through the all-to-all's backward); summing over the expert-data-parallel group covers all
  ``dp`` ranks once, so it is also divided by ``dp``.
- Tied embeddings across stages: a parameter marked ``shared_embedding = True`` (Megatron's
  mark for the word embedding of the first stage and the output weight of the last stage when
  the two are tied and pp > 1) is one weight held twice; both copies end with the sum of their
  gradients (after the DP average, the order Megatron's ``finalize_model_grads`` uses).

Every sum and reduction acts on the tensor each gradient accumulates in
(``precision.main_grad.grad_buffer``): the float32 ``main_grad`` of a bf16 model, so they run in
float32, else ``.grad``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megapipe.parallel.groups import ProcessGroups
from megapipe.precision.main_grad import grad_buffer
from megapipe.schedule.ir import Schedule


def _grads(module: nn.Module) -> list[torch.Tensor]:
    """Every trainable parameter's gradient buffer, zeros where a parameter received none."""
    return [grad_buffer(p) for p in module.parameters() if p.requires_grad]


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def mirror_of(schedule: Schedule, stage: int) -> int:
    """The stage holding the same model part in the other direction of a DualPipe schedule."""
    n = schedule.stages_per_pipeline
    return stage + n if stage < n else stage - n


def sum_mirrored_grads(
    schedule: Schedule,
    pp_rank: int,
    stages: Mapping[int, nn.Module],
    pp_group: dist.ProcessGroup | None,
    pp_ranks: Sequence[int],
) -> None:
    """Make both copies of every DualPipe model part hold the sum of their gradients."""
    if not schedule.bidirectional:
        return
    ops: list[dist.P2POp] = []
    exchanges: list[tuple[list[torch.Tensor], torch.Tensor]] = []
    # both ranks of a pair walk their stages by model part, so their messages pair up in order
    for stage in sorted(stages, key=schedule.model_part):
        mirror = mirror_of(schedule, stage)
        owner = schedule.stage_to_rank[mirror]
        grads = _grads(stages[stage])
        if owner == pp_rank:
            if stage < mirror:  # do each local pair once
                other = _grads(stages[mirror])
                for mine, theirs in zip(grads, other):
                    total = mine + theirs
                    mine.copy_(total)
                    theirs.copy_(total)
            continue
        flat = _flat(grads)
        received = torch.empty_like(flat)
        peer = pp_ranks[owner]
        ops.append(dist.P2POp(dist.isend, flat, peer, pp_group))
        ops.append(dist.P2POp(dist.irecv, received, peer, pp_group))
        exchanges.append((grads, received))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    # the peer sends its copy of *our* stage's part: the mirror stage's gradients, same shapes
    for grads, received in exchanges:
        _unflatten_into(_flat(grads) + received, grads)


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to an expert sharded over EP (megapipe's or Megatron's mark)."""
    return getattr(param, "expert_parallel", False) or not getattr(param, "allreduce", True)


def _tied_params(module: nn.Module) -> list[torch.Tensor]:
    return [
        p for p in module.parameters() if p.requires_grad and getattr(p, "shared_embedding", False)
    ]


def sum_tied_embedding_grads(
    schedule: Schedule,
    pp_rank: int,
    stages: Mapping[int, nn.Module],
    pp_group: dist.ProcessGroup | None,
    pp_ranks: Sequence[int],
) -> None:
    """Give both copies of a weight tied between the first and the last stage (module
    docstring) the sum of their gradients: locally when one rank holds both stages, else by
    an exchange over the pipeline group."""
    first, last = 0, schedule.num_stages - 1
    held = {s: _tied_params(stages[s]) for s in (first, last) if s in stages}
    if not any(held.values()):
        return
    if schedule.bidirectional:
        raise NotImplementedError(
            "embeddings tied across stages are not supported in bidirectional (DualPipe) "
            "schedules: each model part has two copies there"
        )
    for params in held.values():
        if len(params) != 1:
            raise ValueError(
                f"a first or last stage holds {len(params)} parameters marked shared_embedding; "
                "expected exactly one (the tied word embedding / output weight)"
            )
    grads = {s: grad_buffer(params[0]) for s, params in held.items()}
    if len(grads) == 2:
        total = grads[first] + grads[last]
        grads[first].copy_(total)
        grads[last].copy_(total)
        return
    ((stage, grad),) = grads.items()
    peer = pp_ranks[schedule.stage_to_rank[last if stage == first else first]]
    received = torch.empty_like(grad)
    ops = [
        dist.P2POp(dist.isend, grad, peer, pp_group),
        dist.P2POp(dist.irecv, received, peer, pp_group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    grad.add_(received)


def all_reduce_grads(stages: Mapping[int, nn.Module], groups: ProcessGroups) -> None:
    """Average gradients over data parallelism (expert parameters over expert-DP; see above)."""
    dp = groups.config.dp
    if dp == 1:
        return
    dense: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for stage in sorted(stages):
        for p in stages[stage].parameters():
            if p.requires_grad:
                (expert if is_expert_param(p) else dense).append(grad_buffer(p))
    for grads, group, size in (
        (dense, groups.dp, dp),
        (expert, groups.expert_dp, groups.config.expert_dp),
    ):
        if not grads:
            continue
        flat = _flat(grads)
        if size > 1:
            dist.all_reduce(flat, group=group)
        flat.div_(dp)
        _unflatten_into(flat, grads)


def sync_step_grads(
    schedule: Schedule,
    pp_rank: int,
    stages: Mapping[int, nn.Module],
    position: Any,
    groups: ProcessGroups | None,
    grad_reduction: str,
) -> None:
    """After a training step: DualPipe's mirrored gradients summed; with ``grad_reduction``
    "dp" also data-parallel gradients averaged (needs ``groups``) and tied embeddings summed.
    ``position``: the executor's ``pipeline_position`` (its group and global ranks)."""
    if schedule.bidirectional:
        sum_mirrored_grads(schedule, pp_rank, stages, position.group, position.ranks)
    if grad_reduction == "dp":
        if groups is not None:
            all_reduce_grads(stages, groups)
        sum_tied_embedding_grads(schedule, pp_rank, stages, position.group, position.ranks)
