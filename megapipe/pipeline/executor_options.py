"""How a ``PipelineExecutor`` runs: one frozen record of its options, each field documented.

The executor takes the schedule and this rank's stages, and this record for everything else:
what the stages send, the loss, the process groups, the gradient reduction, and the overlap's
and the measurements' options. A value no schedule can use is refused when the record is made
(``checks``), before any collective, naming itself and its rule; the options that depend on
the schedule are checked when the executor is built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megapipe.parallel.groups import ProcessGroups
from megapipe.pipeline.checks import check_executor_options
from megapipe.pipeline.p2p import SpecFn, TensorSpec
from megapipe.pipeline.stage_worker import ForwardFn, module_forward

LossFn = Callable[[torch.Tensor, Any], torch.Tensor]
"""``loss_fn(last_stage_output, target) -> scalar loss`` (unscaled)."""

GRAD_REDUCTIONS = ("dp", "none")


@dataclass(frozen=True)
class ExecutorOptions:
    """A ``PipelineExecutor``'s options (the defaults run a plain schedule on one rank)."""

    spec: TensorSpec | SpecFn | None = None
    """What each stage sends forward: one ``TensorSpec`` for every boundary, or a function
    ``spec(stage, microbatch)`` (variable sequence lengths); needed when stages talk across
    ranks."""
    loss_fn: LossFn | None = None
    """``loss_fn(output, target)``: the unscaled loss of a last stage (the executor scales it by
    1/num_microbatches); training needs it on the ranks holding a last stage."""
    groups: ProcessGroups | None = None
    """``create_groups``'s groups: the pipeline position, the PP group for p2p and the DP and
    expert-DP groups."""
    pp_group: dist.ProcessGroup | None = None
    """Without ``groups``, the pipeline's group (None: the default group)."""
    grad_reduction: str = "dp"
    """``"dp"`` averages gradients over data parallelism after each training step (dense over
    DP, experts over expert-DP; needs ``groups`` when dp > 1) and sums the two copies of an
    embedding tied across the first and last stage (``shared_embedding``); ``"none"`` leaves
    the accumulated gradients to the caller (e.g. Megatron's DDP and ``finalize_model_grads``)."""
    forward_fn: ForwardFn = module_forward
    """``forward_fn(module, input)`` replaces ``module(input)`` (the Megatron front end runs the
    user's forward_step_func through it)."""
    timeout: float = 300.0
    """Seconds that bound every wait for a peer."""
    use_tape: bool = False
    """Run ``StageModule`` stages on the tape in plain schedules too (same bits)."""
    delay_wgrad_compute: bool = False
    """Megatron's flag: defer the expert weight gradients into the backward all-to-alls' time
    (needs a combined schedule)."""
    moe_a2a_waves: int = 1
    """k > 1 records MoE layers with their all-to-alls in k expert groups (needs a combined
    schedule)."""
    record_trace: bool = False
    """Fill the timing fields of ``StepResult`` (the executor's ``record_trace`` starts from this
    and may be switched between steps)."""
    measure_activations: bool = False
    """Fill ``StepResult``'s activation bytes (``activation_meter``)."""
    cuda_graph_impl: str = "none"
    """``"local"`` with ``cuda_graph_modules`` replays the static nodes as CUDA graphs
    (``graphs.nodes``; without CUDA they run eager and the executor's ``cuda_graph_note`` says
    so)."""
    cuda_graph_modules: Sequence[str] = ()
    """Which static nodes ``cuda_graph_impl="local"`` captures (Megatron's flag's names)."""
    graph_api: Any = None
    """A stand-in for the CUDA graph calls (tests); None: torch's."""

    def __post_init__(self) -> None:
        tp = self.groups.config.tp if self.groups is not None else 1
        check_executor_options(self.spec, self.grad_reduction, GRAD_REDUCTIONS, self.timeout, tp)
