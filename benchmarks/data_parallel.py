"""Data parallelism: the gradient reduction after the step beside overlapped, and the optimizer
state the distributed optimizer saves.

Four gloo processes on CPU (one thread each) build, on the same model and data, two jobs of the
demo's layout (pp = 2, vpp = 2, dp = 2, ep = 2, overlap of the all-to-all on):

- A, *after the step*: ``--use-distributed-optimizer`` (each stage's gradients reduce-scattered
  once the step's last action has run, the updated weights all-gathered right after the step);
- B, *overlapped*: ``--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --ddp-bucket-size N`` (each bucket reduced as soon as the backward has finished it, the
  weights gathered behind the next step's forwards).

They take turns step by step, the order flipping every round, and every step traces its DP
collectives (``DataParallelSync.trace``). Per job it prints the median step time (the slowest
rank's), the time of the gradient reductions and of the parameter gathers on the DP stream, and
their *exposed* share: the part the compute stream waited for (summed over ranks). gloo on one
machine moves gradients by memcpy on the same two cores the ranks compute on, so the DP
collectives run over an EMULATED link (``--dp-emulated-link-gbps``: after the real collective
the DP stream's thread sleeps out its ring traffic's time), chosen so that the reduction is a
visible share of A's step; the model is widened (hidden 192) for the same reason. The last line
is ``speedup: X.XX`` (A's step / B's).

Memory: the optimizer state on every rank (AdamW's moments and step counters) of the plain run
(AdamW on every parameter, no flags) beside B's (sharded), and their ratio; dense parameters are
sharded over dp, experts over expert-dp (dp / ep).

    python benchmarks/data_parallel.py [--rounds 8] [--dp-link-gbps 0.01] [--bucket 20000]
                                       [-- PRETRAIN FLAGS]

Not part of the test suite; about two minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.overlap.node_trace import NodeTrace
from megapipe.train.checkpoint.state import ensure_optimizer_state
from megapipe.train.config.parse import parse_pretrain_args
from megapipe.train.job import build_job
from megapipe.train.optim.adamw import optimizer_state_bytes
from megapipe.train.step import train_step
from spawn_ranks import run_ranks

WORLD = 4
MODEL = ["--hidden-size", "192", "--ffn-hidden-size", "384", "--moe-ffn-hidden-size", "192",
         "--num-layers", "4", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "16", "--eval-interval", "0", "--train-iters", "1000",
         "--lr-warmup-iters", "1", "--nproc", "4"]


@dataclass(frozen=True)
class Settings:
    rounds: int
    warmup: int
    link_gbps: float
    bucket: int
    flags: tuple[str, ...]

    def jobs(self) -> dict[str, list[str]]:
        base = MODEL + list(self.flags) + ["--use-distributed-optimizer",
                                           "--dp-emulated-link-gbps", str(self.link_gbps)]
        return {
            "after the step": base,
            "overlapped": base + ["--overlap-grad-reduce", "--overlap-param-gather",
                                  "--ddp-bucket-size", str(self.bucket)],
        }


def _dp_figures(trace: NodeTrace) -> dict[str, float]:
    """Seconds of reductions (R) and gathers (G) on the DP stream, and of the compute stream's
    waits for each."""
    out = {"R": 0.0, "G": 0.0, "wait R": 0.0, "wait G": 0.0}
    for span in trace.spans:
        if span.kind == "dp":
            out[span.direction] += span.duration
        elif span.kind == "dp_wait":
            out[f"wait {span.direction}"] += span.duration
    return out


def _state_bytes(flags: list[str]) -> int:
    """This rank's optimizer state in the job ``flags`` build (a torch AdamW's as at its first
    step)."""
    job = build_job(parse_pretrain_args(flags, env={}))
    ensure_optimizer_state(job.optimizer)
    try:
        return optimizer_state_bytes(job.optimizer)
    finally:
        job.close()


def _worker(rank: int, settings: Settings, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    memory = []
    for ep in ("2", "1"):  # experts sharded over expert-dp = dp / ep
        flags = MODEL + list(settings.flags) + ["--expert-model-parallel-size", ep]
        memory.append([_state_bytes(flags), _state_bytes(flags + ["--use-distributed-optimizer"])])
    jobs = {name: build_job(parse_pretrain_args(flags, env={}))
            for name, flags in settings.jobs().items()}
    names = list(jobs)
    steps: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(settings.warmup + settings.rounds):
        if round_ == settings.warmup:
            for job in jobs.values():  # one trace over all measured steps: no span is cut
                job.dp_sync.finish_param_gather()
                job.dp_sync.trace = NodeTrace()
        for name in names if round_ % 2 == 0 else names[::-1]:
            job = jobs[name]
            dist.barrier()
            start = time.perf_counter()
            train_step(job, job.batches.next_batch(), round_ + 1)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if round_ >= settings.warmup:
                steps[name].append(float(took))
    dp = {}
    for name, job in jobs.items():
        job.dp_sync.finish_param_gather()
        figures = _dp_figures(job.dp_sync.trace)
        total = torch.tensor([figures[k] for k in ("R", "G", "wait R", "wait G")],
                             dtype=torch.float64) / settings.rounds
        dist.all_reduce(total)
        dp[name] = total.tolist()
        job.close()
    sizes = torch.tensor(memory, dtype=torch.float64)
    everyone = [torch.zeros_like(sizes) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, sizes)
    if rank == 0:
        out.put({"steps": steps, "dp": dp, "memory": [e.tolist() for e in everyone]})
    dist.destroy_process_group()


def _print(report: dict, settings: Settings) -> None:
    print(f"data parallelism on CPU: {WORLD} gloo ranks, pp 2 x dp 2 (ep 2), vpp 2, "
          f"interleaved-1f1b with the all-to-all overlap; emulated DP link "
          f"{settings.link_gbps:g} GB/s; buckets of {settings.bucket} elements in B; "
          f"{settings.rounds} measured rounds")
    print(f"{'':16} {'step ms':>9} {'reduce ms':>10} {'exposed':>8} {'gather ms':>10} "
          f"{'exposed':>8}")
    medians = {}
    for name, times in report["steps"].items():
        reduce_, gather, wait_r, wait_g = report["dp"][name]
        medians[name] = statistics.median(times)
        print(f"{name:16} {medians[name] * 1e3:9.1f} {reduce_ * 1e3 / WORLD:10.1f} "
              f"{wait_r / reduce_ if reduce_ else 0:8.0%} {gather * 1e3 / WORLD:10.1f} "
              f"{wait_g / gather if gather else 0:8.0%}")
    print("(reduce / gather ms: per rank and step on the DP stream; exposed: the share of it "
          "the compute stream waited for)")
    for index, ep in enumerate((2, 1)):
        plain = [rank[index][0] for rank in report["memory"]]
        sharded = [rank[index][1] for rank in report["memory"]]
        print(f"optimizer state per rank, ep {ep} (experts over expert-dp {2 // ep}), MiB: "
              + ", ".join(f"{p / 2**20:.2f} -> {s / 2**20:.2f}"
                          for p, s in zip(plain, sharded))
              + f"; all ranks {sum(sharded) / sum(plain):.2f} of AdamW on every parameter")
    after, overlapped = medians.values()
    print(f"speedup: {after / overlapped:.2f}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dp-link-gbps", type=float, default=0.01)
    parser.add_argument("--bucket", type=int, default=20_000)
    args = parser.parse_args(argv)
    settings = Settings(args.rounds, args.warmup, args.dp_link_gbps, args.bucket, tuple(extra))
    _print(run_ranks(_worker, WORLD, settings), settings)


if __name__ == "__main__":
    main()
