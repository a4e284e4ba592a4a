"""The ``StageModule`` protocol: what the engine asks of a model chunk (one pipeline stage).

Any ``nn.Module`` can be a stage: the engine runs it with plain autograd (and splits its
backward into I and W generically). A chunk that also implements ``StageModule`` runs node by
node, so its all-to-alls overlap another microbatch's compute in combined schedules:

- ``layer_plans()``: the node plans of the chunk's layers in execution order (a list of
  ``megapipe.overlap.Node`` lists; see ``megapipe.overlap.plan``).
- ``node_runner``: None, or a runner the engine sets around a forward it drives through a
  user's forward function (Megatron's ``forward_step_func``); while it is set, ``forward``
  must run every layer plan through ``node_runner.run_layer(plan, values)``.
- ``set_input_tensor(tensor)``: Megatron's convention: a chunk after the first computes on this
  received activation instead of its ``forward`` argument (None clears it).
- ``set_aux_loss_scale(scale)``: the factor applied to the gradient of the chunk's MoE
  auxiliary losses; the engine sets ``1 / num_microbatches`` before each step, so the
  auxiliary losses are averaged over microbatches like the main loss.

``megapipe.models.GPTStage`` implements it; so does the Megatron-Core adapter.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from megapipe.overlap.plan import Node, NodeRunner


@runtime_checkable
class StageModule(Protocol):
    """A model chunk the engine can run node by node (see the module docstring)."""

    node_runner: NodeRunner | None

    def layer_plans(self) -> Sequence[Sequence[Node]]: ...

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None: ...

    def set_aux_loss_scale(self, scale: float) -> None: ...


def is_stage_module(module: nn.Module) -> bool:
    """Whether ``module`` implements the ``StageModule`` protocol."""
    return isinstance(module, StageModule)


@contextmanager
def running_layers_with(module: StageModule, runner: NodeRunner) -> Iterator[None]:
    """Set ``module.node_runner`` to ``runner`` for the duration of one forward, then restore."""
    previous = module.node_runner
    module.node_runner = runner
    try:
        yield
    finally:
        module.node_runner = previous
