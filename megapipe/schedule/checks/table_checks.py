"""The per-action rules of ``validate``, checked on the whole table at once.

Each check finds every action that breaks its rule with array operations, then raises
``ScheduleError`` for the first one in the order the rules are listed in ``validate`` (ranks in
order, actions in list order, an OVERLAP's forward half first), worded as always.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..actions import Action
from ..errors import ScheduleError
from ..ir import Schedule
from ..table import KINDS, OVERLAP, B, Comps, F, I, W, is_comm
from ..timing.flows import stage_rank


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else None


class Faults(NamedTuple):
    """Per computation, what is wrong with where it runs: its stage does not exist, its stage is
    on another rank (``owner``), its microbatch does not exist, or its stage is not in its
    microbatch's pipeline."""

    no_stage: np.ndarray
    misplaced: np.ndarray
    owner: np.ndarray
    no_mb: np.ndarray
    outside: np.ndarray


def faults(schedule: Schedule, comps: Comps) -> Faults:
    no_stage = (comps.stage < 0) | (comps.stage >= schedule.num_stages)
    owner = stage_rank(schedule, comps.stage)
    no_mb = (comps.mb < 0) | (comps.mb >= schedule.num_microbatches)
    lo, hi = pipeline_bounds(schedule, comps.mb)
    outside = (comps.stage < lo) | (comps.stage >= hi)
    return Faults(no_stage, ~no_stage & (owner != comps.rank), owner, no_mb, outside)


def check_placement(schedule: Schedule) -> None:
    """Stages and microbatches exist, and each action runs on its stage's rank."""
    if schedule.num_stages == 0 or schedule.num_microbatches == 0:
        raise ScheduleError(
            f"the schedule has {schedule.num_stages} stages and {schedule.num_microbatches} "
            "microbatches: it needs at least one of each"
        )
    if schedule.bidirectional and (schedule.num_stages % 2 or schedule.num_microbatches % 2):
        raise ScheduleError(
            f"a bidirectional schedule needs an even number of stages and microbatches, got "
            f"{schedule.num_stages} stages and {schedule.num_microbatches} microbatches"
        )
    for stage, rank in enumerate(schedule.stage_to_rank):
        if not 0 <= rank < schedule.pp:
            raise ScheduleError(
                f"stage {stage} is placed on rank {rank}, but the schedule has {schedule.pp} ranks"
            )
    comps = schedule.table.comps()
    found = faults(schedule, comps)
    first = _first(found.no_stage | found.no_mb | found.misplaced)
    if first is None:
        return
    action = schedule.action_at(int(comps.action[first]))
    stage, mb, rank = int(comps.stage[first]), int(comps.mb[first]), int(comps.rank[first])
    if found.no_stage[first]:
        rule = f"stage {stage} does not exist ({schedule.num_stages} stages)"
    elif found.no_mb[first]:
        rule = f"microbatch {mb} does not exist ({schedule.num_microbatches} microbatches)"
    else:
        rule = f"stage {stage} is placed on rank {int(found.owner[first])}, not on this rank"
    raise ScheduleError(rule, rank, action)


def check_pairs(schedule: Schedule) -> None:
    """The two halves of an OVERLAP are different microbatches."""
    table = schedule.table
    first = _first((table.kind == OVERLAP) & (table.mb == table.back_mb))
    if first is not None:
        raise ScheduleError(
            "the two halves of an OVERLAP must be different microbatches (a backward of "
            "a microbatch needs its own forward to have finished)",
            int(table.rank[first]),
            schedule.action_at(first),
        )


def _cell(schedule: Schedule, stage: np.ndarray, mb: np.ndarray) -> np.ndarray:
    """stage * M + mb, wide enough for 4 S M."""
    wide = np.int32 if 4 * schedule.num_stages * schedule.num_microbatches < 2**31 else np.int64
    return stage.astype(wide, copy=False) * schedule.num_microbatches + mb


