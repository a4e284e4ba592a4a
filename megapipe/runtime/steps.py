"""Forward and backward steps of one pipeline stage, one microbatch at a time.

``StageWorker`` owns a stage's stash: for every microbatch between its forward and its last
backward step, the tensors that backward needs. Nothing else is kept, so the stash size is the
number of live activations, which the executor reports and the tests bound.

Backward comes in three forms, matching the schedule's actions:

- ``backward`` (B): input and weight gradients together, then the stash entry is freed;
- ``backward_input`` (I): the input gradient only; what the weight gradient needs is kept as a
  ``DeferredWeightGrad`` (``split_backward``) in the stash;
- ``backward_weight`` (W): runs the deferred part and frees the entry.

Stages that implement ``layer_plans()`` (the reference GPT) run forward and backward node by
node through ``megapipe.overlap.tape``, so the overlapped path (which must run node by node)
performs the same operations; their I defers the weight gradients of the ops that support it
(``WeightGradQueue``, the experts' grouped matmuls) and computes the others at once. Other
modules run with plain autograd, and their I/W split defers every weight gradient
(``split_backward``). A custom ``forward_fn`` (the Megatron front end) is recorded on a tape
through the module's ``node_runner`` when it has one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from megapipe.overlap.plan import NodeRunner
from megapipe.overlap.tape import Tape, TapeRunner, record_forward, run_backward
from megapipe.overlap.wgrad import WeightGradQueue
from megapipe.runtime.split_backward import DeferredWeightGrad, input_backward

ForwardFn = Callable[[nn.Module, Any], torch.Tensor]
"""``forward_fn(module, stage_input) -> output``: how a stage computes one microbatch."""


def module_forward(module: nn.Module, stage_input: Any) -> torch.Tensor:
    """The default forward: call the module on its input."""
    return module(stage_input)


def records_on_tape(module: nn.Module, forward_fn: ForwardFn) -> bool:
    """Whether a stage runs through the tape: it has layer plans (and a node runner for a
    custom forward_fn, which calls the model itself)."""
    if not callable(getattr(module, "layer_plans", None)):
        return False
    return forward_fn is module_forward or hasattr(module, "node_runner")


@dataclass
class _Entry:
    inputs: list[torch.Tensor] = field(default_factory=list)  # leaves whose grad goes upstream
    outputs: list[torch.Tensor] = field(default_factory=list)  # output, or the scaled loss
    tape: Tape | None = None
    loss: torch.Tensor | None = None  # last stage: the scaled loss backward starts from
    deferred: DeferredWeightGrad | WeightGradQueue | None = None


class StageWorker:
    """Runs one stage's forward and backward steps and keeps its per-microbatch stash."""

    def __init__(
        self,
        stage: int,
        module: nn.Module,
        forward_fn: ForwardFn = module_forward,
        use_tape: bool | None = None,
    ) -> None:
        self.stage = stage
        self.module = module
        self.forward_fn = forward_fn
        self.can_tape = records_on_tape(module, forward_fn)
        self.use_tape = self.can_tape if use_tape is None else use_tape
        if self.use_tape and not self.can_tape:
            raise ValueError(
                f"stage {stage}: use_tape=True needs a module with layer_plans() (and a "
                f"node_runner for a custom forward_fn); {type(module).__name__} has none"
            )
        self._stash: dict[int, _Entry] = {}

    @property
    def live_activations(self) -> int:
        """Microbatches whose activations are held (forward done, last backward step not yet)."""
        return len(self._stash)

    def has_tape(self, microbatch: int) -> bool:
        """Whether the stored forward of ``microbatch`` was recorded on the tape."""
        entry = self._stash.get(microbatch)
        return entry is not None and entry.tape is not None

    def params(self) -> list[torch.Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def forward(
        self,
        microbatch: int,
        stage_input: Any,
        keep_graph: bool = True,
        tape: bool | None = None,
        runner: NodeRunner | None = None,
    ) -> torch.Tensor:
        """Run the stage on ``stage_input``; with ``keep_graph`` stash what backward needs.

        A floating-point tensor input (a received activation) becomes a leaf that requires
        grad, so backward can return its gradient; other inputs (token ids) pass unchanged.
        ``tape`` overrides the worker's ``use_tape`` for this microbatch (both paths perform
        the same operations, so they may be mixed freely). ``runner`` (a ``CombinedRunner``)
        records the forward layer by layer instead, e.g. beside another microbatch's backward;
        its ``tape`` is kept, and the caller calls ``runner.finish()`` afterwards.
        """
        if microbatch in self._stash:
            raise RuntimeError(
                f"stage {self.stage}: forward of microbatch {microbatch} ran twice without a backward"
            )
        if not keep_graph:
            with torch.no_grad():
                return self.forward_fn(self.module, stage_input)
        leaves: list[torch.Tensor] = []
        if isinstance(stage_input, torch.Tensor) and stage_input.is_floating_point():
            stage_input = stage_input.detach().requires_grad_(True)
            leaves.append(stage_input)
        on_tape = self.use_tape if tape is None else tape
        if runner is not None:
            on_tape = True
        if on_tape and not self.can_tape:
            raise ValueError(
                f"stage {self.stage}: {type(self.module).__name__} cannot run on the tape "
                "(no layer_plans(), or no node_runner for a custom forward_fn)"
            )
        output, recorded = self._record(stage_input, on_tape, runner)
        self._stash[microbatch] = _Entry(inputs=leaves, outputs=[output], tape=recorded)
        return output

    @property
    def routes_input_grads(self) -> bool:
        """Whether this stage's tapes route input gradients on into the input (a custom
        forward_fn may transform its input before the first layer) or only return them."""
        return self.forward_fn is not module_forward

    def _record(
        self, stage_input: Any, on_tape: bool, runner: NodeRunner | None = None
    ) -> tuple[torch.Tensor, Tape | None]:
        if not on_tape:
            return self.forward_fn(self.module, stage_input), None
        if runner is None and self.forward_fn is module_forward:
            outputs, tape = record_forward(self.module.layer_plans(), (stage_input,))
            return outputs[0], tape
        if runner is None:
            runner = TapeRunner()
        if self.forward_fn is module_forward:
            values: tuple[Any, ...] = (stage_input,)
            for plan in self.module.layer_plans():
                values = runner.run_layer(plan, values)
            return values[0], runner.tape  # type: ignore[attr-defined]
        previous = getattr(self.module, "node_runner", None)
        self.module.node_runner = runner
        try:
            output = self.forward_fn(self.module, stage_input)
        finally:
            self.module.node_runner = previous
        return output, runner.tape  # type: ignore[attr-defined]

    def attach_loss(self, microbatch: int, scaled_loss: torch.Tensor) -> None:
        """On a last stage: backward starts from ``scaled_loss`` instead of the output."""
        self._entry(microbatch, "attach a loss to").loss = scaled_loss

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
        entry = self._stash.get(microbatch)
        if entry is None:
            raise self._missing(microbatch, "B")
        if entry.tape is not None:
            tape, grads = self.backward_tape(microbatch, grad_output, "B")
            return self.end_backward(microbatch, run_backward(tape, grads), None)
        del self._stash[microbatch]
        if grad_output is None and entry.loss is not None:
            torch.autograd.backward([entry.loss])
        else:
            torch.autograd.backward(entry.outputs, self._output_grads(entry, grad_output))
        return entry.inputs[0].grad if entry.inputs else None

    def backward_input(self, microbatch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """I: return the input gradient now; keep what the weight gradient needs for W."""
        entry = self._entry(microbatch, "I")
        if entry.deferred is not None:
            raise RuntimeError(f"stage {self.stage}: I of microbatch {microbatch} ran twice")
        if entry.tape is not None:
            tape, grads = self.backward_tape(microbatch, grad_output, "I")
            queue = WeightGradQueue()
            return self.end_backward(microbatch, run_backward(tape, grads, wgrad=queue), queue)
        if grad_output is None and entry.loss is not None:
            outputs, grads = [entry.loss], [torch.ones_like(entry.loss)]
        else:
            outputs, grads = entry.outputs, self._output_grads(entry, grad_output)
        grad_inputs, entry.deferred = input_backward(outputs, grads, entry.inputs, self.params())
        leaves = entry.inputs
        entry.outputs, entry.inputs, entry.loss = [], [], None
        return grad_inputs[0] if leaves else None

    def backward_tape(
        self, microbatch: int, grad_output: torch.Tensor | None, what: str = "B"
    ) -> tuple[Tape, list[torch.Tensor]]:
        """The first half of a backward on the tape (B or I): the microbatch's tape and the
        gradients of its outputs, for ``run_backward`` or a ``CombinedRunner``; then call
        ``end_backward`` with the gradients of the tape's inputs."""
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
        return entry.tape, grads

    def end_backward(
        self, microbatch: int, grad_inputs: Any, deferred: WeightGradQueue | None
    ) -> torch.Tensor | None:
        """The second half: B (``deferred`` None) frees the stash entry; I keeps ``deferred``
        (the queued weight gradients) for its W. Returns the stage's input gradient."""
        entry = self._entry(microbatch, "the end of a backward")
        if deferred is None:
            del self._stash[microbatch]
        else:
            entry.deferred, entry.tape, entry.loss = deferred, None, None
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
        if leaf.grad is not None:  # a TapeRunner routes the gradient into the input leaf
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
            "(the schedule runs a backward step before its forward, or twice)"
        )

    def clear(self) -> None:
        """Drop every stashed activation (after an error, or at the end of forward-only)."""
        self._stash.clear()
