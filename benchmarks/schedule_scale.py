"""What the schedule layer costs at cluster scale: build, lower, validate and simulate, timed.

Every rank builds, lowers and validates its schedule at start-up, and the overlap pass simulates
candidates, so these costs grow with the cluster. For a ladder of sizes from about 10k to 1M
actions (pp 8 -> 64, vpp 2 -> 8, microbatches 256 -> 1024) and for interleaved-1f1b without and
with overlap, zbv without and with overlap, and dualpipev (its own OVERLAP pairs), each phase is
timed in this process (CPU seconds by default, ``--clock wall`` for elapsed time; the fastest of
``--repeat`` runs, each from a fresh schedule):

- build:    ``build_schedule`` (with ``overlap=True`` this includes the overlap pass);
- lower:    ``lower`` (SEND/RECV placement);
- validate: ``validate`` (every rule, including the deadlock check of the lowered schedule);
- simulate: ``simulate`` under F=1, B=2, W=1 and a 0.25 all-to-all per dispatch and combine.

"actions" counts computations (F, B, I, W; an OVERLAP counts its two halves), so a schedule with
and without overlap have the same count. Per-action cost = total / actions. The last line is
``largest: X.XX s, per_action_us: Y.Y``: the total and per-action cost of the run with the most
actions (the slower one on a tie: interleaved-1f1b with or without overlap at pp 64, vpp 8,
1024 microbatches in the full ladder).

    python benchmarks/schedule_scale.py [--max-actions 200000] [--schedules interleaved-1f1b,zbv]
                                        [--repeat 3] [--clock cpu|wall]

Schedules of 200k+ actions use the compiled loops where numba is installed
(``schedule/timing/loops.py``); it loads them first and prints how long that took (a cost each
process pays once, outside the table). Not part of the test suite; a few minutes up to 1M
actions on a 2-core machine (most of it zbv with overlap at pp 64, whose pass refines its pairs in
about pp rounds).
"""

from __future__ import annotations

import argparse
import gc
import time

from megapipe.schedule import build_schedule, lower, validate
from megapipe.schedule.timing import loops
from megapipe.sim import Costs, simulate

# (pp, vpp, microbatches): interleaved-1f1b holds 2 pp vpp M actions.
SIZES = [(8, 2, 256), (16, 4, 256), (32, 4, 512), (64, 8, 512), (64, 8, 1024)]
# label -> (registry name, overlap, whether vpp applies, estimated actions per pp x M)
VARIANTS = {
    "interleaved-1f1b": ("interleaved-1f1b", False, True, 2),
    "interleaved-1f1b+overlap": ("interleaved-1f1b", True, True, 2),
    "zbv": ("zbv", False, False, 6),
    "zbv+overlap": ("zbv", True, False, 6),
    "dualpipev+overlap": ("dualpipev", True, False, 5),
}
COSTS = Costs(1.0, 2.0, 1.0, dispatch=0.25, combine=0.25, moe_layers=1)
PHASES = ("build", "lower", "validate", "simulate")


def estimated_actions(variant: str, pp: int, vpp: int, m: int) -> int:
    _, _, uses_vpp, per = VARIANTS[variant]
    return per * pp * m * (vpp if uses_vpp else 1)


def count_actions(schedule) -> int:
    if not hasattr(schedule, "table"):  # the schedule layer before issue 17, for comparison
        return sum(len(a.computations()) for row in schedule.actions for a in row)
    return len(schedule.table.comps().kind)


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def run_once(variant: str, pp: int, vpp: int, m: int, clock) -> tuple[dict, object]:
    """Seconds of each phase, one after the other, from a fresh schedule."""
    name, overlap, uses_vpp, _ = VARIANTS[variant]
    times = {}
    gc.collect()
    start = clock()
    schedule = build_schedule(name, pp, m, vpp=vpp if uses_vpp else 2, overlap=overlap)
    times["build"] = clock() - start
    start = clock()
    lower(schedule)
    times["lower"] = clock() - start
    start = clock()
    validate(schedule)
    times["validate"] = clock() - start
    start = clock()
    simulate(schedule, COSTS)
    times["simulate"] = clock() - start
    return times, schedule


def measure(variant: str, pp: int, vpp: int, m: int, repeat: int, clock) -> dict:
    """The fastest of ``repeat`` runs (the machine may be shared)."""
    runs = [run_once(variant, pp, vpp, m, clock) for _ in range(repeat)]
    times, schedule = min(runs, key=lambda run: sum(run[0].values()))
    actions = count_actions(schedule)
    total = sum(times.values())
    _, _, uses_vpp, _ = VARIANTS[variant]
    return {"variant": variant, "pp": pp, "vpp": vpp if uses_vpp else 2, "m": m,
            "actions": actions, "total": total, "per_action_us": total / actions * 1e6, **times}


def parse_sizes(text: str) -> list[tuple[int, int, int]]:
    """``"8x2x256,16x4x256"`` -> [(8, 2, 256), (16, 4, 256)]."""
    return [tuple(int(v) for v in part.split("x")) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-actions", type=int, default=1_100_000,
                        help="skip sizes estimated above this many actions (default: all)")
    parser.add_argument("--schedules", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {', '.join(VARIANTS)}")
    parser.add_argument("--sizes", type=parse_sizes, default=SIZES,
                        help="comma-separated PPxVPPxM (default: the 10k -> 1M ladder)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per size; the fastest is shown (default 3)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                        help="cpu: this process's CPU time (default: steady on a shared "
                             "machine, the wall time of an idle one); wall: elapsed time")
    args = parser.parse_args()
    variants = [v for v in args.schedules.split(",") if v]
    for variant in variants:
        if variant not in VARIANTS:
            parser.error(f"unknown schedule {variant!r}; choose from {', '.join(VARIANTS)}")
    began = time.perf_counter()
    if loops.warm_up():
        print(f"compiled loops (numba): loaded in {time.perf_counter() - began:.2f} s (once per "
              f"process; compiled the first time on a machine), used from "
              f"{loops.COMPILED_FROM_ACTIONS} actions")
    else:
        print("compiled loops: not used (numba not installed, or MEGAPIPE_NO_NUMBA=1): the loops "
              "run in Python")
    header = (f"{'schedule':<26}{'pp':>4}{'vpp':>4}{'M':>6}{'actions':>10}"
              + "".join(f"{p:>10}" for p in PHASES) + f"{'total':>9}{'us/act':>8}")
    print(header)
    rows = []
    for pp, vpp, m in args.sizes:
        for variant in variants:
            if estimated_actions(variant, pp, vpp, m) > args.max_actions:
                continue
            row = measure(variant, pp, vpp, m, args.repeat, CLOCKS[args.clock])
            rows.append(row)
            print(f"{variant:<26}{pp:>4}{row['vpp']:>4}{m:>6}{row['actions']:>10}"
                  + "".join(f"{row[p]:>10.3f}" for p in PHASES)
                  + f"{row['total']:>9.2f}{row['per_action_us']:>8.1f}", flush=True)
    if not rows:
        parser.error("no size fits under --max-actions")
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant]
        if len(mine) > 1:
            low, high = mine[0], mine[-1]
            print(f"{variant}: per-action cost x{high['per_action_us'] / low['per_action_us']:.2f}"
                  f" from {low['actions']} to {high['actions']} actions")
    largest = max(rows, key=lambda r: (r["actions"], r["total"]))
    print(f"largest: {largest['total']:.2f} s, per_action_us: {largest['per_action_us']:.1f}")


if __name__ == "__main__":
    main()
