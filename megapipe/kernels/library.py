"""megapipe's fused operators: torch operators in the namespace ``megapipe``, one kernel each.

Each operator is defined once with a schema and has two implementations:

- **CUDA** (with Triton installed): exactly one Triton kernel launch, nothing else that runs a
  kernel (outputs are allocated with ``torch.empty``). This is the rule the launch count
  (``benchmarks/launch_count.py``) relies on when it counts one per ``megapipe`` operator;
- **CPU**, and CUDA without Triton: the plain-torch reference (``reference`` and
  ``reference_fused``), the definition the Triton kernels are tested against.

A dispatch mode, autograd and the profiler each see one ``megapipe::<name>`` call, whichever
implementation runs. The operators are registered with ``torch.library.Library`` (``define`` and
``impl``): a ``torch.library.custom_op`` wraps each call in Python that cost about 35 us of host
time per call here, against about 6 us for this registration (measured with two ``clone``s inside,
one thread), and the host's time per op is what these operators are for. Autograd lives in
``torch.autograd.Function``s around them (``megapipe.kernels``); there is no fake (meta)
implementation, so ``torch.compile`` cannot trace them.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
# Options every megapipe kernel launches with. ``enable_fp_fusion`` (a*b+c as one FMA) is
# pinned: Triton 3.9 fuses unless TRITON_DEFAULT_FP_FUSION says otherwise and 3.10 will not,
# and the kernels' low bits follow it. Off: each operation rounds once, as in the references.
KERNEL_OPTIONS = MappingProxyType({"enable_fp_fusion": False})
NAMESPACE = "megapipe"

LIBRARY = torch.library.Library(NAMESPACE, "DEF")


def _triton(module: str, name: str) -> Callable[..., Any]:
    """``megapipe.kernels.<module>.<name>``, imported at its first call (Triton reads
    ``TRITON_INTERPRET`` when a kernel module is imported)."""

    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)(*args)

    return call


def define(schema: str, reference: Callable[..., Any], triton: tuple[str, str]) -> Any:
    """Register ``megapipe::<schema>`` with ``reference`` on CPU and the Triton function
    ``triton = (module, name)`` on CUDA (the reference there when Triton is missing); both
    take every argument of the schema."""
    name = schema.split("(", 1)[0]
    LIBRARY.define(schema)
    LIBRARY.impl(name, reference, "CPU")
    LIBRARY.impl(name, _triton(*triton) if HAS_TRITON else reference, "CUDA")
    return getattr(getattr(torch.ops, NAMESPACE), name).default
