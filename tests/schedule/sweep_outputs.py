"""Everything the schedule layer outputs for one request, reduced to a short digest.

The golden file ``golden_sweep.txt`` holds, for every registry schedule and every pp 1-8,
microbatches 1-24, vpp 1-3 and overlap off/on, the digest of: the schedule's text (or the error
that refuses the request), its timeline, its lowered text, ``validate``'s verdict, the simulated
metrics and timeline under two cost models (one with dyadic costs, one with costs like 0.3 that
round), and the errors ``validate``, ``simulate``, ``lower``, ``check_batches`` and
``apply_overlap``
raise on a few perturbed copies (an action swapped, dropped, duplicated, moved, renumbered). The
file was written by the schedule layer as it was before issue 17 made it fast; the test holds the
fast layer to the same outputs.

Regenerate (only when an output is meant to change): ``python tests/schedule/sweep_outputs.py``.
"""

from __future__ import annotations

import hashlib
import random
import sys
import zlib
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from megapipe.schedule import (
    ScheduleError,
    apply_overlap,
    build_schedule,
    check_batches,
    lower,
    validate,
)
from megapipe.schedule.ir import COMM_KINDS, Action, Kind, Schedule
from megapipe.schedule.timing.timeline import timeline
from megapipe.sim.costs import Costs
from megapipe.sim.simulate import simulate

GOLDEN = Path(__file__).with_name("golden_sweep.txt")
NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb1p", "zbv", "dualpipev", "dualpipe")
PPS = range(1, 9)
VPPS = range(1, 4)
MICROBATCHES = range(1, 25)
DIGEST_CHARS = 8

DYADIC = Costs(1.0, 2.0, 0.5, p2p_latency=0.25, dispatch=0.25, combine=0.125, moe_layers=2)


def rounding_costs(num_stages: int) -> Costs:
    """Costs whose sums round (0.1, 0.3, ...), with per-stage multipliers."""
    return Costs(
        1.1,
        2.3,
        0.7,
        p2p_latency=0.1,
        dispatch=0.3,
        combine=0.2,
        moe_layers=2,
        attention_share=0.4,
        stage_multipliers=tuple(1.0 + 0.1 * (s % 3) for s in range(num_stages)),
    )


def groups() -> Iterator[tuple[str, int, int, bool]]:
    """(name, pp, vpp, overlap): one line of the golden file each."""
    for name in NAMES:
        for pp in PPS:
            for vpp in VPPS:
                for overlap in (False, True):
                    yield name, pp, vpp, overlap


def group_key(name: str, pp: int, vpp: int, overlap: bool) -> str:
    return f"{name} pp={pp} vpp={vpp} overlap={int(overlap)}"


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _attempt(fn, *args) -> str:
    """'ok: <what fn returned, as text>' or the error it raised."""
    try:
        return f"ok: {fn(*args)}"
    except Exception as err:  # noqa: BLE001 - every error is part of the output
        return _error(err)


def _options_text(schedule) -> str:
    """The options stated, sorted by name, written as the dict of options they were once."""
    return repr(sorted((k, v) for k, v in asdict(schedule.options).items() if v is not None))


def _timeline_text(schedule: Schedule) -> str:
    run = timeline(schedule)
    return f"{run.start}|{run.end}|{run.stuck}|{sorted(run.made.items())}"


def _sim_text(schedule: Schedule, costs: Costs) -> str:
    result = simulate(schedule, costs)
    parts = [
        repr((result.makespan, result.busy, result.comm, result.exposed_comm,
              result.peak_in_flight, result.bubble)),
        result.summary(),
    ]
    for timed in result.timeline:
        parts.append(f"{timed.rank} {timed.action} {timed.start!r} {timed.end!r}")
        for half in timed.halves:
            parts.append(f" {half.action} {half.start!r} {half.end!r}")
        for seg in timed.segments:
            parts.append(
                f" {seg.stream} {seg.part} {seg.action} {seg.layer} {seg.start!r} {seg.end!r}"
            )
    return "\n".join(parts)


def _overlap_text(schedule: Schedule) -> str:
    return apply_overlap(schedule).to_text()


def _validate_text(schedule: Schedule) -> str:
    validate(schedule)
    return "valid"


def _check_runs_text(schedule: Schedule) -> str:
    check_batches(schedule)
    return "runs"


def _lower_text(schedule: Schedule) -> str:
    return lower(schedule).to_text()


