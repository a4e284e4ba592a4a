"""The real call tree of a step's actions, recorded with a profile hook (``sys.setprofile``).

``ActionPath`` records, on the host thread, every call into megapipe under the executor's
action loop (``PipelineExecutor._run_actions``, itself the first call): the functions a reader
follows from an action to the streams and the model's nodes. It does not descend into the model
(its node functions, ``megapipe/models``, ``megapipe/moe``), into autograd's engine (what a
node's backward runs) or into other libraries (torch): those are where the path ends. The comm
stream's worker thread runs the same node functions (``Tape.forward_node``,
``Tape.backward_node``) the host runs for compute nodes, so the host thread sees every function
of the path. ``chain`` is the deepest call chain, root first.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import megapipe

ROOT = os.path.dirname(megapipe.__file__)
MODEL = tuple(os.path.join(ROOT, d) + os.sep for d in ("models", "moe"))
LOOP = ("megapipe.pipeline.executor", "_run_actions")


@dataclass
class ActionPath:
    """What one or more action loops entered (module docstring)."""

    functions: set[tuple[str, str]] = field(default_factory=set)  # (file, qualified name)
    edges: set[tuple[tuple[str, str], tuple[str, str]]] = field(default_factory=set)
    depth: int = 0  # the longest chain of calls from the action loop (itself the first)
    chain: tuple[tuple[str, str], ...] = ()  # that chain
    roots: int = 0  # action loops recorded
    _stack: list = field(default_factory=list)  # per frame: (function or None, depth)
    _skip: int = 0  # nested frames under a frame not followed
    _in_autograd: int = 0

    @property
    def files(self) -> set[str]:
        return {file for file, _ in self.functions}

    def __enter__(self) -> ActionPath:
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)

    def _profile(self, frame, event, arg) -> None:
        if event == "c_call" and self._stack and not self._skip:
            if getattr(arg, "__name__", "") == "run_backward":
                self._in_autograd += 1
            return
        if event in ("c_return", "c_exception"):
            if getattr(arg, "__name__", "") == "run_backward" and self._in_autograd:
                self._in_autograd -= 1
            return
        if event == "call":
            self._enter(frame)
        elif event == "return":
            self._leave()

    def _enter(self, frame) -> None:
        code = frame.f_code
        if not self._stack:
            if (frame.f_globals.get("__name__"), code.co_name) == LOOP:
                self.roots += 1
                self._push(code, 1, None)
            return
        if self._skip or self._in_autograd:
            self._skip += 1
            return
        file = code.co_filename
        if not file.startswith(ROOT + os.sep) or file.startswith(MODEL):
            self._skip += 1
            return
        if code.co_name.startswith("<"):  # a comprehension reads as part of its function
            self._stack.append((None, 0))
            return
        parent, depth = next(((f, d) for f, d in reversed(self._stack) if f), (None, 0))
        self._push(code, depth + 1, parent)

    def _push(self, code, depth: int, parent) -> None:
        function = (os.path.relpath(code.co_filename, ROOT), code.co_qualname)
        self.functions.add(function)
        if parent is not None:
            self.edges.add((parent, function))
        self._stack.append((function, depth))
        if depth > self.depth:
            self.depth = depth
            self.chain = tuple(f for f, _ in self._stack if f)

    def _leave(self) -> None:
        if self._skip:
            self._skip -= 1
            return
        if self._stack:
            self._stack.pop()
