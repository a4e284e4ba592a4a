"""The executor's side of the combined step: stage steps run node by node on two streams.

When a schedule holds OVERLAP actions, ``CombinedSteps`` runs every training step of a stage
that follows the node protocol through a ``CombinedRunner``: an OVERLAP action as a real
combined step (forward layer k of one microbatch beside backward layer N-1-k of the other), and
a lone F, B or I as a runner with one side only. So every comm node (every expert-parallel
all-to-all) is issued from the one communication stream, in the same order on every rank, and
the results are bitwise those of the sequential tape path (same operations on the same data).

Stages without ``layer_plans()`` cannot be split into nodes: their OVERLAP runs F then B with
plain autograd, with a warning (once per module type) naming the type.

An I half (zero-bubble schedules pair F with I) runs its backward through the runner with the
weight gradients of the deferrable ops queued and kept for the later W action, exactly as the
sequential I does. ``delay_wgrad_compute`` (Megatron's flag) queues the expert weight gradients
of a B too, and the runner runs them on the compute stream while a backward all-to-all is in
flight; each B's queue is flushed before the step returns, so gradients accumulate in the same
order as without it.
"""

from __future__ import annotations

from typing import Any

import torch

from megapipe.overlap.coscheduler import CombinedRunner, WarnOnce
from megapipe.overlap.streams import Streams, make_streams
from megapipe.overlap.trace import NodeTrace
from megapipe.overlap.wgrad import WeightGradQueue
from megapipe.runtime.steps import StageWorker
from megapipe.schedule.ir import Action, Kind


class CombinedSteps:
    """Streams, the optional trace and the deferral flag of one executor (see module doc)."""

    def __init__(self, device: torch.device | str = "cpu", delay_wgrad_compute: bool = False) -> None:
        self.device = torch.device(device)
        self.delay_wgrad_compute = delay_wgrad_compute
        self.trace: NodeTrace | None = None  # set per step by the executor when tracing
        self._streams: Streams | None = None
        self._warn_once = WarnOnce()

    @property
    def streams(self) -> Streams:
        """The compute and communication streams, made on first use and reused until close."""
        if self._streams is None:
            self._streams = make_streams(self.device)
        return self._streams

    def close(self) -> None:
        if self._streams is not None:
            self._streams.close()
            self._streams = None

    # ------------------------------------------------------------------ helpers
    def can_combine(self, *workers: StageWorker) -> bool:
        """Whether these stages follow the node protocol; warns once per type otherwise."""
        ok = True
        for worker in workers:
            if worker.can_tape:
                continue
            ok = False
            kind = type(worker.module)
            self._warn_once(
                kind,
                f"{kind.__name__} (stage {worker.stage}) does not follow the node protocol "
                "(no layer_plans() of Node lists, or no node_runner for a custom forward_fn); "
                "its OVERLAP actions run forward then backward, without overlap",
            )
        return ok

    def _runner(
        self,
        forward: tuple[StageWorker, Action] | None,
        backward: tuple[StageWorker, Action, Any, Any] | None,
    ) -> tuple[CombinedRunner, WeightGradQueue | None]:
        bwd_tape = bwd_grads = None
        wgrad: WeightGradQueue | None = None
        keep = False
        bwd_microbatch = None
        if backward is not None:
            _, action, bwd_tape, bwd_grads = backward
            bwd_microbatch = action.microbatch
            if action.kind is Kind.I:
                wgrad, keep = WeightGradQueue(), True
            elif self.delay_wgrad_compute:
                wgrad = WeightGradQueue()
        route = forward[0].routes_input_grads if forward is not None else False
        runner = CombinedRunner(
            self.streams,
            bwd_tape,
            bwd_grads,
            wgrad=wgrad,
            trace=self.trace,
            fwd_microbatch=forward[1].microbatch if forward is not None else None,
            bwd_microbatch=bwd_microbatch,
            route_input_grads=route,
            run_wgrad=not keep,
        )
        return runner, (wgrad if keep else None)

    def _drain(self) -> None:
        """After an error: let the comm stream finish what it runs before the tapes go away."""
        try:
            self.streams.comm.synchronize()
        except BaseException:  # the caller is already raising the first error
            pass

    # ------------------------------------------------------------------ steps
    def forward(self, worker: StageWorker, action: Action, stage_input: Any) -> torch.Tensor:
        """A lone F on the streams (its comm nodes on the comm stream)."""
        runner, _ = self._runner((worker, action), None)
        try:
            output = worker.forward(action.microbatch, stage_input, runner=runner)
        except BaseException:
            self._drain()
            raise
        runner.finish()
        return output

    def backward(
        self, worker: StageWorker, action: Action, grad_output: torch.Tensor | None
    ) -> torch.Tensor | None:
        """A lone B or I on the streams; returns the stage's input gradient."""
        tape, grads = worker.backward_tape(action.microbatch, grad_output, action.kind.value)
        runner, kept = self._runner(None, (worker, action, tape, grads))
        grad_inputs = runner.finish()
        return worker.end_backward(action.microbatch, grad_inputs, kept)

    def combined(
        self,
        fwd: tuple[StageWorker, Action, Any],
        bwd: tuple[StageWorker, Action, torch.Tensor | None],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An OVERLAP action: ``fwd = (worker, F action, stage input)`` beside
        ``bwd = (worker, B or I action, output gradient)``. Returns (forward output, input
        gradient of the backward's stage)."""
        f_worker, f_action, stage_input = fwd
        b_worker, b_action, grad_output = bwd
        tape, grads = b_worker.backward_tape(
            b_action.microbatch, grad_output, b_action.kind.value
        )
        runner, kept = self._runner((f_worker, f_action), (b_worker, b_action, tape, grads))
        try:
            output = f_worker.forward(f_action.microbatch, stage_input, runner=runner)
        except BaseException:
            self._drain()
            raise
        grad_inputs = runner.finish()
        return output, b_worker.end_backward(b_action.microbatch, grad_inputs, kept)
