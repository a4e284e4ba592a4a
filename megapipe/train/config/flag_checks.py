"""The flags' own checks that need more than a range or a choice (``flags`` declares them).

Each is a ``declare.Check``: ``(flag, value) -> message or None``. They import no torch, so
parsing stays light; the rules between several flags live in ``checks``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from megapipe.data.blend import check_data_path, is_indexed_prefix
from megapipe.data.errors import DataError
from megapipe.schedule import SCHEDULES

# Megatron's names for the groups a user may put on high-priority NCCL streams -> megapipe's
HIGH_PRIORITY_GROUPS = {"ep": "ep", "ep_dp": "expert_dp", "dp": "dp", "pp": "pp"}
# graphs.rules' names (tested equal there), written here so parsing imports no torch
GRAPH_IMPLS = ("none", "local", "transformer_engine")
GRAPH_MODULES = ("attn", "mlp", "moe_router", "moe_preprocess", "moe")


def known_groups(name: str, groups: tuple[str, ...]) -> str | None:
    unknown = " ".join(g for g in groups if g not in HIGH_PRIORITY_GROUPS)
    choose = ", ".join(HIGH_PRIORITY_GROUPS)
    return f"{name} {unknown}: not a group; choose from {choose}" if unknown else None


def known_schedule(name: str, value: str) -> str | None:
    known = ", ".join(SCHEDULES)
    return None if value in SCHEDULES else f"{name}={value!r} is unknown; known: {known}"


def graph_impl(name: str, impl: str) -> str | None:
    if impl in ("none", "local"):
        return None
    from megapipe.graphs.rules import impl_problem

    return impl_problem(impl)


def graph_modules(name: str, modules: tuple[str, ...]) -> str | None:
    if all(m in GRAPH_MODULES for m in modules):
        return None
    from megapipe.graphs.rules import modules_problem

    return (modules_problem(modules) or "").replace("--cuda-graph-modules", name) or None


def no_fp16(name: str, on: bool) -> str | None:
    return (
        (
            "--fp16 is not supported: megapipe trains in fp32 or with --bf16 (fp16 would need "
            "dynamic loss scaling, which megapipe does not implement)"
        )
        if on
        else None
    )


def indexed_or_text(name: str, values: tuple[str, ...]) -> str | None:
    """Megatron's prefixes (and weights) are checked here, raw text files in ``build``;
    the two kinds do not mix."""
    if not values_are_indexed(values):
        return None
    text = [v for v in values if os.path.exists(v) and not _names_prefix(v)]
    if text:
        return (
            f"{name} mixes raw text ({text[0]}) with indexed datasets: give raw text files "
            "or Megatron prefixes (megapipe preprocess-data makes them)"
        )
    try:
        check_data_path(values)
    except DataError as err:
        return str(err)
    return None


def _names_prefix(value: str) -> bool:
    """``value`` is an indexed dataset's prefix, or its ``.bin`` / ``.idx`` file."""
    stem = value[:-4] if value.endswith((".bin", ".idx")) else None
    return is_indexed_prefix(value) or (stem is not None and is_indexed_prefix(stem))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def values_are_indexed(values: tuple[str, ...]) -> bool:
    """Whether ``--data-path`` names Megatron's indexed datasets (a weight, or a prefix whose
    ``.idx`` or ``.bin`` exists, among the values) rather than raw text files."""
    return any(_is_number(v) or _names_prefix(v) for v in values)


def megapipe_model(what: str, megatron: str) -> Callable[[str, Any], str | None]:
    """A check refusing the setting of a Megatron model switch that megapipe's model lacks
    (``what``: megapipe's model; ``megatron``: the refused setting)."""

    def check(name: str, value: Any) -> str | None:
        if value is True or value == "RMSNorm":
            return None
        shown = f"{name}={value}" if isinstance(value, str) else "--no-" + name[2:]
        return f"{shown}: megapipe's model {what}; {megatron} is not implemented"

    return check
