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

A chunk that implements only part of it (``layer_plans()`` without the rest, as an earlier
contract allowed: the executor used to set an ``aux_loss_scale`` attribute on its MoE modules)
is refused with one error naming what is missing (``check_stage_module``): run as a plain module
it would silently lose the 1/num_microbatches scale of its auxiliary-loss gradients.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol, TypeGuard, runtime_checkable

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


MEMBERS = ("layer_plans", "node_runner", "set_input_tensor", "set_aux_loss_scale")


def is_stage_module(module: nn.Module) -> TypeGuard[StageModule]:
    """Whether ``module`` implements the ``StageModule`` protocol."""
    return isinstance(module, StageModule)


def check_stage_module(module: nn.Module, stage: int) -> None:
    """Refuse a module that follows the protocol in part: it has ``layer_plans()`` (so it was
    written for the engine) but lacks another member (module docstring)."""
    if not hasattr(module, "layer_plans") or is_stage_module(module):
        return
    missing = [name for name in MEMBERS if not hasattr(module, name)]
    raise TypeError(
        f"stage {stage}: {type(module).__name__} has layer_plans() but is not a whole "
        f"StageModule: it lacks {', '.join(missing)} (megapipe.pipeline.stage_module). The "
        "engine no longer sets an aux_loss_scale attribute on MoE modules: implement "
        "set_aux_loss_scale(scale) (the engine calls it with 1/num_microbatches every step), a "
        "node_runner attribute (None) and set_input_tensor(tensor), or drop layer_plans() to "
        "run as a plain module without overlap"
    )


@contextmanager
def running_layers_with(module: StageModule, runner: NodeRunner) -> Iterator[None]:
    """Set ``module.node_runner`` to ``runner`` for the duration of one forward, then restore."""
    previous = module.node_runner
    module.node_runner = runner
    try:
        yield
    finally:
        module.node_runner = previous
