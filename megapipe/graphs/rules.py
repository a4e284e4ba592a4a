"""The rules of ``--cuda-graph-impl`` and ``--cuda-graph-modules`` (Megatron's names), pure
Python so the CLI checks them before anything starts; what they capture: ``graphs.nodes``.

megapipe captures whole compute nodes. A node declares the Megatron modules it holds
(``Graphable.modules``): the reference GPT's MoE attention node holds ``attn``, ``moe_router``
and ``moe_preprocess``, a dense layer's node ``attn`` and ``mlp``, a MoE layer's experts and
finish nodes ``moe`` (static only with a rank capacity). A module is captured only where every
module of its node is selected; ``moe_router`` and ``moe_preprocess`` go together (as in
Megatron's local graphs), and ``moe`` (the whole layer) takes both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

GRAPH_IMPLS = ("none", "local", "transformer_engine")
GRAPH_MODULES = ("attn", "mlp", "moe_router", "moe_preprocess", "moe")
"""Megatron's ``--cuda-graph-modules`` that megapipe captures (the others are refused)."""
MOE_NOT_STATIC = (
    "--cuda-graph-modules moe: a dropless MoE layer's expert shapes follow its "
    "routing; give --moe-expert-rank-capacity-factor (static lanes, no host read)"
)
REFUSED_MODULES = {
    "shared_experts": "not a Megatron CUDA-graph module; megapipe's shared expert runs in the "
    "MoE finish node, which reads the routing indices from the layer state",
    "mamba": "megapipe has no Mamba layers",
    "full_iteration": "megapipe captures nodes, not whole iterations",
}
TOGETHER = ("moe_router", "moe_preprocess")  # Megatron's local graphs take both when given one


def impl_problem(impl: str) -> str | None:
    """One line when ``--cuda-graph-impl`` names something megapipe does not run."""
    if impl not in GRAPH_IMPLS:
        return f"--cuda-graph-impl {impl}: not one of {', '.join(GRAPH_IMPLS)}"
    if impl == "transformer_engine":
        return (
            "--cuda-graph-impl transformer_engine: megapipe does not use TransformerEngine; "
            "use --cuda-graph-impl local"
        )
    return None


def modules_problem(modules: Sequence[str]) -> str | None:
    """One line naming a module megapipe does not capture, and why."""
    for name in modules:
        if name in REFUSED_MODULES:
            return f"--cuda-graph-modules {name}: not captured: {REFUSED_MODULES[name]}"
        if name not in GRAPH_MODULES:
            return (
                f"--cuda-graph-modules {name}: unknown; megapipe captures "
                f"{', '.join(GRAPH_MODULES)}"
            )
    return None


def settings_problem(impl: str, modules: Sequence[str]) -> str | None:
    """One line naming what is wrong with ``--cuda-graph-impl`` and ``--cuda-graph-modules``
    together (``coverage_problem`` checks them against a model's nodes)."""
    problem = impl_problem(impl)
    if problem is not None:
        return problem
    if impl == "none":
        return (
            f"--cuda-graph-modules {' '.join(modules)} needs --cuda-graph-impl local"
            if modules
            else None
        )
    if not modules:
        return (
            "--cuda-graph-impl local without --cuda-graph-modules captures whole layers, "
            "whose all-to-alls megapipe overlaps instead; name the modules (attn "
            "moe_router moe_preprocess, or attn moe, and mlp for dense layers)"
        )
    return modules_problem(modules)


def split_backward_problem(schedule: str, splits_backward: bool, tape: bool) -> str | None:
    """CUDA graphs with a schedule whose I/W split runs on plain autograd (no overlap): the
    generic split runs a node's backward twice, which a captured node cannot."""
    if splits_backward and not tape:
        return (
            f"CUDA graphs with {schedule} without the overlap: its plain I/W split runs a "
            "node's backward twice, which a captured node cannot; turn the overlap on"
        )
    return None


def selected(modules: Iterable[str]) -> frozenset[str]:
    """The modules captured for ``modules`` (``moe_router`` and ``moe_preprocess`` together)."""
    chosen = set(modules)
    if chosen & (set(TOGETHER) | {"moe"}):
        chosen |= set(TOGETHER)
    return frozenset(chosen)


def coverage_problem(
    modules: Iterable[str], holders: Iterable[Sequence[str]], whole_model: bool = True
) -> str | None:
    """One line when a selected module sits in a node that also holds an unselected one
    (megapipe captures whole nodes) or, for a ``whole_model``'s node kinds, in none at all.
    ``holders``: the modules of each kind of capturable node (``Graphable.modules``)."""
    chosen = selected(modules)
    holders = [tuple(h) for h in holders]
    for name in sorted(chosen):
        mine = [h for h in holders if name in h]
        if not mine and whole_model:
            if name == "moe":
                return MOE_NOT_STATIC
            why = (
                "the model has no dense layer" if name == "mlp" else "no node of the model holds it"
            )
            return f"--cuda-graph-modules {name}: nothing to capture: {why}"
        for holder in mine:
            missing = [m for m in holder if m not in chosen]
            if missing:
                return (
                    f"--cuda-graph-modules {name}: megapipe captures whole nodes, and the "
                    f"node holding {name} also holds {' '.join(missing)}: add it"
                )
    return None
