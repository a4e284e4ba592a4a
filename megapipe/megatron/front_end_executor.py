"""The executor a Megatron front-end call needs, built once per call shape.

A call shape is the chunks, the microbatches, the sequence length and the microbatch size.
``build_executor`` builds the schedule, checks that it runs each stage's forwards in microbatch
order (the data iterator is read once per forward) and places one chunk per stage of this
pipeline rank (Megatron-Core chunks wrapped by ``as_stage_module``), derives the activation
spec that crosses stages (``axes`` and ``dtype``, Megatron's for Megatron-Core chunks), and
builds the ``PipelineExecutor``; with the overlap's auto mode also the plain schedule's executor
and the ``OverlapAuto`` that times the two.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from megapipe.megatron.front_end_options import FrontEndOptions
from megapipe.megatron.mcore_adapter import McoreGPTStage, as_stage_module
from megapipe.megatron.mcore_support import activation_shape, check_cuda_graphs
from megapipe.moe.layer import take_overflow
from megapipe.parallel.groups import pipeline_position
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.executor_options import ExecutorOptions
from megapipe.pipeline.overlap_auto import OverlapAuto
from megapipe.pipeline.p2p import TensorSpec
from megapipe.schedule import Kind, Schedule, build_schedule
from megapipe.schedule.actions import plain_key


def build_executor(
    o: FrontEndOptions,
    chunks: list[nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    loss_fn: Callable[..., torch.Tensor],
    forward_fn: Callable[[nn.Module, Any], torch.Tensor],
) -> tuple[PipelineExecutor, dict[int, nn.Module], OverlapAuto | None]:
    """The executor of this call shape, its stages, and with auto mode the ``OverlapAuto``."""
    schedule = _schedule(o, num_microbatches, o.overlap)
    stages = _placed_stages(o, schedule, chunks)
    placed = list(stages.values())
    build = partial(
        PipelineExecutor,
        stages=stages,
        options=ExecutorOptions(
            spec=_activation_spec(o, placed, seq_length, micro_batch_size),
            loss_fn=loss_fn,
            groups=o.groups,
            grad_reduction="dp" if o.reduce_grads else "none",
            forward_fn=forward_fn,
            timeout=o.timeout,
            delay_wgrad_compute=o.delay_wgrad_compute,
            record_trace=o.record_trace,
            # Megatron chunks that recompute or defer weight gradients to backward_dw() run on
            # the tape in every schedule (McoreGPTStage.needs_tape)
            use_tape=any(getattr(c, "needs_tape", False) for c in placed),
            cuda_graph_impl=o.cuda_graph_impl,
            cuda_graph_modules=o.cuda_graph_modules,
        ),
    )
    executor = build(schedule)
    if not o.overlap_auto:
        return executor, stages, None
    plain_schedule = _schedule(o, num_microbatches, overlap=False)  # pipeline.overlap_auto
    device = next((p.device for c in placed for p in c.parameters()), "cpu")
    g = o.groups  # the MAX over pp, then dp (and tp) reaches every rank of the grid
    agree = (None,) if g is None else tuple(x for x in (g.pp, g.dp, g.tp) if x is not None)
    auto = OverlapAuto(
        build(plain_schedule),
        executor,
        o.overlap_auto_interval,
        o.overlap_auto_clock,
        groups=agree,
        device=device,
    )
    return executor, stages, auto


def _schedule(o: FrontEndOptions, num_microbatches: int, overlap: bool) -> Schedule:
    """The schedule the options name, checked to run forwards in microbatch order."""
    schedule = build_schedule(
        o.schedule_name,
        o.pp,
        num_microbatches,
        vpp=o.vpp,
        overlap=overlap,
        max_extra_in_flight=o.max_extra_in_flight,
        microbatch_group_size_per_vp_stage=o.microbatch_group_size_per_vp_stage,
    )
    _check_microbatch_sequence(o.schedule_name, schedule)
    return schedule


def _check_microbatch_sequence(name: str, schedule: Schedule) -> None:
    """forward_step_func reads the next batch from a chunk's iterator: every stage must run
    its forwards in microbatch order for the batches to line up."""
    order: dict[int, list[int]] = {}
    for row in schedule.actions:
        for action in row:
            for comp in action.computations():
                if comp.kind is Kind.F:
                    stage, microbatch = plain_key(comp)
                    order.setdefault(stage, []).append(microbatch)
    for stage, mbs in order.items():
        if mbs != sorted(mbs):
            raise ValueError(
                f"schedule {name!r} runs stage {stage}'s forwards in the order "
                f"{mbs}; the Megatron front end needs microbatch order (the data iterator "
                "is read once per forward)"
            )


def _placed_stages(
    o: FrontEndOptions, schedule: Schedule, chunks: list[nn.Module]
) -> dict[int, nn.Module]:
    """This pipeline rank's stages, one chunk each (wrapped as a stage module), checked."""
    pp_rank = pipeline_position(o.pp, o.groups).rank
    stage_ids = schedule.stages_of_rank(pp_rank)
    if len(chunks) != len(stage_ids):
        raise ValueError(
            f"the {o.schedule_name!r} schedule with pp={o.pp}, vpp={o.vpp} places "
            f"{len(stage_ids)} chunk(s) on pipeline rank {pp_rank} (stages {stage_ids}); "
            f"model has {len(chunks)}"
        )
    chunks = [as_stage_module(chunk) for chunk in chunks]
    if take_overflow(chunks) is not None:
        raise ValueError(
            "MoE layers with a rank capacity (moe_expert_rank_capacity_factor) are not "
            "supported by the Megatron front end: a step that overflows must run again "
            "from the gradients the call started with (megapipe pretrain does it)"
        )
    for chunk in chunks:
        if not callable(getattr(chunk, "set_input_tensor", None)):
            raise TypeError(
                f"model chunk {type(chunk).__name__} has no set_input_tensor(tensor); "
                "Megatron's convention needs it to hand a received activation to the chunk"
            )
    stages = dict(zip(stage_ids, chunks))
    for stage, chunk in stages.items():
        if isinstance(chunk, McoreGPTStage):
            first, last = schedule.is_first_stage(stage), schedule.is_last_stage(stage)
            chunk.check_stage(stage, first, last)
            check_cuda_graphs(o.cuda_graph_impl)
    return stages


