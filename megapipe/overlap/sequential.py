"""The tape path: a stage's nodes run one after the other, forward, then backward.

``record_forward(layer_plans, inputs)`` runs each layer's nodes in order on a new tape
(``overlap.tape``); ``run_backward(tape, grads)`` walks them back, last node first, with the
tape's ``forward_node`` and ``backward_node`` that the combined step runs too, so both
paths perform the same operations: bitwise those of plain autograd over the same plans.
``TapeRunner`` is the node runner of this path (a model's forward drives it through its
``node_runner``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megapipe.overlap.plan import Track
from megapipe.overlap.tape import Grads, Tape, Values, checked
from megapipe.overlap.wgrad import WeightGradQueue


def record_forward(
    layer_plans: Sequence[Sequence[Any]], inputs: Sequence[Any], track: Track | None = None
) -> tuple[Values, Tape]:
    """Run a stage's layer plans node by node; return (outputs as fresh leaves, tape).

    ``run_backward`` returns the gradients of ``inputs`` and leaves the caller's tensors alone
    (their ``.grad`` is not touched). ``track`` becomes the tape's ``track``.
    """
    runner = TapeRunner(track, route_input_grads=False)
    values = checked(inputs, "stage inputs")
    for plan in layer_plans:
        values = runner.run_layer(plan, values)
    return values, runner.tape


def run_backward(
    tape: Tape,
    grad_outputs: Sequence[torch.Tensor | None] | None = None,
    wgrad: WeightGradQueue | None = None,
) -> Grads:
    """Run the whole backward of ``tape``; return the gradients of its first layer's inputs.

    ``grad_outputs`` are the gradients of the tape's outputs (None: read the outputs' ``.grad``,
    e.g. after ``loss.backward()`` on them). ``wgrad`` (a ``WeightGradQueue``) defers the weight
    gradients of ops that support it into the queue; the caller flushes the queue.
    """
    grads = grad_outputs
    while tape.remaining_backward_layers():
        layer = tape.begin_layer_backward(grads, wgrad)
        for index in reversed(range(len(layer.nodes))):
            tape.backward_node(layer, index)
        grads = None
    if tape.input_grads is None:
        raise RuntimeError("the tape's first layer never ran backward")
    return tape.input_grads


class TapeRunner:
    """Records the layers a model runs through ``run_layer`` on a tape, node after node (e.g. as
    ``GPTStage.node_runner``). Gradients of tensors that enter the first layer flow on into them
    (their graph, or their ``.grad`` for leaves) as plain autograd would, unless
    ``route_input_grads`` is False; ``run_backward`` also returns them."""

    def __init__(self, track: Track | None = None, route_input_grads: bool = True) -> None:
        self.tape = Tape(route_input_grads, track)

    def run_layer(self, plan: Sequence[Any], inputs: Sequence[Any]) -> Values:
        layer = self.tape.begin_layer(plan, inputs)
        for index in range(len(layer.nodes)):
            self.tape.forward_node(layer, index)
        assert layer.outputs is not None
        return layer.outputs
