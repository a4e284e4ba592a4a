"""Full recompute of Megatron-Core layers, node by node, beside the overlap.

Megatron's ``recompute_granularity='full'`` checkpoints whole layers, all-to-alls included,
and Megatron's own overlap refuses it. megapipe recomputes each compute node of a layer inside
that node's backward and never re-runs the dispatch or combine (``recompute.full``).
Which layers: Megatron's choice (``recompute_method='uniform'``: every layer, and the MTP
layers; ``'block'``: the first ``recompute_num_layers`` layers of each chunk). The numbers are
Megatron's: recompute re-runs the same operations on the same inputs.

A Megatron node re-run must not disturb what Megatron keeps on its modules, because the re-run
happens in a backward, possibly beside another microbatch's forward of the same layer:

- The token dispatcher keeps one microbatch's routing metadata on itself between the nodes of
  a forward (and clears some of it once used). ``DispatcherSwitch`` stands in for
  ``MoELayer.token_dispatcher`` and gives each microbatch its own copy while its nodes run,
  per thread, so a re-run on the compute stream and another microbatch's combine on the comm
  stream each see their own; a re-run starts from a copy of the dispatcher as the node's first
  run found it.
- The router counts tokens (expert bias, global aux loss) and logs its losses as side effects
  of a forward. A recompute sees the router buffers as the first forward saw them and leaves both
  the buffers and the MoE metrics as it found them, so nothing is counted twice.
"""

from __future__ import annotations

import contextvars
import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from megapipe.megatron.mcore_layers import McoreLayerState
from megapipe.megatron.mcore_release import McoreRelease
from megapipe.overlap.plan import Node, NodeKind, Plan
from megapipe.recompute.full import recompute_plan


class DispatcherSwitch:
    """``MoELayer.token_dispatcher`` that forwards to the dispatcher chosen for the current
    node (``using``), else to the layer's own."""

    def __init__(self, original: Any) -> None:
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_current", contextvars.ContextVar("dispatcher", default=None))

    def _target(self) -> Any:
        return self._current.get() or self._original

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target(), name, value)

    def fresh(self) -> Any:
        """A copy of the layer's own dispatcher for one microbatch."""
        return copy.copy(self._original)

    @contextmanager
    def using(self, dispatcher: Any) -> Iterator[None]:
        token = self._current.set(dispatcher)
        try:
            yield
        finally:
            self._current.reset(token)


def dispatcher_switch(moe: Any) -> DispatcherSwitch:
    """The layer's ``DispatcherSwitch``, installed on first use."""
    if not isinstance(moe.token_dispatcher, DispatcherSwitch):
        moe.token_dispatcher = DispatcherSwitch(moe.token_dispatcher)
    return moe.token_dispatcher


def recomputed_layers(config: Any, num_layers: int) -> range:
    """The decoder layers of a chunk Megatron's full recompute checkpoints."""
    if config.recompute_granularity != "full":
        return range(0)
    if config.recompute_method == "block":
        return range(min(config.recompute_num_layers or 0, num_layers))
    return range(num_layers)


def recompute_mtp(config: Any) -> bool:
    """Megatron recomputes MTP layers under uniform full recompute only."""
    return config.recompute_granularity == "full" and config.recompute_method == "uniform"


def recompute_layer(
    plan: Plan, layer: Any, release: McoreRelease, params: Sequence[torch.Tensor]
) -> Plan:
    """``plan`` (one layer's nodes, ``mcore_layers.layer_plan``) recomputed node by node, its
    re-runs guarded (module docstring; what they keep is in the layer's ``McoreLayerState``).
    ``layer``: the ``TransformerLayer`` (its MoE part, if any, is guarded); ``params``: every
    parameter the nodes may use."""
    moe = getattr(layer, "mlp", None)
    router = getattr(moe, "router", None) if moe is not None else None
    switch = dispatcher_switch(moe) if router is not None else None
    buffers = list(router.buffers()) if router is not None else []

    def guarded(node: Node) -> Node:
        def fn(state: McoreLayerState, inputs: tuple) -> tuple:
            if switch is None:
                return node.fn(state, inputs)
            if state.dispatcher is None:
                state.dispatcher = switch.fresh()
            if node.kind != NodeKind.COMPUTE:  # never re-run: the microbatch's dispatcher
                with switch.using(state.dispatcher):
                    return node.fn(state, inputs)
            if not state.recomputing:  # a recompute starts from the dispatcher the forward found
                state.dispatcher_at[node.name] = copy.copy(state.dispatcher)
                dispatcher = state.dispatcher
            else:
                dispatcher = copy.copy(state.dispatcher_at[node.name])
            with switch.using(dispatcher), _first_forward_view(state, node.name, buffers, release):
                return node.fn(state, inputs)

        return replace(node, fn=fn)

    return plan.wrapped(lambda nodes: recompute_plan([guarded(node) for node in nodes], params))


@contextmanager
def _first_forward_view(
    state: McoreLayerState, key: str, buffers: list[torch.Tensor], release: McoreRelease
) -> Iterator[None]:
    """The first forward records the buffers it starts from; a recompute starts from those and
    leaves the buffers and the MoE metrics as it found them."""
    saved = state.buffers_at_first_forward
    if not state.recomputing:
        saved[key] = [b.detach().clone() for b in buffers]
        yield
        return
    current = [b.detach().clone() for b in buffers]
    metrics = {name: values.clone() for name, values in release.moe_metric_values().items()}
    with torch.no_grad():
        for buffer, first in zip(buffers, saved[key]):
            buffer.copy_(first)
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, current):
                buffer.copy_(value)
            for name, values in release.moe_metric_values().items():
                if name in metrics:
                    values.copy_(metrics[name])
                else:
                    values.zero_()
