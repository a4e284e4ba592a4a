"""What one step produced on a rank (``StepResult``), and the step in progress (``StepState``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megapipe.overlap.node_trace import NodeTrace
from megapipe.pipeline.grad_points import StepGradEvents
from megapipe.pipeline.step_profile import StepProfile
from megapipe.pipeline.transit import StepTensors


@dataclass
class StepResult:
    """What one step produced on this rank.

    - ``losses``: per-microbatch unscaled losses of this rank's last stages (detached);
    - ``outputs``: last-stage outputs when there is no ``loss_fn``;
    - ``peak_live_activations``: the most microbatches whose activations were held at once;
    - with ``record_trace=True`` and a combined schedule (OVERLAP actions): ``trace``, the
      ``NodeTrace`` of every node this rank ran on the streams (in a profiled step also its
      actions and pipeline waits, ``step_profile``); ``a2a_time``, the summed
      seconds of its comm nodes (the expert-parallel all-to-alls, including an emulated link's
      wait); ``compute_time``, the summed seconds of its compute nodes; and
      ``exposed_comm_fraction``, the share of ``a2a_time`` during which no compute node ran
      (0: all hidden, 1: none). They are None otherwise (no trace, or nothing ran on streams).
    - with ``measure_activations=True``: ``activation_bytes`` (peak bytes saved for backward or
      held by the pipeline) and on CUDA ``cuda_activation_bytes`` (``activation_meter``).
    - with CUDA graphs (``cuda_graph_impl="local"``): ``graph_instances`` captured so far and
      ``graph_bytes``, their private memory pools and static buffers (``graphs.nodes``).
    """

    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)  # what loss_fn returned beyond the loss
    peak_live_activations: int = 0
    trace: NodeTrace | None = None
    a2a_time: float | None = None
    compute_time: float | None = None
    exposed_comm_fraction: float | None = None
    activation_bytes: int | None = None  # measure_activations: peak bytes saved or held
    cuda_activation_bytes: int | None = None  # and on CUDA: the allocator's peak in the step
    graph_instances: int | None = None  # CUDA graphs on: instances captured so far
    graph_bytes: int | None = None  # and the bytes of their private pools and static buffers


@dataclass
class StepState:
    """One step in progress: its data in transit, the last stages' targets, the result."""

    tensors: StepTensors
    targets: Sequence[Any] | None
    forward_only: bool
    grads: StepGradEvents
    trace: NodeTrace | None = None  # the nodes' spans (``record_trace`` or a profiled step)
    result: StepResult = field(default_factory=StepResult)
    profile: StepProfile = field(default_factory=StepProfile)  # records nothing unless profiled
