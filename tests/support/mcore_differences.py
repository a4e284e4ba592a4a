"""Which adapter cases run on which megatron-core release, derived from the table of differences
between releases in ``megapipe/megatron/mcore_release.py``'s docstring.

The newest release runs every case. An older release runs, for each row of the table where its
answer differs from the newest's, the first case (in the given order) that reaches that row
and that it can run: so each branch the adapter takes for an older release runs against that
release, and a row a release shares with the newest is not run again there. ``REACHES`` says
which cases reach each row (they run the adapter's code of that row); every row must be named
there (``test_mcore_adapter`` checks), so a new difference gets its cases on every release it
touches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace

from megapipe.megatron import mcore_release
from megapipe.megatron.mcore_release import McoreRelease, parse_version
from support.mcore_models import McoreCase

# row of the table (a part of its first cell) -> whether a case reaches it
REACHES: dict[str, Callable[[McoreCase], bool]] = {
    # every layer's MLP input goes through pre_mlp (no case sets fp32_residual_connection: its
    # cast is not compared with Megatron's; the refusal checks accept the field)
    "pre-MLP norm": lambda case: True,
    "fp32_residual_connection": lambda case: True,
    "MoE input unflattened": lambda case: True,  # every MoE layer (packed sequences refused)
    "_postprocess": lambda case: True,  # every last stage
    "MTP layer's inner layer": lambda case: case.mtp > 0,
    "_get_embeddings": lambda case: case.mtp > 0,
    # read and restored around a node's recompute (mcore_recompute)
    "MoE metrics tracker": lambda case: case.recompute == "full",
    # after megapipe's own reduction (with Megatron's DDP, its finalize_model_grads does it)
    "_update_router_expert_bias": lambda case: case.expert_bias and case.reduce == "megapipe",
    "quantile-balancing": lambda case: case.balancing == "quantile_balancing",
    "MTP with full recompute": lambda case: case.mtp > 0 and case.recompute == "full",
}


def table() -> dict[str, dict[str, str]]:
    """``mcore_release``'s table: {first cell: {"0.16": answer, ...}}, a ``same`` cell resolved
    to the answer before it."""
    lines = [line.strip() for line in (mcore_release.__doc__ or "").splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("| where |"))
    releases = [cell.strip() for cell in lines[start].strip("|").split("|")][1:]
    rows: dict[str, dict[str, str]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        where, *answers = [cell.strip() for cell in line.strip("|").split("|")]
        resolved: list[str] = []
        for answer in answers:
            resolved.append(resolved[-1] if answer == "same" else answer)
        rows[where] = dict(zip(releases, resolved))
    return rows


def row_key(where: str) -> str:
    """The ``REACHES`` key naming the row ``where`` (exactly one must)."""
    keys = [key for key in REACHES if key in where]
    if len(keys) != 1:
        raise KeyError(f"row {where!r} of mcore_release's table is named by {keys} in REACHES "
                       "(exactly one key must name it: which adapter cases reach it?)")
    return keys[0]


def runs_on(version: str, case: McoreCase, needs: tuple[str, ...] | None) -> bool:
    """Whether ``version`` can run ``case`` at all: a release it needs, and a configuration that
    release's Megatron runs (``McoreRelease.config_problem``)."""
    if needs is not None and not version.startswith(needs):
        return False
    parsed = parse_version(version)
    assert parsed is not None, version
    config = SimpleNamespace(mtp_num_layers=case.mtp or None,
                             recompute_granularity=case.recompute)
    return McoreRelease(parsed).config_problem(config) is None


def cases_on(version: str, newest: str,
             cases: Sequence[tuple[McoreCase, tuple[str, ...] | None]]) -> list[McoreCase]:
    """The cases ``version`` runs (module docstring), in the given order."""
    runnable = [case for case, needs in cases if runs_on(version, case, needs)]
    if version == newest:
        return runnable
    line, newest_line = version.rsplit(".", 1)[0], newest.rsplit(".", 1)[0]
    chosen: set[McoreCase] = set()
    for where, answers in table().items():
        if answers[line] == answers[newest_line]:
            continue
        reaches = REACHES[row_key(where)]
        chosen.update(next(([case] for case in runnable if reaches(case)), []))
    return [case for case in runnable if case in chosen]
