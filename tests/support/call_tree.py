"""The real call tree of one combined step, recorded with a profile hook (``sys.setprofile``).

``OverlapPath`` records, on the host thread, every call into megapipe's engine under the
executor's ``_run_combined`` for an OVERLAP action: the functions a reader follows from the
OVERLAP branch to the streams and the model's nodes. It does not descend into the model (its
node functions, ``megapipe/models``, ``megapipe/moe``), into autograd's engine (what a node's
backward runs) or into other libraries (torch): those are where the path ends. The comm stream's
worker thread runs the same node functions (``forward_node``, ``backward_node``) the host runs
for compute nodes, so the host thread sees every function of the path.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import megapipe

ROOT = os.path.dirname(megapipe.__file__)
MODEL = tuple(os.path.join(ROOT, d) + os.sep for d in ("models", "moe"))


@dataclass
class OverlapPath:
    """What one or more OVERLAP actions' combined steps entered (module docstring)."""

    functions: set[tuple[str, str]] = field(default_factory=set)  # (file, qualified name)
    edges: set[tuple[tuple[str, str], tuple[str, str]]] = field(default_factory=set)
    depth: int = 0  # the longest chain of calls from _run_combined (itself the first)
    roots: int = 0  # OVERLAP actions recorded
    _stack: list = field(default_factory=list)  # per frame: (function or None, depth)
    _skip: int = 0  # nested frames under a frame not followed
    _in_autograd: int = 0

    @property
    def files(self) -> set[str]:
        return {file for file, _ in self.functions}

    def __enter__(self) -> OverlapPath:
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
            action = frame.f_locals.get("action") if code.co_name == "_run_combined" else None
            if action is not None and getattr(action.kind, "name", None) == "OVERLAP" \
                    and frame.f_globals.get("__name__") == "megapipe.pipeline.executor":
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
        self.depth = max(self.depth, depth)
        self._stack.append((function, depth))

    def _leave(self) -> None:
        if self._skip:
            self._skip -= 1
            return
        if self._stack:
            self._stack.pop()
