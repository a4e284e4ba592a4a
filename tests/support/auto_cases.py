"""Rank-side code of the front end's overlap auto test: several training calls, each followed
by a plain SGD update, so every call's loss depends on all before it."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from megapipe import get_forward_backward_func
from megapipe.models.split import build_stage
from megapipe.parallel.config import ParallelConfig
from support.megatron_cases import _forward_step, func_stage_ids
from support.pipeline_cases import (
    CONFIG,
    MICRO_BATCH,
    Case,
    microbatch,
    prepare_groups,
    subworld_groups,
)
from support.scripted_clock import ScriptedClock


def auto_calls(case: Case, overlap, calls: int, seconds_by_rank=None) -> dict | None:
    """``calls`` training calls with ``overlap_moe_expert_parallel_comm=overlap`` (True, False,
    "auto" with the scripted step times of ``seconds_by_rank``): the losses of every call, the
    final weights, the auto decisions."""
    prepare_groups([ParallelConfig(case.pp, case.dp, case.ep)])  # collective: every rank
    if dist.get_rank() >= case.world:
        return None
    groups = subworld_groups(ParallelConfig(case.pp, case.dp, case.ep))
    clock = ScriptedClock(seconds_by_rank[dist.get_rank()]) if seconds_by_rank else None
    func = get_forward_backward_func(
        pp=case.pp, vpp=case.vpp, schedule=case.schedule, groups=groups, timeout=20.0,
        overlap_moe_expert_parallel_comm=overlap, overlap_auto_interval=0,
        **({"overlap_auto_clock": clock} if clock else {}),
    )
    stages = func_stage_ids(func, case, groups.pp_rank)
    chunks = [build_stage(CONFIG, s, case.pp * case.vpp, groups.ep if case.ep > 1 else None)
              for s in stages]
    losses = []
    for call in range(calls):
        data = [microbatch(groups.dp_rank, i, call) for i in range(case.microbatches)]
        out = func(forward_step_func=partial(_forward_step, 2),
                   data_iterator=[iter(data) for _ in chunks], model=chunks,
                   num_microbatches=case.microbatches, seq_length=CONFIG.seq_length,
                   micro_batch_size=MICRO_BATCH)
        losses.append([d["lm loss"].item() for d in out])
        with torch.no_grad():
            for chunk in chunks:
                for p in chunk.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
                        p.grad = None
    func.close()
    return {"losses": losses, "lines": func.overlap_auto_lines,
            "weights": [p.detach().clone() for c in chunks for p in c.parameters()]}
