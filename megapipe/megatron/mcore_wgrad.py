"""Megatron's deferred weight gradients (``delay_wgrad_compute``), driven by megapipe.

With ``config.delay_wgrad_compute=True`` TransformerEngine's linear layers compute only the
input gradient in their backward and keep what the weight gradient needs; the weight gradient
is computed when the layer's ``backward_dw()`` is called, once per backward, in the same order
(TE's contract: a FIFO of pending backward passes per layer). Megatron's combined 1F1B calls
``backward_dw()`` of a layer's attention (and shared experts) after that layer's attention
node's backward and of its routed experts after the experts' node's backward. Nothing else
does: a layer whose ``backward_dw()`` is never called gets no weight gradient.

The adapter does the same: ``after_backward(state, work, inputs)`` passes a node's inputs
through an identity whose backward runs once the node's whole backward has run, and hands
``work`` (the node's ``backward_dw`` calls) to the queue where megapipe puts its own deferred
weight gradients (``LayerState.wgrad_queue``: in a combined step, run beside a backward
all-to-all; in zero-bubble schedules, in the W action), or runs it at once when there is no
queue. Megatron's local (non-TE) layers compute every weight gradient in their backward and
their ``backward_dw()`` does nothing, so with them the flag changes nothing.

``delayed_modules(chunk)`` finds the layers that follow TE's contract with deferral on (a
``wgrad_store`` whose ``delay_wgrad_compute()`` is true); ``check_driven`` refuses a chunk in
which such a layer sits outside every module the node plans drive, so no weight gradient is
ever left out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from megapipe.overlap.plan import LayerState

Work = Sequence[tuple[str, Callable[[], None]]]


class _AfterBackward(torch.autograd.Function):
    """Identity on a node's inputs; its backward queues (or runs) the node's weight work."""

    @staticmethod
    def forward(ctx, state: LayerState, work: Work, *tensors: torch.Tensor):
        ctx.state, ctx.work = state, work
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        queue = ctx.state.wgrad_queue
        for name, fn in ctx.work:
            if queue is None:
                fn()
            else:
                queue.put(fn, name=name)
        ctx.state, ctx.work = None, None
        return (None, None, *grads)


def after_backward(state: LayerState, work: Work, inputs: tuple) -> tuple:
    """``inputs``, with ``work`` queued once the backward of everything computed from them has
    run (see the module docstring). The tensors that need a gradient pass through the
    identity; at least one must, or the work could never be driven."""
    if not work or not torch.is_grad_enabled():
        return inputs
    positions = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions:
        raise RuntimeError(
            f"delayed weight gradients of {[name for name, _ in work]}: no input of their node "
            "needs a gradient, so nothing would call their backward_dw()"
        )
    passed = _AfterBackward.apply(state, tuple(work), *(inputs[i] for i in positions))
    passed = passed if isinstance(passed, tuple) else (passed,)
    out = list(inputs)
    for i, x in zip(positions, passed):
        out[i] = x
    return tuple(out)


def defers_wgrad(module: nn.Module) -> bool:
    """Whether ``module`` follows TE's contract with its weight gradient deferred."""
    store = getattr(module, "wgrad_store", None)
    delayed = getattr(store, "delay_wgrad_compute", None)
    return callable(getattr(module, "backward_dw", None)) and callable(delayed) and bool(delayed())


def delayed_modules(chunk: nn.Module) -> list[str]:
    """The names of the modules in ``chunk`` whose weight gradients wait for backward_dw()."""
    return [name for name, module in chunk.named_modules() if defers_wgrad(module)]


def check_driven(chunk: nn.Module, driven: Sequence[nn.Module]) -> None:
    """Every module of ``chunk`` that defers its weight gradient must sit inside one of the
    ``driven`` modules (whose ``backward_dw`` the node plans call)."""
    covered = {id(m) for root in driven for m in root.modules()}
    missing = [
        name for name, m in chunk.named_modules() if defers_wgrad(m) and id(m) not in covered
    ]
    if missing:
        raise NotImplementedError(
            f"delay_wgrad_compute: {', '.join(missing)} defer their weight gradients to "
            "backward_dw(), but no node of megapipe's Megatron-Core adapter calls it for them "
            "(only attention, MLP, experts, shared experts and the MTP projection are driven); "
            "set delay_wgrad_compute=False"
        )
