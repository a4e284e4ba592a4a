"""Rank-side code for the Megatron front-end tests (see ``pipeline_cases`` for the pool setup)."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from megapipe import get_forward_backward_func
from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage
from megapipe.parallel.config import ParallelConfig
from support.pipeline_cases import (
    CONFIG,
    MICRO_BATCH,
    Case,
    microbatch,
    prepare_groups,
    reference_run,
    subworld_groups,
)


def _loss_func(labels, form, output_tensor):
    """Megatron's loss_func: the 2-tuple or the 3-tuple (loss, num_tokens, dict) form."""
    loss = gpt_loss(output_tensor, labels)
    if form == 3:
        num_tokens = torch.tensor(float(labels.numel()))
        return loss * num_tokens, num_tokens, {"lm loss": loss.detach()}
    return loss, {"lm loss": loss.detach()}


def _forward_step(form, data_iterator, model):
    """A Megatron-style forward_step_func: read a batch, run the chunk, hand back loss_func."""
    tokens, labels = next(data_iterator)
    output = model(tokens if model.is_first else None)
    return output, partial(_loss_func, labels, form)


def megatron_run(case: Case, form: int, forward_only: bool = False) -> dict | None:
    """One training (or evaluation) call through get_forward_backward_func."""
    prepare_groups([ParallelConfig(case.pp, case.dp, case.ep)])
    if dist.get_rank() >= case.world:
        return None
    groups = subworld_groups(ParallelConfig(case.pp, case.dp, case.ep))
    func = get_forward_backward_func(
        pp=case.pp, vpp=case.vpp, schedule=case.schedule, groups=groups,
        overlap=case.overlap, timeout=20.0,
    )
    schedule_stages = func_stage_ids(func, case, groups.pp_rank)
    ep_group = groups.ep if case.ep > 1 else None
    num_parts = case.pp * case.vpp
    chunks = [build_stage(CONFIG, s, num_parts, ep_group) for s in schedule_stages]
    data = [microbatch(groups.dp_rank, i, 0) for i in range(case.microbatches)]
    iterators = [iter(data) for _ in chunks]
    losses = func(
        forward_step_func=partial(_forward_step, form),
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=case.microbatches,
        seq_length=CONFIG.seq_length,
        micro_batch_size=MICRO_BATCH,
        forward_only=forward_only,
    )
    return {
        "reference": reference_run(case, 1)[0] if dist.get_rank() == 0 else None,
        "dp_rank": groups.dp_rank,
        "ep_rank": groups.ep_rank,
        "losses": [d["lm loss"].item() for d in losses],
        "grads": {
            (s, n): (None if p.grad is None else p.grad.clone())
            for s, c in zip(schedule_stages, chunks)
            for n, p in c.named_parameters()
        },
    }


def func_stage_ids(func, case: Case, pp_rank: int) -> list[int]:
    """The stages the front end will give this rank's chunks, in chunk order."""
    from megapipe.schedule import build_schedule

    schedule = build_schedule(func.schedule_name, case.pp, case.microbatches, vpp=case.vpp)
    return schedule.stages_of_rank(pp_rank)
