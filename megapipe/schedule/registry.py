"""Schedules by name: ``build_schedule`` checks the request, then calls the family's generator.

| name             | stages per rank (vpp)      | placement | microbatches M                    |
|------------------|----------------------------|-----------|-----------------------------------|
| gpipe            | 1                          | loop      | any M >= 1                        |
| 1f1b             | 1 (pp=1: no pipelining)    | loop      | any M >= 1                        |
| interleaved-1f1b | any vpp >= 1 (1 = 1f1b)    | loop      | vpp > 1: Megatron's group rule    |
| looped-bfs       | any vpp >= 1               | loop      | any M >= 1                        |
| zb1p             | any vpp >= 1               | loop      | vpp > 1: Megatron's group rule    |
| zbv              | 2 (fixed)                  | V         | any M >= 1                        |
| dualpipev        | 2 (fixed)                  | V         | M >= 2 pp                         |
| dualpipe         | 2 (fixed, bidirectional)   | mirrored  | pp even, M even, M >= 2 pp        |

Megatron's group rule (interleaved-1f1b and zb1p with vpp > 1): with g =
``microbatch_group_size_per_vp_stage`` (an option, default pp), pp <= g <= M, and M % g is 0 or
at least pp. A smaller group sends a microbatch to its next chunk before it has left the last
rank, which stalls the pipeline (and deadlocks interleaved 1F1B's order). With the default g = pp
this means M is a multiple of pp; a larger g admits other M. ``overlap=True`` asks for
OVERLAP pairs: DualPipe and DualPipeV emit them natively; every other schedule goes through
``megapipe.schedule.overlap_pass.apply.apply_overlap``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from .errors import ScheduleError
from .families.dualpipe import dualpipe, dualpipev
from .families.interleaved import interleaved_1f1b, looped_bfs
from .families.simple import gpipe, one_f_one_b
from .families.zero_bubble import zb1p, zbv
from .ir import Schedule, ScheduleOptions
from .overlap_pass.budget import apply_overlap_within, check_budget, check_native_budget

GROUP_OPTION = "microbatch_group_size_per_vp_stage"


@dataclass(frozen=True)
class _Family:
    """A schedule's generator and what a request for it may hold: its fixed vpp (None: any) and
    microbatch constraints. ``native_overlap`` generators take ``overlap``, ``megatron_groups``
    ones the group size (``GROUP_OPTION``)."""

    generator: Callable[..., Schedule]
    fixed_vpp: int | None = None
    native_overlap: bool = False
    even_pp: bool = False
    even_microbatches: bool = False
    min_microbatches: Callable[[int, int], int] = lambda pp, vpp: 1
    min_reason: str = ""
    megatron_groups: bool = False


# The one table of schedule names, in the order ``SCHEDULES`` lists them.
_FAMILIES: dict[str, _Family] = {
    "gpipe": _Family(gpipe, fixed_vpp=1),
    "1f1b": _Family(one_f_one_b, fixed_vpp=1),
    "interleaved-1f1b": _Family(interleaved_1f1b, megatron_groups=True),
    "looped-bfs": _Family(looped_bfs),
    "zb1p": _Family(zb1p, megatron_groups=True),
    "zbv": _Family(zbv, fixed_vpp=2),
    "dualpipev": _Family(
        dualpipev,
        fixed_vpp=2,
        native_overlap=True,
        min_microbatches=lambda pp, vpp: 2 * pp,
        min_reason="DualPipeV needs at least as many microbatches as stages (2 pp)",
    ),
    "dualpipe": _Family(
        dualpipe,
        fixed_vpp=2,
        native_overlap=True,
        even_pp=True,
        even_microbatches=True,
        min_microbatches=lambda pp, vpp: 2 * pp,
        min_reason="DualPipe needs at least pp microbatches in each direction",
    ),
}

SCHEDULES: dict[str, Callable[..., Schedule]] = {
    name: family.generator for name, family in _FAMILIES.items()
}
"""Schedule name -> the generator of its family (see each generator for its arguments)."""


def default_schedule_name(pp: int, vpp: int) -> str:
    """Megatron's choice when none is named: interleaved 1F1B with virtual stages, else 1F1B
    (pp=1: one stage, no pipelining)."""
    return "interleaved-1f1b" if vpp > 1 else "1f1b"


def build_schedule(
    name: str,
    pp: int,
    num_microbatches: int,
    vpp: int = 1,
    overlap: bool = False,
    max_extra_in_flight: int | None = None,
    microbatch_group_size_per_vp_stage: int | None = None,
) -> Schedule:
    """The schedule ``name`` for ``pp`` ranks and ``num_microbatches`` microbatches.

    ``vpp`` is the number of stages per rank for the schedules that let it vary (interleaved-1f1b,
    looped-bfs, zb1p); gpipe and 1f1b take vpp=1; zbv, dualpipev and dualpipe always hold two
    stages per rank and accept vpp=1 (the default) or 2. Impossible requests raise
    ``ScheduleError`` before anything is built; the module docstring lists every constraint.
    ``max_extra_in_flight`` K (with ``overlap``): the combined schedule holds at most K more
    microbatch-stages in flight on any rank than the plain one (``schedule.overlap_pass.budget``).
    ``microbatch_group_size_per_vp_stage``: Megatron's group size, for interleaved-1f1b and zb1p.
    The request is kept as the schedule's ``options``.
    """
    family = _FAMILIES.get(name)
    if family is None:
        raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    group = microbatch_group_size_per_vp_stage
    _check_request(name, family, pp, num_microbatches, vpp, group)
    check_budget(max_extra_in_flight)
    options = ScheduleOptions(
        vpp=family.fixed_vpp or vpp,
        overlap=overlap,
        microbatch_group_size_per_vp_stage=group,
        max_extra_in_flight=max_extra_in_flight if overlap else None,
    )
    schedule = _build(family, pp, num_microbatches, options)
    if overlap and family.native_overlap:
        plain = _build(family, pp, num_microbatches, replace(options, overlap=False))
        check_native_budget(plain, schedule, max_extra_in_flight)
    if overlap and not family.native_overlap:
        schedule = apply_overlap_within(schedule, max_extra_in_flight)  # keeps the options
    return schedule


def _build(family: _Family, pp: int, num_microbatches: int, options: ScheduleOptions) -> Schedule:
    """Call the generator with the arguments it takes; the schedule keeps ``options``."""
    args: list = [pp, num_microbatches]
    if family.fixed_vpp is None:
        args.append(options.vpp)
    if family.native_overlap:
        args.append(options.overlap)
    if family.megatron_groups:
        args.append(options.microbatch_group_size_per_vp_stage)
    schedule = family.generator(*args)
    return schedule.replace_actions(schedule.table, options=options)


def _check_request(
    name: str, family: _Family, pp: int, num_microbatches: int, vpp: int, group: int | None
) -> None:
    for label, value in (("pp", pp), ("num_microbatches", num_microbatches), ("vpp", vpp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name}: {label} must be a positive integer, got {value!r}")
    if group is not None and not family.megatron_groups:
        raise ScheduleError(f"{name}: unknown option(s) {GROUP_OPTION}; accepted: none")
    if family.fixed_vpp == 1 and vpp != 1:
        raise ScheduleError(
            f"{name} runs one stage per rank, got vpp={vpp}; use interleaved-1f1b, looped-bfs or "
            f"zb1p for vpp > 1"
        )
    if family.fixed_vpp == 2 and vpp not in (1, 2):
        raise ScheduleError(f"{name} always holds 2 stages per rank; vpp={vpp} is not possible")
    if family.even_pp and pp % 2:
        raise ScheduleError(f"{name} needs an even pp (ranks pair up as mirrors), got pp={pp}")
    if family.even_microbatches and num_microbatches % 2:
        raise ScheduleError(
            f"{name} needs an even number of microbatches (half enter from each end), "
            f"got {num_microbatches}"
        )
    least = family.min_microbatches(pp, vpp)
    if num_microbatches < least:
        raise ScheduleError(
            f"{name} with pp={pp}, vpp={vpp} needs at least {least} microbatches, got "
            f"{num_microbatches}: {family.min_reason}"
        )
    if family.megatron_groups and vpp > 1:
        _check_groups(name, pp, num_microbatches, pp if group is None else group)


def _check_groups(name: str, pp: int, num_microbatches: int, group: object) -> None:
    """Megatron's rule for the microbatch groups of an interleaved order (see module docstring)."""
    if not isinstance(group, int) or isinstance(group, bool) or group < pp:
        raise ScheduleError(
            f"{name}: {GROUP_OPTION} must be an integer >= pp={pp}, got {group!r} (a smaller "
            f"group sends a microbatch to its next chunk before it has left the last rank)"
        )
    if group > num_microbatches:
        raise ScheduleError(
            f"{name} with pp={pp} needs at least {GROUP_OPTION}={group} microbatches (one full "
            f"group per chunk), got {num_microbatches}"
        )
    last = num_microbatches % group
    if 0 < last < pp:
        raise ScheduleError(
            f"{name}: the last microbatch group would hold {num_microbatches} % {group} = {last} "
            f"microbatches, fewer than pp={pp}; use a multiple of {group} microbatches or a "
            f"{GROUP_OPTION} that leaves 0 or at least pp"
        )
