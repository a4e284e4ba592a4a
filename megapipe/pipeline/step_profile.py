"""What a profiled step records besides the nodes: each compute action and each pipeline wait.

A training step of the executor normally records (with ``record_trace``) only the nodes the
combined step ran on the two streams (``NodeTrace``). A *profiled* step (``executor.step(...,
profile=ProfileOptions())``, used by ``--profile-trace``) adds to the same trace, on the compute
stream's clock:

- one span per compute action of the rank's schedule (kind ``"action"``, direction: the
  action's kind, ``F``, ``B``, ``I``, ``W`` or ``OVERLAP_F_B``): its ``node`` is the action's
  text (``2F3``, ``(0F5;3B1)OVERLAP_F_B``), which ``parse_action`` reads back, so the nodes
  inside it can be given their stage;
- one span per wait for a pipeline receive (kind ``"wait"``): its ``node`` is the text of the
  receive (``2RECV_F3``); on CPU the host blocks there, on CUDA the compute stream does (the
  marks around the wait are stream-ordered).

Spans share the node trace so that on CUDA all of them are placed on the host clock through the
same origin. Outside profiled steps none of this runs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from megapipe.overlap.cuda_streams import CudaStream
from megapipe.overlap.node_trace import NodeTrace
from megapipe.overlap.streams import Stream
from megapipe.schedule.ir import Action, Kind

ACTION = "action"
WAIT = "wait"
NODE_KINDS = ("compute", "comm")


@dataclass(frozen=True)
class ProfileOptions:
    """A profiled step. ``annotate``: every span also opens a ``torch.profiler`` range."""

    annotate: bool = False


class StepProfile:
    """Records a step's action and wait spans into ``trace`` (does nothing without one)."""

    def __init__(self, trace: NodeTrace | None = None, stream: Stream | str = "compute") -> None:
        self.trace = trace
        self.stream = stream

    @property
    def wait_span(self) -> Any:
        """``wait`` when recording (``StepTensors.wait_span``), else None."""
        return None if self.trace is None else self.wait

    def action(self, action: Action) -> AbstractContextManager:
        """Time one compute action (a ``with`` block around running it)."""
        if self.trace is None:
            return nullcontext()
        return self.trace.span(
            action.microbatch, -1, str(action), action.kind.value, self.stream, ACTION
        )

    def wait(self, kind: Kind, stage: int, microbatch: int) -> AbstractContextManager:
        """Time the wait for the receive ``kind`` (RECV_F or RECV_B) of (stage, microbatch)."""
        if self.trace is None:
            return nullcontext()
        receive = str(Action(stage, kind, microbatch))
        direction = "F" if kind is Kind.RECV_F else "B"
        return self.trace.span(microbatch, -1, receive, direction, self.stream, WAIT)


def open_step(
    record: bool,
    profile: ProfileOptions | None,
    forward_only: bool,
    streams: Any,
    device: torch.device | None,
) -> tuple[NodeTrace | None, StepProfile]:
    """The ``NodeTrace`` of one step (when tracing or profiling a training step, else None) and
    its ``StepProfile`` (recording only when profiled). Action spans are timed on the compute
    stream of ``streams`` (the executor's, in a combined schedule) when it has one, else on the
    device's current CUDA stream, else on the host clock (CPU)."""
    if forward_only or not (record or profile is not None):
        return None, StepProfile()
    trace = NodeTrace(annotate=profile is not None and profile.annotate)
    if profile is None:
        return trace, StepProfile()
    stream: Stream | str = "compute" if streams is None else streams.compute
    if streams is None and device is not None and device.type == "cuda":
        stream = CudaStream("compute", device, stream=torch.cuda.current_stream(device))
    return trace, StepProfile(trace, stream)


def take_trace(result: Any, trace: NodeTrace) -> None:
    """Fill a ``StepResult``'s trace fields from the step's trace: ``trace`` when it holds any
    span, the node timings (``a2a_time``, ``compute_time``, ``exposed_comm_fraction``) when the
    combined step recorded any node (a plain schedule's profiled step has only actions)."""
    spans = trace.spans
    if spans:
        result.trace = trace
    if any(span.kind in NODE_KINDS for span in spans):
        result.a2a_time = trace.total("comm")
        result.compute_time = trace.total("compute")
        result.exposed_comm_fraction = trace.exposed_comm_fraction()