def compute_comps(schedule: Schedule) -> Comps:
    """The computations of the table's compute actions (SEND/RECV left out)."""
    comps = schedule.table.comps()
    keep = ~is_comm(comps.kind)
    return Comps(*(column[keep] for column in comps))


def pipeline_bounds(schedule: Schedule, mb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``Schedule.stages_for`` per microbatch: first stage and one past the last."""
    n = schedule.stages_per_pipeline
    second = schedule.bidirectional & (mb >= schedule.num_microbatches // 2)
    return np.where(second, n, 0), np.where(second, 2 * n, n)


def check_counts(schedule: Schedule) -> None:
    """Each stage of a microbatch's pipeline runs one F and one B, or one I and one W, for it;
    no other stage runs it."""
    comps = compute_comps(schedule)
    cells = schedule.num_stages * schedule.num_microbatches
    lo, hi = pipeline_bounds(schedule, comps.mb)
    outside = (comps.stage < lo) | (comps.stage >= hi)
    cell = np.where(outside, 0, _cell(schedule, comps.stage, comps.mb))
    if not outside.any():
        counts = np.bincount(cell * 4 + comps.kind, minlength=4 * cells).reshape(-1, 4)
        if counts.max(initial=0) <= 1 and not (counts[:, B] & counts[:, I]).any():
            _check_missing(schedule, {code: counts[:, code] > 0 for code in (F, B, I, W)})
            return
    index = np.arange(len(cell))
    key = cell * 4 + comps.kind
    order = np.argsort(key, kind="stable")
    repeat = np.zeros(len(key), dtype=bool)
    repeat[order[1:]] = key[order[1:]] == key[order[:-1]]
    repeat &= ~outside
    first_of = {}
    for code in (B, I):
        first_of[code] = np.full(cells + 1, len(cell))
        mine = (comps.kind == code) & ~outside
        np.minimum.at(first_of[code], cell[mine], index[mine])
    clash = ((comps.kind == B) & (first_of[I][cell] < index)) | (
        (comps.kind == I) & (first_of[B][cell] < index)
    )
    first = _first(outside | repeat | (clash & ~outside))
    if first is not None:
        _raise_count_error(schedule, comps, first, outside, repeat, lo, hi)
    _check_missing(schedule, presence(schedule, comps))


def _raise_count_error(schedule, comps, first, outside, repeat, lo, hi) -> None:
    stage, mb, rank = int(comps.stage[first]), int(comps.mb[first]), int(comps.rank[first])
    kind = KINDS[comps.kind[first]]
    comp = Action(stage, kind, mb)
    if outside[first]:
        rule = (
            f"microbatch {mb} does not flow through stage {stage} "
            f"(its stages are {int(lo[first])}..{int(hi[first]) - 1})"
        )
    elif repeat[first]:
        rule = f"stage {stage} runs {kind.value} of microbatch {mb} twice"
    else:
        rule = "a stage runs either one B or one I and one W per microbatch, not both B and I"
    raise ScheduleError(rule, rank, comp)


def presence(schedule: Schedule, comps: Comps) -> dict[int, np.ndarray]:
    """Per kind code F, B, I, W: which (stage, microbatch) cells run it (flat S x M grid)."""
    cells = schedule.num_stages * schedule.num_microbatches
    cell = _cell(schedule, comps.stage, comps.mb)
    return {
        code: np.bincount(cell[comps.kind == code], minlength=cells) > 0 for code in (F, B, I, W)
    }


def _check_missing(schedule: Schedule, has: dict[int, np.ndarray]) -> None:
    m, n = schedule.num_microbatches, schedule.stages_per_pipeline
    mbs = np.repeat(np.arange(m), n)
    stages = pipeline_bounds(schedule, mbs)[0] + np.tile(np.arange(n), m)
    cell = stages * m + mbs
    f, b, i, w = (has[code][cell] for code in (F, B, I, W))
    missing = np.where(~f, F, np.where(w & ~i, I, np.where(~b & ~i, B, np.where(i & ~w, W, -1))))
    first = _first(missing >= 0)
    if first is not None:
        stage, mb = int(stages[first]), int(mbs[first])
        raise ScheduleError(
            "missing: each stage runs one F and one B (or one I and one W) per microbatch",
            schedule.stage_to_rank[stage],
            Action(stage, KINDS[missing[first]], mb),
        )


def check_list_order(schedule: Schedule) -> None:
    """On a rank: F before B/I before W of the same stage and microbatch; between adjacent
    stages on the same rank, F of stage s before F of s+1 and the backwards the other way."""
    comps = compute_comps(schedule)
    m, cells = schedule.num_microbatches, schedule.num_stages * schedule.num_microbatches
    cell = _cell(schedule, comps.stage, comps.mb)
    table = schedule.table
    position = table.local_index[comps.action] * 2 + comps.half  # (index, half) in list order
    pos = {}
    for code in (F, B, I, W):
        pos[code] = np.full(cells, -1, dtype=np.int64)
        mine = comps.kind == code
        pos[code][cell[mine]] = position[mine]
    keys = np.flatnonzero(pos[F] >= 0)
    wrong = _list_order_errors(schedule, pos, keys)
    if not any(w.any() for w in wrong):
        return
    # Name the first broken cell in the order cells first appear in the lists.
    first_seen = np.full(cells, len(cell), dtype=np.int64)
    np.minimum.at(first_seen, cell, np.arange(len(cell)))
    keys = keys[np.argsort(first_seen[keys], kind="stable")]
    wrong = _list_order_errors(schedule, pos, keys)
    stage, mb = keys // m, keys % m
    has_b = pos[B][keys] >= 0
    nxt = np.where(wrong[2] | wrong[3], keys + m, keys)
    here = schedule.placement[stage]
    first = _first(wrong[0] | wrong[1] | wrong[2] | wrong[3])
    s, i, rank = int(stage[first]), int(mb[first]), int(here[first])
    back_kind = KINDS[B] if has_b[first] else KINDS[I]
    if wrong[0][first]:
        raise ScheduleError(
            f"runs before {s}F{i}: a backward needs its forward first",
            rank,
            Action(s, back_kind, i),
        )
    if wrong[1][first]:
        raise ScheduleError(
            f"runs before {s}I{i}: W needs the I of the same microbatch first",
            rank,
            Action(s, KINDS[W], i),
        )
    if wrong[2][first]:
        raise ScheduleError(
            f"runs before {s}F{i} on the same rank: stage {s + 1} needs the output of stage {s}",
            rank,
            Action(s + 1, KINDS[F], i),
        )
    next_kind = KINDS[B] if pos[B][nxt[first]] >= 0 else KINDS[I]
    raise ScheduleError(
        f"runs before {s + 1}{next_kind.value}{i} on the same rank: stage {s} needs the input "
        f"gradient of stage {s + 1}",
        rank,
        Action(s, back_kind, i),
    )


def _list_order_errors(schedule: Schedule, pos: dict, keys: np.ndarray) -> list[np.ndarray]:
    """Per (stage, microbatch) cell in ``keys``, whether each of the four order rules breaks:
    backward before forward, W before I, and (adjacent stages on one rank) the next stage's F
    before this F, this backward before the next stage's."""
    m, n = schedule.num_microbatches, schedule.stages_per_pipeline
    stage = keys // m
    back = np.where(pos[B][keys] >= 0, pos[B][keys], pos[I][keys])
    wrong = [back < pos[F][keys], (pos[W][keys] >= 0) & (pos[W][keys] < back)]
    here = schedule.placement[stage]
    local = stage % n != n - 1
    local &= schedule.placement[np.where(local, stage + 1, stage)] == here
    nxt = np.where(local, keys + m, keys)
    next_back = np.where(pos[B][nxt] >= 0, pos[B][nxt], pos[I][nxt])
    return wrong + [local & (pos[F][nxt] < pos[F][keys]), local & (back < next_back)]