def _activation_spec(
    o: FrontEndOptions, chunks: list[nn.Module], seq_length: int, micro_batch_size: int
) -> TensorSpec | None:
    """The shape and dtype of an activation crossing stages (None: one stage, no hidden size
    known)."""
    hidden = o.hidden_size or getattr(getattr(chunks[0], "config", None), "hidden_size", None)
    if hidden is None:
        if o.pp > 1:
            raise ValueError(
                "hidden_size is needed for the activation shape: pass it to "
                "get_forward_backward_func or give the chunks a .config.hidden_size"
            )
        return None
    megatron = [c for c in chunks if isinstance(c, McoreGPTStage)]
    axes = o.axes or ("sbh" if megatron else "bsh")
    shape = (
        (micro_batch_size, seq_length, hidden)
        if axes == "bsh"
        else (seq_length, micro_batch_size, hidden)
    )
    if megatron and axes == "sbh" and o.hidden_size is None:  # Megatron's own shape
        shape = activation_shape(megatron[0].config, seq_length, micro_batch_size)
    dtype = o.dtype or (_pipeline_dtype(megatron[0]) if megatron else torch.float32)
    return TensorSpec(shape, dtype)


def _pipeline_dtype(chunk: McoreGPTStage) -> torch.dtype:
    """What a Megatron-Core chunk sends between stages: its config's pipeline dtype."""
    config = chunk.config
    return config.pipeline_dtype or config.params_dtype or torch.float32
