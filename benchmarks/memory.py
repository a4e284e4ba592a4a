"""Activation memory of every schedule, plain beside combined, on the demo model; and the
simulated speed the combined schedule buys at each overlap budget.

Four gloo processes on CPU (one thread each) build the default ``megapipe pretrain`` job (the
demo model: pp = 2, dp = 2, ep = 2, 4 microbatches; vpp 1 for gpipe and 1f1b, else 2) once per
schedule name and variant, and run one training step with the activation meter on
(``measure_activations``). Per schedule it prints, each the largest over ranks:

- peak in flight: the most microbatch-stages a rank holds at once in the schedule the job ran
  (``schedule.overlap_pass.in_flight.peak_in_flight``: a pair holds its backward's microbatch-stage
  while its forward runs, the count the overlap budget K caps), plain and combined;
- act MiB: the peak bytes saved for backward or held by the pipeline (``activation_bytes``,
  ``pipeline/activation_meter.py``), plain and combined, and their ratio;
- the simulated makespan of the combined schedule at every overlap budget K = 0..pp and
  unbounded (``megapipe schedule --overlap``, ``sim/budget_sweep.py``), relative to the plain
  schedule, with ``--costs`` (default F,B,W,A2A = 1,2,1,0.5 per stage).

The measured run uses the unbounded pass (pretrain's default); its peak in flight matches the
``unbounded`` budget. One run prints the whole table (about a minute on 2 cores):

    python benchmarks/memory.py [--schedules NAME,NAME] [--costs F,B,W[,A2A]] [-- PRETRAIN FLAGS]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.schedule.overlap_pass.in_flight import peak_in_flight
from megapipe.schedule.registry import SCHEDULES
from megapipe.sim.budget_sweep import budget_sweep
from megapipe.sim.costs import Costs
from megapipe.train.config.parse import parse_pretrain_args
from megapipe.train.job import build_job
from megapipe.train.step import to_device
from spawn_ranks import run_ranks

WORLD = 4
ONE_STAGE_PER_RANK = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Settings:
    schedules: tuple[str, ...]
    flags: tuple[str, ...]  # extra pretrain flags (the demo model's by default: none)


def pretrain_flags(schedule: str, overlap: bool, flags: tuple[str, ...] = ()) -> list[str]:
    """The pretrain flags of one measured run: ``schedule``, plain or combined, measured."""
    argv = [*flags, "--pipeline-schedule", schedule, "--train-iters", "1",
            "--log-activation-memory"]
    if schedule in ONE_STAGE_PER_RANK:
        argv += ["--virtual-pipeline-model-parallel-size", "1"]
    if not overlap:
        argv.append("--no-overlap-moe-expert-parallel-comm")
    return argv


def measure(schedule: str, overlap: bool, flags: tuple[str, ...] = ()) -> dict:
    """On every rank (default group up): one measured training step of the pretrain job; the
    largest rank's activation bytes and peak in flight, and the job's shape."""
    job = build_job(parse_pretrain_args(pretrain_flags(schedule, overlap, flags), env={}))
    tokens, labels = to_device(job.batches.next_batch(), job.device)
    with job.executor:
        step = job.executor.step(tokens, labels)
    assert step.activation_bytes is not None
    peak = torch.tensor([step.activation_bytes], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    schedule = job.schedule
    return {
        "in_flight": max(peak_in_flight(schedule.row(r)) for r in range(schedule.pp)),
        "bytes": int(peak[0]), "pp": job.schedule.pp,
        "vpp": job.schedule.options.vpp,
        "microbatches": job.schedule.num_microbatches,
    }


def _worker(rank: int, s: Settings, out) -> None:
    dist.init_process_group("gloo")  # run_ranks set torchrun's variables, one thread per rank
    results = {
        name: {label: measure(name, label == "combined", s.flags)
               for label in ("plain", "combined")}
        for name in s.schedules
    }
    dist.barrier()
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def format_table(results: dict, costs: Costs) -> str:
    """One row per schedule: peak in flight and MiB plain / combined, their ratio, and the
    simulated makespan at each budget relative to plain."""
    first = next(iter(results.values()))["plain"]
    budgets = [*(str(k) for k in range(first["pp"] + 1)), "inf"]
    lines = [
        f"{'':<26}{'peak in flight':>15}  {'activation MiB':>23}  simulated makespan / plain",
        f"{'schedule':<22}{'vpp':>4}{'plain':>8}{'comb':>7}  {'plain':>8}{'comb':>8}{'ratio':>7}  "
        + "".join(f"{'K=' + k:>7}" for k in budgets),
    ]
    for name, runs in results.items():
        plain, combined = runs["plain"], runs["combined"]
        options = {} if name in ONE_STAGE_PER_RANK else {"vpp": plain["vpp"]}
        plain_point, points = budget_sweep(name, plain["pp"], plain["microbatches"], costs,
                                           **options)
        lines.append(
            f"{name:<22}{plain['vpp']:>4}{plain['in_flight']:>8}{combined['in_flight']:>7}  "
            f"{plain['bytes'] / 2**20:>8.2f}{combined['bytes'] / 2**20:>8.2f}"
            f"{combined['bytes'] / plain['bytes']:>7.2f}  "
            + "".join(f"{p.makespan / plain_point.makespan:>7.3f}" for p in points)
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated names")
    p.add_argument("--costs", default="1,2,1,0.5", help="F,B,W[,A2A] per stage, simulated")
    args = p.parse_args(argv[:split])
    names = tuple(n for n in args.schedules.split(",") if n)
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown or not names:
        p.error(f"--schedules must name some of {', '.join(SCHEDULES)}, got {unknown or names}")
    costs = Costs.from_text(args.costs)
    flags = tuple(argv[split + 1:])
    results = run_ranks(_worker, WORLD, Settings(names, flags))
    model = " ".join(("megapipe pretrain defaults", *flags))
    print(f"demo model ({model}), one step, largest rank; simulated with costs {args.costs}")
    print(format_table(results, costs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
