"""What ``get_forward_backward_func`` was asked for, checked once when it is asked.

``FrontEndOptions`` holds the front end's keywords (its docstring says what each does; the
conventions of a call are ``forward_backward``'s module docstring) and refuses, with one line, a
value or a combination megapipe does not run: sizes, axes, groups that disagree with ``pp``,
CUDA graph settings, the options that exist in one overlap mode only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megapipe.graphs.rules import settings_problem
from megapipe.parallel.groups import ProcessGroups
from megapipe.schedule.registry import default_schedule_name


@dataclass(frozen=True)
class FrontEndOptions:
    """What ``get_forward_backward_func`` was asked for, checked once.

    ``pp``/``vpp``/``schedule`` pick the schedule; ``groups`` (from
    ``megapipe.parallel.create_groups``) give the pipeline, data- and expert-parallel groups,
    otherwise the default group is the pipeline. ``overlap`` (Megatron's
    ``overlap_moe_expert_parallel_comm=True``) picks the combined variant of the schedule: one
    microbatch's forward co-scheduled with another's backward, layer by layer, so the
    expert-parallel all-to-all hides behind compute. ``delay_wgrad_compute=True`` (needs the
    overlap) defers expert weight gradients into the time of a backward all-to-all. With
    ``record_trace=True`` each call's ``StepResult`` (``.last_result``) carries the node trace,
    ``a2a_time`` and ``exposed_comm_fraction``. ``microbatch_group_size_per_vp_stage`` and
    ``max_extra_in_flight`` go to ``build_schedule``. ``cuda_graph_impl="local"`` with
    ``cuda_graph_modules`` (Megatron's names, e.g. ``("attn", "moe_router", "moe_preprocess")``)
    replays megapipe's static GPT nodes as CUDA graphs (``megapipe.graphs.nodes``; on CPU the
    executor's ``cuda_graph_note`` says they run eager; Megatron-Core chunks are refused).
    ``overlap_auto`` (``overlap_moe_expert_parallel_comm="auto"``) times plain and combined
    training calls on this machine and keeps the faster (``megapipe.pipeline.overlap_auto``:
    every rank agrees, the numbers are those of either mode), timing again every
    ``overlap_auto_interval`` calls (0: once); each decision is printed on rank 0 as
    ``overlap auto: ...`` and kept in ``.overlap_auto_lines``; ``overlap_auto_clock`` reads the
    time (tests script it).
    """

    pp: int = 1
    vpp: int = 1
    schedule: str | None = None
    groups: ProcessGroups | None = None
    hidden_size: int | None = None
    axes: str | None = None  # None: "sbh" for Megatron-Core chunks, else "bsh"
    dtype: torch.dtype | None = None  # None: a Megatron-Core chunk's pipeline dtype, else fp32
    timeout: float = 300.0
    overlap: bool = False
    calculate_per_token_loss: bool = False
    reduce_grads: bool = True
    delay_wgrad_compute: bool = False
    record_trace: bool = False
    microbatch_group_size_per_vp_stage: int | None = None  # build_schedule's options
    max_extra_in_flight: int | None = None
    cuda_graph_impl: str = "none"
    cuda_graph_modules: tuple[str, ...] = ()
    overlap_auto: bool = False  # time plain and combined calls, keep the faster
    overlap_auto_interval: int = 500
    overlap_auto_clock: Callable[[], float] = time.perf_counter

    def __post_init__(self) -> None:
        for name, value in (("pp", self.pp), ("vpp", self.vpp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.axes not in (None, "bsh", "sbh"):
            raise ValueError(f"axes={self.axes!r} must be 'bsh' (batch first) or 'sbh' (Megatron)")
        if self.groups is not None and self.groups.config.pp != self.pp:
            raise ValueError(
                f"pp={self.pp} does not match the process groups' pp={self.groups.config.pp}"
            )
        problem = settings_problem(self.cuda_graph_impl, self.cuda_graph_modules)
        if problem is not None:
            raise ValueError(problem)
        if self.delay_wgrad_compute and not self.overlap:
            raise ValueError(
                "delay_wgrad_compute=True needs overlap_moe_expert_parallel_comm=True (Megatron's "
                "rule: the deferred weight gradients fill the time of the overlapped all-to-all)"
            )
        combined_only = [
            name
            for name, on in (
                ("delay_wgrad_compute=True", self.delay_wgrad_compute),
                (
                    f"max_extra_in_flight={self.max_extra_in_flight}",
                    self.max_extra_in_flight is not None,
                ),
            )
            if on
        ]
        if self.overlap_auto and combined_only:
            raise ValueError(
                f"overlap_moe_expert_parallel_comm='auto' with {combined_only[0]}: auto chooses "
                "between the plain and the combined step, which must differ in nothing else"
            )

    @property
    def schedule_name(self) -> str:
        return self.schedule or default_schedule_name(self.pp, self.vpp)


def overlap_modes(overlap: bool, overlap_moe_expert_parallel_comm: bool | str) -> tuple[bool, bool]:
    """(overlap on, auto mode) from ``overlap`` and Megatron's flag (True, False or "auto")."""
    auto = overlap_moe_expert_parallel_comm == "auto"
    if not isinstance(overlap_moe_expert_parallel_comm, bool) and not auto:
        raise ValueError(
            f"overlap_moe_expert_parallel_comm={overlap_moe_expert_parallel_comm!r} "
            "must be True, False or 'auto'"
        )
    return overlap or bool(overlap_moe_expert_parallel_comm), auto
