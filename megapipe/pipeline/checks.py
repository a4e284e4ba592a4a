"""The executor's argument checks: run before any collective, naming the value and the rule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from megapipe.pipeline.p2p import TensorSpec
from megapipe.schedule.ir import Kind, Schedule


def check_executor_options(
    spec: Any,
    grad_reduction: str,
    known_reductions: Sequence[str],
    timeout: float,
    tp: int = 1,
) -> None:
    """``spec`` a TensorSpec or a function of (stage, microbatch); a known gradient reduction
    (not megapipe's own with tensor parallelism ``tp`` > 1); a positive timeout."""
    if spec is not None and not isinstance(spec, TensorSpec) and not callable(spec):
        raise TypeError(
            f"spec={spec!r} must be a TensorSpec(shape, dtype) or a function "
            "spec(stage, microbatch) -> TensorSpec"
        )
    if grad_reduction not in known_reductions:
        raise ValueError(
            f"grad_reduction={grad_reduction!r} must be one of {', '.join(known_reductions)} "
            "('dp': average over data parallelism in step(); 'none': leave it to the caller)"
        )
    if not timeout > 0:
        raise ValueError(f"timeout={timeout} must be a positive number of seconds")
    if grad_reduction == "dp" and tp > 1:
        raise NotImplementedError(
            f"grad_reduction='dp' with tp={tp}: megapipe's reduction does not all-reduce "
            "sequence-parallel gradients over the tensor-parallel group; leave the reduction "
            "to the caller (grad_reduction='none', e.g. Megatron's DDP)"
        )


def check_grad_hooks(has_grad_hooks: bool, grad_reduction: str) -> None:
    """A step given ``grad_hooks`` reduces the gradients itself: the executor must not too."""
    if has_grad_hooks and grad_reduction != "none":
        raise ValueError(
            f"grad_hooks reduce the gradients themselves; the executor's grad_reduction="
            f"{grad_reduction!r} would reduce them again (build it with 'none')"
        )


def check_overlap_options(
    name: str, has_overlap: bool, delay_wgrad_compute: bool, a2a_waves: int
) -> None:
    """Options that only a combined schedule (OVERLAP actions) can use."""
    if not isinstance(a2a_waves, int) or a2a_waves < 1:
        raise ValueError(f"moe_a2a_waves={a2a_waves!r} must be an integer >= 1")
    if has_overlap:
        return
    if delay_wgrad_compute:
        raise ValueError(
            f"delay_wgrad_compute=True needs a combined schedule (OVERLAP actions; build it "
            f"with overlap=True): {name!r} has none, so no backward all-to-all "
            "would be in flight to hide the weight gradients behind"
        )
    if a2a_waves > 1:
        raise ValueError(
            f"moe_a2a_waves={a2a_waves} needs a combined schedule (OVERLAP actions; build it "
            f"with overlap=True): {name!r} runs its stages as plain autograd, with no stream to "
            "overlap the waves on"
        )


def check_stages(schedule: Schedule, pp_rank: int, stages: Mapping[int, nn.Module]) -> None:
    """The stages must be exactly those the schedule's placement gives ``pp_rank``."""
    expected = schedule.stages_of_rank(pp_rank)
    got = sorted(stages)
    if len(got) != len(expected):
        raise ValueError(
            f"rank {pp_rank}: the schedule {schedule.name!r} places "
            f"{len(expected)} chunk(s) on this rank (stages {expected}), got {len(got)} "
            f"(stages {got})"
        )
    if got != expected:
        raise ValueError(
            f"rank {pp_rank}: stages {got} do not match the placement of schedule "
            f"{schedule.name!r}, which puts stages {expected} on this rank "
            f"(stage_to_rank={list(schedule.stage_to_rank)})"
        )
    for stage, module in stages.items():
        if not isinstance(module, nn.Module):
            raise TypeError(f"stage {stage} must be an nn.Module, got {type(module).__name__}")


def check_inputs(
    schedule: Schedule,
    pp_rank: int,
    stages: Mapping[int, nn.Module],
    has_loss_fn: bool,
    microbatches: Sequence[Any] | None,
    targets: Sequence[Any] | None,
    forward_only: bool,
) -> None:
    """A step's inputs must cover the schedule's microbatches on first/last stages."""
    m = schedule.num_microbatches
    if not forward_only and not has_loss_fn and any(schedule.is_last_stage(s) for s in stages):
        raise ValueError(
            f"rank {pp_rank} holds a last stage: training needs loss_fn(output, target)"
        )
    needs_inputs = any(schedule.is_first_stage(s) for s in stages)
    needs_targets = any(schedule.is_last_stage(s) for s in stages)
    for name, values, needed in (
        ("microbatches", microbatches, needs_inputs),
        ("targets", targets, needs_targets and has_loss_fn),
    ):
        if not needed:
            continue
        if values is None:
            raise ValueError(
                f"rank {pp_rank} holds a {'first' if name == 'microbatches' else 'last'} "
                f"stage, so step() needs {name} (one per microbatch, {m} in all)"
            )
        if len(values) != m:
            raise ValueError(
                f"got {len(values)} {name} but the schedule {schedule.name!r} was built "
                f"for num_microbatches={m}; rebuild the schedule for {len(values)} microbatches"
            )


def check_graph_options(
    graphs: Any, stages: Mapping[int, nn.Module], lowered: Schedule, tape: bool
) -> None:
    """With CUDA graphs (``graphs.nodes``): a node holding a selected module is captured whole
    (``graphs.rules.coverage_problem``), and no plain-autograd step splits a backward into I and
    W (the generic split would run a captured node's backward twice)."""
    if graphs is None:
        return
    from megapipe.graphs.rules import coverage_problem, split_backward_problem
    from megapipe.overlap.plan import layer_graph
    from megapipe.pipeline.stage_module import is_stage_module

    holders = {
        node.graphable.modules
        for module in stages.values()
        if is_stage_module(module)
        for plan in module.layer_plans()
        for node in layer_graph(plan).nodes
        if node.graphable is not None
    }
    problem = coverage_problem(graphs.modules, holders, whole_model=False)
    if problem is not None:
        raise ValueError(problem)
    split = any(c.kind is Kind.I for row in lowered.actions for a in row for c in a.computations())
    problem = split_backward_problem(repr(lowered.name), split, tape)
    if problem is not None:
        raise ValueError(problem)
