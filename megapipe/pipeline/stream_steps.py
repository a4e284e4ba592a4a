"""Stage steps run node by node on the compute and communication streams.

In a combined schedule (one with OVERLAP actions) every training step of a ``StageModule``
runs here, through one entry: ``StreamSteps.run(forward=..., backward=...)`` takes the forward
half, the backward half, or both (an OVERLAP action), and in that order

1. takes the backward half's tape out of its worker's stash (``take_tape_backward``),
2. builds one ``CoScheduler`` with it,
3. runs the forward half's stage through that co-scheduler (``StageWorker.forward``): forward
   layer k beside backward layer N-1-k, comm nodes on the comm stream,
4. hands each half's result on as soon as it is made: the forward's output when the forward's
   last layer has run (``on_output``), the backward's input gradients, back through its worker
   (``finish_tape_backward``), when the backward's last node has run (``on_grad_input``), so
   the executor can send them before the pair's leftover work, and
5. lets the co-scheduler finish the backward layers that had no partner and the deferred
   weight gradients (``finish``).

So every comm node (every expert-parallel all-to-all) is issued from the one communication
stream, in the same order on every rank, and the results are bitwise those of the sequential
tape path (same operations on the same data). An I half (zero-bubble schedules pair F with I)
keeps its deferred weight gradients for the later W action, exactly as the sequential I does.
``delay_wgrad_compute`` (Megatron's flag) defers the expert weight gradients of a B too, and
the co-scheduler runs them on the compute stream while a backward all-to-all is in flight; each
B's queue is flushed before ``run`` returns, so gradients accumulate in the same order.

With ``a2a_chunks`` k > 1 every forward records its MoE layers with their all-to-alls in k
expert groups (``MoELayer.chunked_plan``): a layer with a partner walks them grouped (the same
four pairs), a layer without one, in a lone F or B step or left over in a pair, pipelines them
(one chunk's all-to-all beside another chunk's experts). Bitwise the same results.

Stages that are not ``StageModule``s cannot be split into nodes: the executor runs their OVERLAP
halves one after the other with plain autograd, warned once per module type
(``warn_if_not_node_protocol``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from megapipe.overlap.coscheduler import CoScheduler
from megapipe.overlap.plan import WarnOnce
from megapipe.overlap.node_trace import NodeTrace
from megapipe.overlap.streams import Streams, make_streams
from megapipe.overlap.wgrad import WeightGradQueue
from megapipe.pipeline.stage_worker import StageWorker


@dataclass
class ForwardHalf:
    """A forward step to run on the streams: ``worker``'s stage on ``stage_input``."""

    worker: StageWorker
    microbatch: int
    stage_input: Any


@dataclass
class BackwardHalf:
    """A backward step to run on the streams: B, or I (``keep_weight_grads``: the weight
    gradients wait for the W action). ``grad_output`` is None on a last stage (its loss)."""

    worker: StageWorker
    microbatch: int
    grad_output: torch.Tensor | None
    keep_weight_grads: bool = False


@dataclass
class HalvesDone:
    """What ``StreamSteps.run`` produced: the forward's output, the backward's input gradient."""

    output: torch.Tensor | None = None
    grad_input: torch.Tensor | None = None


class StreamSteps:
    """The streams, the optional node trace and the deferral flag of one executor."""

    def __init__(
        self,
        device: torch.device | str = "cpu",
        delay_wgrad_compute: bool = False,
        a2a_chunks: int = 1,
    ) -> None:
        self.device = torch.device(device)
        self.delay_wgrad_compute = delay_wgrad_compute
        self.a2a_chunks = a2a_chunks
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

    def warn_if_not_node_protocol(self, *workers: StageWorker) -> bool:
        """Whether every stage is a ``StageModule``; warns once per module type otherwise."""
        ok = True
        for worker in workers:
            if worker.can_tape:
                continue
            ok = False
            kind = type(worker.module)
            self._warn_once(
                kind,
                f"{kind.__name__} (stage {worker.stage}) does not follow the node protocol "
                "(not a StageModule: layer_plans(), node_runner, set_input_tensor, "
                "set_aux_loss_scale); its OVERLAP actions run forward then backward, without "
                "overlap",
            )
        return ok

    def run(
        self,
        forward: ForwardHalf | None = None,
        backward: BackwardHalf | None = None,
        *,
        on_output: Callable[[torch.Tensor], None] | None = None,
        on_grad_input: Callable[[torch.Tensor | None], None] | None = None,
    ) -> HalvesDone:
        """Run one forward half, one backward half, or both side by side (module docstring).

        ``on_output(output)`` is called as soon as the forward's last layer has run and
        ``on_grad_input(grad)`` as soon as the backward's last node has (early sends): both
        before the pair's leftover work (the other half's, the held weight gradients)."""
        work = None
        done = HalvesDone()
        if backward is not None:
            wgrad = WeightGradQueue(backward.worker.hold) if self.delay_wgrad_compute else None
            work = backward.worker.take_tape_backward(
                backward.microbatch, backward.grad_output, backward.keep_weight_grads, wgrad
            )

        def backward_done(grad_inputs: Any) -> None:
            assert backward is not None
            done.grad_input = backward.worker.finish_tape_backward(
                backward.microbatch, grad_inputs, work
            )
            if on_grad_input is not None:
                on_grad_input(done.grad_input)

        scheduler = CoScheduler(
            self.streams,
            work,
            trace=self.trace,
            fwd_microbatch=forward.microbatch if forward is not None else None,
            route_input_grads=forward.worker.routes_input_grads if forward is not None else False,
            on_backward_done=backward_done if backward is not None else None,
            a2a_chunks=self.a2a_chunks,
        )
        if forward is not None:
            try:
                done.output = forward.worker.forward(
                    forward.microbatch, forward.stage_input, runner=scheduler
                )
                if on_output is not None:
                    on_output(done.output)
            except BaseException:
                self._drain()
                raise
        scheduler.finish()
        return done

    def _drain(self) -> None:
        """After an error: let the comm stream finish what it runs before the tapes go away."""
        try:
            self.streams.comm.synchronize()
        except BaseException:  # the caller is already raising the first error
            pass