def _perturbed(rows: list[list[Action]], rng: random.Random, how: str, m: int):
    """A copy of ``rows`` with one change; None when the change is impossible."""
    rows = [list(r) for r in rows]
    ranks = [r for r, row in enumerate(rows) if len(row) >= 2]
    if not ranks:
        return None
    rank = rng.choice(ranks)
    row = rows[rank]
    i = rng.randrange(len(row) - 1)
    if how == "swap":
        row[i], row[i + 1] = row[i + 1], row[i]
    elif how == "drop":
        del row[i]
    elif how == "dup":
        row.insert(rng.randrange(i + 1, len(row) + 1), row[i])
    elif how == "move" and len(rows) > 1:
        action = row.pop(i)
        other = rows[(rank + 1) % len(rows)]
        other.insert(min(i, len(other)), action)
    elif how == "renumber":
        plain = [k for k, a in enumerate(row) if a.kind is not Kind.OVERLAP]
        if not plain:
            return None
        k = rng.choice(plain)
        a = row[k]
        row[k] = Action(a.stage, a.kind, (a.microbatch + 1) % (m + 1))
    elif how == "kind":
        plain = [k for k, a in enumerate(row) if a.kind in (Kind.F, Kind.B, Kind.I, Kind.W)]
        if not plain:
            return None
        k = rng.choice(plain)
        a = row[k]
        swap = {Kind.F: Kind.B, Kind.B: Kind.I, Kind.I: Kind.W, Kind.W: Kind.F}
        row[k] = Action(a.stage, swap[a.kind], a.microbatch)
    else:
        return None
    return rows


def _perturbations(schedule: Schedule, lowered: Schedule | None, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for how in ("swap", "drop", "dup", "move", "renumber", "kind"):
        rows = _perturbed(schedule.actions, rng, how, schedule.num_microbatches)
        if rows is None:
            continue
        broken = schedule.replace_actions(rows)
        out.append(f"{how}: {_attempt(_validate_text, broken)}")
        out.append(f"{how} sim: {_attempt(_sim_text, broken, Costs())}")
        if not any(a.kind in COMM_KINDS for row in rows for a in row):
            out.append(f"{how} lower: {_attempt(_lower_text, broken)}")
            out.append(f"{how} overlap: {_attempt(_overlap_text, broken)}")
    if lowered is not None and any(a.kind in COMM_KINDS for row in lowered.actions for a in row):
        for how in ("swap", "drop", "dup", "move"):
            rows = _perturbed(lowered.actions, rng, how, lowered.num_microbatches)
            if rows is None:
                continue
            broken = lowered.replace_actions(rows)
            out.append(f"lowered {how}: {_attempt(_check_runs_text, broken)}")
            out.append(f"lowered {how} validate: {_attempt(_validate_text, broken)}")
    return out


def outputs(name: str, pp: int, m: int, vpp: int, overlap: bool, perturb: bool = True) -> str:
    """Every output of one request, as text (the digest is taken of this)."""
    try:
        schedule = build_schedule(name, pp, m, vpp=vpp, overlap=overlap)
    except ScheduleError as err:
        return "refused: " + _error(err)
    parts = [schedule.to_text(), _options_text(schedule), _timeline_text(schedule)]
    lowered_text = _attempt(_lower_text, schedule)
    parts.append(lowered_text)
    parts.append(_attempt(_validate_text, schedule))
    parts.append(_attempt(_sim_text, schedule, DYADIC))
    parts.append(_attempt(_sim_text, schedule, rounding_costs(schedule.num_stages)))
    if perturb:
        lowered = lower(schedule) if lowered_text.startswith("ok") else None
        seed = zlib.crc32(f"{name} {pp} {m} {vpp} {overlap}".encode())
        parts += _perturbations(schedule, lowered, seed)
    return "\n".join(parts)


def digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()[:DIGEST_CHARS]


def group_digests(
    name: str, pp: int, vpp: int, overlap: bool, microbatches=MICROBATCHES
) -> list[str]:
    return [digest(outputs(name, pp, m, vpp, overlap)) for m in microbatches]


def read_golden() -> dict[str, list[str]]:
    table = {}
    for line in GOLDEN.read_text().splitlines():
        if line and not line.startswith("#"):
            key, values = line.split(": ")
            table[key] = values.split()
    return table


def main() -> None:
    lines = [
        "# Digests of every schedule-layer output per request (tests/schedule/sweep_outputs.py);",
        "# one line per (schedule, pp, vpp, overlap), one digest per microbatch count 1..24.",
    ]
    for group in groups():
        lines.append(f"{group_key(*group)}: {' '.join(group_digests(*group))}")
        print(lines[-1][:60], file=sys.stderr)
    GOLDEN.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
