"""Rank-side code of the Megatron DDP tests: three optimizer steps of Megatron's own schedule and
of megapipe's, both with Megatron's ``DistributedDataParallel`` (``overlap_grad_reduce``,
``use_distributed_optimizer``, ``overlap_param_gather``) and Megatron's distributed optimizer,
set up the way ``megatron/training/training.py`` sets them up (hooks on the model config).

The model and data are ``mcore_cases``'s (weights a function of each parameter's global name),
so parameters compare by global name across placements.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from support import megatron_cpu
from support.mcore_cases import (
    MICRO_BATCH,
    SEQ,
    McoreCase,
    _setup,
    build_chunks,
    forward_step,
    microbatches,
)

BUCKET = 4000  # elements: several buckets per chunk of the test model
STEPS = 3


def _ddp_chunks(case: McoreCase):
    """Chunks wrapped as a Megatron script wraps them (bucketing on the first chunk only),
    with the config hooks training.py sets."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    config, chunks, names = build_chunks(case)
    interleaved = len(chunks) > 1
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, overlap_param_gather=True,
        align_param_gather=interleaved, bucket_size=BUCKET,
    )
    model = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=j > 0)
             for j, chunk in enumerate(chunks)]
    names = [{f"module.{n}": v for n, v in chunk_names.items()} for chunk_names in names]
    one = (lambda funcs: funcs[0]) if not interleaved else (lambda funcs: funcs)
    config.no_sync_func = one([m.no_sync for m in model])
    config.grad_sync_func = one([m.start_grad_sync for m in model])
    config.param_sync_func = [m.start_param_sync for m in model] if interleaved else None
    config.finalize_model_grads_func = finalize_model_grads
    return config, model, names


def _train(case: McoreCase, forward_backward: Callable[..., Any]) -> dict[str, Any]:
    """Three steps of Megatron's training loop (zero the buffers, forward-backward, the
    optimizer's step); then every parameter, gathered, by global name."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config, model, names = _ddp_chunks(case)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.01, clip_grad=0.5,
                        adam_beta2=0.95, use_distributed_optimizer=True),
        model, use_gloo_process_groups=False,
    )
    data = microbatches(case, parallel_state.get_data_parallel_rank())
    losses, norms = [], []
    for _ in range(STEPS):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        iterators = [iter(data) for _ in model]
        out = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators if len(model) > 1 else iterators[0],
            model=model if len(model) > 1 else model[0],
            num_microbatches=case.microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        )
        losses.append([d["lm loss"].item() for d in out])
        ok, norm, _ = optimizer.step()
        assert ok
        norms.append(norm)
    for chunk in model:
        chunk.disable_forward_pre_hook(param_sync=True)  # the last step's gathers, now
    params = {names[j][n]: p.detach().clone()
              for j, chunk in enumerate(model) for n, p in chunk.named_parameters()}
    return {"params": params, "losses": losses, "norms": norms}


def _groups(case: McoreCase):
    from megapipe.parallel.config import ParallelConfig
    from megapipe.parallel.groups import create_groups

    world = dist.get_world_size()
    return create_groups(ParallelConfig(pp=case.pp, dp=world // case.pp, ep=case.ep))


def ddp_overlap_case(case: McoreCase) -> dict[str, Any]:
    """Megatron's schedule (its interleaved 1F1B, or no pipelining) as the reference, then
    megapipe's schedule ``case.schedule``, plain and combined, on freshly built chunks."""
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_func

    from megapipe import get_forward_backward_func

    megatron_cpu.apply_optimizer_patches()
    _setup(case)
    out = {"reference": _train(replace(case, schedule=None), megatron_func())}
    groups = _groups(case)
    for run, overlap in (("plain", False), ("overlap", True)):
        func = get_forward_backward_func(
            pp=case.pp, vpp=case.vpp, schedule=case.schedule, groups=groups, timeout=120.0,
            overlap_moe_expert_parallel_comm=overlap, reduce_grads=False,
        )
        try:
            out[run] = _train(case, func)
        finally:
            func.close()
    dist.barrier()
    return out
