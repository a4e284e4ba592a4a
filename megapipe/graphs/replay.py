"""Replaying one captured instance (``graphs.instance``) as an autograd function.

``Replay.apply`` is what a captured node returns in place of its own outputs: its forward fills
the instance's static inputs and replays the forward graph on the current stream, its backward
fills the output gradients and replays the backward graph, so autograd (plain, the tape, the
combined step) drives a captured node as it drives an eager one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megapipe.graphs.instance import Lease
from megapipe.overlap.plan import LayerState

ParamsCall = Callable[[tuple[torch.Tensor, ...]], None]
ParamCall = Callable[[torch.Tensor], None]


class Replay(torch.autograd.Function):
    """Forward: fill the static inputs, replay, apply the state writes. Backward: fill the
    output gradients, replay, hand out the input gradients and those of the parameters whose
    gradients the graph did not add into ``main_grad`` itself."""

    @staticmethod
    def forward(
        ctx,
        lease: Lease,
        state: LayerState,
        logs: tuple,
        num_inputs: int,
        after_backward: Sequence[ParamCall],
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        instance = lease.instance
        instance.fill(state, tensors[:num_inputs])
        instance.api.replay(instance.fwd)
        for name, value in instance.writes.items():
            setattr(state, name, value)
        for (owner, name), values in zip(logs, instance.logged):
            log = getattr(owner, name)
            for value in values:
                log.record(value.clone())  # the buffer is written again by the next replay
        ctx.lease, ctx.after_backward = lease, after_backward
        ctx.set_materialize_grads(False)
        outputs = tuple(o.detach() for o in instance.outputs)
        ctx.mark_non_differentiable(
            *(o for o, s in zip(outputs, instance.outputs) if not s.requires_grad)
        )
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor | None):
        lease: Lease = ctx.lease
        instance = lease.instance
        if lease.backward_done:
            raise RuntimeError(
                "a captured node's backward ran twice on one forward (the "
                "generic I/W split of a plain zero-bubble schedule); its graph "
                "may have reused its saved activations: run such schedules with "
                "the overlap, or without CUDA graphs"
            )
        lease.backward_done = True
        instance.take_grads(grads)
        instance.api.replay(instance.bwd)
        lease.release()  # its saved activations are spent (a second backward is refused)
        for call in ctx.after_backward:
            for param in instance.accumulated:
                call(param)
        return (None, None, None, None, None, *instance.returned())
