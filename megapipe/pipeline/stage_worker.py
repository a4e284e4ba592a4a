"""Forward and backward actions of one pipeline stage, one microbatch at a time.

``StageWorker`` owns a stage's stash: for every microbatch between its forward and its last
backward action, the tensors that backward needs. Nothing else is kept, so the stash size is the
number of live activations, which the executor reports and the tests bound.

Two ways to run a stage, performing the same operations (so results are bitwise equal):

- *plain autograd* (``forward``, then ``backward`` = B, or ``backward_input`` = I and
  ``backward_weight`` = W): for any ``nn.Module``; the I/W split defers every weight gradient
  generically (``split_backward``);
- *node by node on a tape* (a ``StageModule``, ``megapipe.pipeline.stage_module``): the
  forward is recorded through a node runner (``forward(..., runner=...)``; a ``TapeRunner``
  alone, or a ``CombinedStep`` beside another microbatch's backward), and the backward is taken
  out of the stash with ``backward_half`` and given back with ``end_backward`` around a
  combined step's walk. Its I defers only the weight gradients of the ops that support it
  (``WeightGradQueue``: the experts' grouped matmuls).

``runs_on_tape`` says which training actions of a combined schedule take the second way, as
one combined step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from megapipe.graphs.nodes import NodeGraphs
from megapipe.overlap.combined import BackwardHalf
from megapipe.overlap.plan import NodeRunner, Track, WarnOnce
from megapipe.overlap.sequential import TapeRunner, run_backward
from megapipe.overlap.tape import Tape
from megapipe.overlap.wgrad import WeightGradQueue
from megapipe.pipeline.split_backward import DeferredWeightGrad, input_backward
from megapipe.pipeline.stage_module import (
    StageModule,
    check_stage_module,
    is_stage_module,
    running_layers_with,
)
from megapipe.schedule.actions import plain_key
from megapipe.schedule.ir import Action, Kind

ForwardFn = Callable[[nn.Module, Any], torch.Tensor]
"""``forward_fn(module, stage_input) -> output``: how a stage computes one microbatch."""


def module_forward(module: nn.Module, stage_input: Any) -> torch.Tensor:
    """The default forward: call the module on its input."""
    return module(stage_input)


@dataclass
class _Entry:
    inputs: list[torch.Tensor] = field(default_factory=list)  # leaves whose grad goes upstream
    outputs: list[torch.Tensor] = field(default_factory=list)  # output, or the scaled loss
    tape: Tape | None = None
    loss: torch.Tensor | None = None  # last stage: the scaled loss backward starts from
    deferred: DeferredWeightGrad | WeightGradQueue | None = None


class StageWorker:
    """Runs one stage's forward and backward actions and keeps its per-microbatch stash.

    ``use_tape`` runs every training forward of a ``StageModule`` on the tape even without a
    combined step (both paths perform the same operations; the tape costs one autograd call per
    node). ``track`` (set by the executor for a measured step) is told of every tensor the stage
    keeps for a later step: its output, the scaled loss, the tape's node-boundary tensors and
    what deferred weight gradients keep (``activation_meter``; its input is tracked where it
    arrives, ``p2p``).
    """

    def __init__(
        self,
        stage: int,
        module: nn.Module,
        forward_fn: ForwardFn = module_forward,
        use_tape: bool = False,
        graphs: NodeGraphs | None = None,
    ) -> None:
        self.stage = stage
        self.module = module
        self.forward_fn = forward_fn
        check_stage_module(module, stage)
        self.can_tape = is_stage_module(module)
        # CUDA graphs of the static nodes (``graphs.nodes``): a StageModule's training
        # forwards run the captured form of its plans, whatever runs them
        self.graphs = graphs if self.can_tape else None
        if use_tape and not self.can_tape:
            raise ValueError(
                f"stage {stage}: use_tape=True needs a StageModule (layer_plans(), node_runner, "
                f"set_input_tensor, set_aux_loss_scale); {type(module).__name__} is not one"
            )
        self.use_tape = use_tape
        self.track: Track | None = None
        self._stash: dict[int, _Entry] = {}

    @property
    def live_activations(self) -> int:
        """Microbatches whose activations are held (forward done, last backward action not yet)."""
        return len(self._stash)

    def has_tape(self, microbatch: int) -> bool:
        """Whether the stored forward of ``microbatch`` was recorded on the tape."""
        entry = self._stash.get(microbatch)
        return entry is not None and entry.tape is not None

    def _stage_module(self) -> StageModule:
        """The module, which runs node by node: only a StageModule does (``forward`` refuses a
        runner for any other module)."""
        assert self.can_tape
        return cast(StageModule, self.module)

    def params(self) -> list[torch.Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]

    @property
    def routes_input_grads(self) -> bool:
        """Whether this stage's tapes route input gradients on into the input (a custom
        forward_fn may transform its input before the first layer) or only return them."""
        return self.forward_fn is not module_forward

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        microbatch: int,
        stage_input: Any,
        keep_graph: bool = True,
        runner: NodeRunner | None = None,
    ) -> torch.Tensor:
        """Run the stage on ``stage_input``; with ``keep_graph`` stash what backward needs.

        A floating-point tensor input (a received activation) becomes a leaf that requires
        grad, so backward can return its gradient; other inputs (token ids) pass unchanged.
        ``runner`` (a ``CombinedStep``) records the forward layer by layer: driven here, each
        of ``layer_plans()`` through ``runner.run_layer``, or by the module's own forward
        through its ``node_runner`` for a custom ``forward_fn``. Without a runner the forward
        runs on a tape of its own when ``use_tape`` is set, else with plain autograd. With
        ``graphs`` the captured form of each plan runs (``graphs.nodes.GraphRunner``).
        """
        if microbatch in self._stash:
            raise RuntimeError(
                f"stage {self.stage}: forward of microbatch {microbatch} ran twice without a "
                "backward"
            )
        if not keep_graph:
            with torch.no_grad():
                return self.forward_fn(self.module, stage_input)
        leaves: list[torch.Tensor] = []
        if isinstance(stage_input, torch.Tensor) and stage_input.is_floating_point():
            stage_input = stage_input.detach().requires_grad_(True)
            leaves.append(stage_input)
        if runner is not None and not self.can_tape:
            raise ValueError(
                f"stage {self.stage}: {type(self.module).__name__} cannot run node by node "
                "(it is not a StageModule)"
            )
        if runner is None and self.use_tape:
            runner = TapeRunner(self.track, route_input_grads=self.routes_input_grads)
        if self.graphs is not None:  # the captured form of each plan, through the runner
            runner = self.graphs.runner(runner)
        tape: Tape | None = None
        if runner is None:
            output = self.forward_fn(self.module, stage_input)
        elif self.forward_fn is module_forward:
            values: tuple[Any, ...] = (stage_input,)
            for plan in self._stage_module().layer_plans():
                values = runner.run_layer(plan, values)
            # a recording runner (TapeRunner, CombinedStep) has a tape
            output, tape = values[0], runner.tape  # type: ignore[attr-defined]
        else:
            with running_layers_with(self._stage_module(), runner):
                output = self.forward_fn(self.module, stage_input)
            # a recording runner (TapeRunner, CombinedStep) has a tape
            tape = runner.tape  # type: ignore[attr-defined]
        self._tracked([output])
        self._stash[microbatch] = _Entry(inputs=leaves, outputs=[output], tape=tape)
        return output

    def _tracked(self, values: list[Any]) -> None:
        if self.track is not None:
            self.track(values)

    def attach_loss(self, microbatch: int, scaled_loss: torch.Tensor) -> None:
        """On a last stage: backward starts from ``scaled_loss`` instead of the output."""
        self._entry(microbatch, "attach a loss to").loss = scaled_loss
        self._tracked([scaled_loss])

    # ------------------------------------------------------------------ backward
    def _output_grads(self, entry: _Entry, grad_output: torch.Tensor | None) -> list[torch.Tensor]:
        """The gradient of the stage output: given, or (last stage) from the scaled loss."""
        if grad_output is not None:
            return [grad_output]
        if entry.loss is None:
            raise RuntimeError(
                f"stage {self.stage}: backward without an output gradient needs a loss "
                "(only a last stage starts backward from its loss)"
            )
        return list(torch.autograd.grad(entry.loss, entry.outputs))

    def backward(self, microbatch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """B: accumulate parameter gradients and return the input gradient (None on stage 0)."""
        entry = self._entry(microbatch, "B")
        if entry.tape is not None:
            half = self.backward_half(microbatch, grad_output, keep_weight_grads=False)
            return self.end_backward(microbatch, run_backward(half.tape, half.grads))
        del self._stash[microbatch]
        if grad_output is None and entry.loss is not None:
            torch.autograd.backward([entry.loss])
        else:
            torch.autograd.backward(entry.outputs, self._output_grads(entry, grad_output))
        return entry.inputs[0].grad if entry.inputs else None

    def backward_input(
        self, microbatch: int, grad_output: torch.Tensor | None
    ) -> torch.Tensor | None:
        """I: return the input gradient now; keep what the weight gradient needs for W."""
        entry = self._entry(microbatch, "I")
        if entry.tape is not None:
            half = self.backward_half(microbatch, grad_output, keep_weight_grads=True)
            grad_inputs: Sequence[torch.Tensor | None] = run_backward(
                half.tape, half.grads, wgrad=half.wgrad
            )
            return self.end_backward(microbatch, grad_inputs, half)
        if entry.deferred is not None:
            raise RuntimeError(f"stage {self.stage}: I of microbatch {microbatch} ran twice")
        if grad_output is None and entry.loss is not None:
            outputs, grads = [entry.loss], [torch.ones_like(entry.loss)]
        else:
            outputs, grads = entry.outputs, self._output_grads(entry, grad_output)
        grad_inputs, entry.deferred = input_backward(outputs, grads, entry.inputs, self.params())
        self._tracked(entry.deferred.tensors())
        leaves = entry.inputs
        entry.outputs, entry.inputs, entry.loss = [], [], None
        return grad_inputs[0] if leaves else None

    def backward_half(
        self,
        microbatch: int,
        grad_output: torch.Tensor | None,
        keep_weight_grads: bool,
        wgrad: WeightGradQueue | None = None,
    ) -> BackwardHalf:
        """The first half of a backward on the tape (B, or I with ``keep_weight_grads``): the
        microbatch's tape with the gradients of its outputs, for a ``CombinedStep`` or
        ``run_backward``; then call ``end_backward``. An I always defers into a queue kept for
        its W; a B defers into ``wgrad`` when given (``delay_wgrad_compute``)."""
        what = "I" if keep_weight_grads else "B"
        entry = self._entry(microbatch, what)
        if entry.tape is None:
            raise RuntimeError(
                f"stage {self.stage}: {what} of microbatch {microbatch} needs its forward on the "
                "tape, but it ran with plain autograd"
            )
        if entry.deferred is not None:
            raise RuntimeError(f"stage {self.stage}: backward of microbatch {microbatch} ran twice")
        grads = self._output_grads(entry, grad_output)
        entry.outputs = []
        if keep_weight_grads:
            wgrad = WeightGradQueue(self.track)
        return BackwardHalf(entry.tape, grads, microbatch, wgrad, run_wgrad=not keep_weight_grads)

    def end_backward(
        self, microbatch: int, grad_inputs: Any, half: BackwardHalf | None = None
    ) -> torch.Tensor | None:
        """The second half: a B frees the stash entry; an I (``half`` with queued weight
        gradients it must not run) keeps them for its W. Returns the stage's input gradient."""
        entry = self._entry(microbatch, "the end of a backward")
        if half is None or half.run_wgrad:
            del self._stash[microbatch]
        else:
            entry.deferred, entry.tape, entry.loss = half.wgrad, None, None
        return self._tape_input_grad(entry, grad_inputs)

    def backward_weight(self, microbatch: int) -> None:
        """W: accumulate the parameter gradients deferred by I and free the stash entry."""
        entry = self._stash.get(microbatch)
        if entry is None or entry.deferred is None:
            raise self._missing(microbatch, "W (after its I)")
        del self._stash[microbatch]
        entry.deferred.run()

    def _tape_input_grad(self, entry: _Entry, grad_inputs: Any) -> torch.Tensor | None:
        if not entry.inputs:
            return None
        leaf = entry.inputs[0]
        if leaf.grad is not None:  # a runner routes the gradient into the input leaf
            return leaf.grad
        return grad_inputs[0] if grad_inputs else None

    def _entry(self, microbatch: int, what: str) -> _Entry:
        entry = self._stash.get(microbatch)
        if entry is None:
            raise self._missing(microbatch, what)
        return entry

    def _missing(self, microbatch: int, what: str) -> RuntimeError:
        return RuntimeError(
            f"stage {self.stage}: {what} of microbatch {microbatch} has no stored forward "
            "(the schedule runs a backward before its forward, or twice)"
        )

    def clear(self) -> None:
        """Drop every stashed activation (after an error, or at the end of forward-only)."""
        self._stash.clear()


def runs_on_tape(action: Action, workers: Mapping[int, StageWorker], warn_once: WarnOnce) -> bool:
    """Whether a training action of a combined schedule runs node by node on the tape, as one
    combined step: its stages are ``StageModule``s (an OVERLAP of other modules runs F then B,
    warned once per type) and a lone backward's forward ran on the tape."""
    for half in action.sub_actions if action.kind is Kind.OVERLAP else (action,):
        stage, microbatch = plain_key(half)
        worker = workers[stage]
        if not worker.can_tape:
            if action.kind is Kind.OVERLAP:
                kind = type(worker.module)
                warn_once(
                    kind,
                    f"{kind.__name__} (stage {worker.stage}) does not "
                    "follow the node protocol (not a StageModule); its OVERLAP "
                    "actions run forward then backward, without overlap",
                )
            return False
        if (
            half.kind is not Kind.F
            and action.kind is not Kind.OVERLAP
            and not worker.has_tape(microbatch)
        ):
            return False
    return True
