"""What the cyclic garbage collector would free after some work: the tests' probe for
reference cycles (issue 41: a cycle holds its tensors until a collection that may come
thousands of steps later).

``cyclic_garbage(work)`` collects first (what was garbage before ``work`` is not its), runs
``work()`` with automatic collection off, then collects once with ``gc.DEBUG_SAVEALL`` so that
everything found unreachable is kept for inspection, and returns the megapipe objects and
tensors among it by type name (empty: nothing the step made waits for the collector). The
collector's settings and the saved objects are restored and freed before it returns.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch


def _ours(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor) or (type(obj).__module__ or "").startswith("megapipe")


def cyclic_garbage(work: Callable[[], Any]) -> dict[str, int]:
    """Megapipe objects and tensors that only the cyclic collector frees after ``work()``:
    {type name: count}."""
    enabled, flags = gc.isenabled(), gc.get_debug()
    gc.collect()
    gc.disable()
    try:
        work()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found = Counter(f"{type(o).__module__}.{type(o).__qualname__}"
                        for o in gc.garbage if _ours(o))
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
        gc.collect()  # the saved cycles, now without the debug flag
        if enabled:
            gc.enable()
    return dict(found)
