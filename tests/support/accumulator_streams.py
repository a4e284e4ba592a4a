"""A CPU model of where autograd accumulates a parameter's gradient on CUDA.

Autograd runs a leaf's ``AccumulateGrad`` node (the ``.grad`` write and the post-accumulate
hooks: ``main_grad``, the data-parallel bucket counts) on the stream that was current when the
node was made, and the node lives as long as some autograd graph holds it (pytorch/pytorch
#137483). ``AccumulatorStreams`` is a torch-function mode that, after each call that recorded
autograd history from a leaf needing a gradient, stamps that leaf's node (made by the call,
unless one lived) with the stream current then (``stream_of()``, e.g.
``FakeGraphApi.stream_of``: the graphs' side stream in a warm-up or capture); ``accumulated``
lists, per accumulation of a gradient, the leaf's shape and the stream its node is bound to
(``leaves``: the leaf's ``id``). A reduction that waits only on the compute stream needs them
all on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten


class AccumulatorStreams(TorchFunctionMode):
    """Binds each leaf's ``AccumulateGrad`` to the stream current when it is made (module
    docstring)."""

    def __init__(self, stream_of: Callable[[], str]) -> None:
        super().__init__()
        self.stream_of = stream_of
        self.accumulated: list[tuple[tuple[int, ...], str]] = []
        self.leaves: list[int] = []  # per accumulation, id() of the leaf

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(isinstance(t, torch.Tensor) and t.grad_fn is not None
               for t in tree_flatten(out)[0]):  # it recorded history: its leaves have nodes
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad:
                    self._bind(t)
        return out

    def _bind(self, leaf: torch.Tensor) -> None:
        node = leaf.view_as(leaf).grad_fn.next_functions[0][0]  # the one the call made or used
        if "stream" not in node.metadata:
            stream = node.metadata["stream"] = self.stream_of()
            shape, key = tuple(leaf.shape), id(leaf)

            def accumulating(grads: Any) -> None:
                if grads[0] is not None:  # autograd runs it with no gradient too: nothing added
                    self.accumulated.append((shape, stream))
                    self.leaves.append(key)

            node.register_prehook(accumulating)
