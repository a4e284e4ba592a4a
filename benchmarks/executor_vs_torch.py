"""megapipe's executor against torch.distributed.pipelining: same model, same schedule, A/B.

Four gloo processes on CPU build the same MoE GPT split into the same stages twice (identical
weights): once run by ``megapipe.PipelineExecutor``, once by torch's ``PipelineStage`` and
schedule class. For each schedule (1f1b, interleaved-1f1b, zbv, dualpipev) the two take turns,
step by step (the order flips every round, so drift in machine load hits both alike). The ratio
megapipe / torch of a schedule is the median over rounds of the two steps' wall-time ratio; the
CPU ratio (CPU seconds of all ranks per step) is printed beside it, as it is less sensitive to
other load on the machine. A ratio below 1.00 means megapipe is faster. The last line is
``ratio_max: X.XX`` (the worst schedule's wall-time ratio).

    python benchmarks/executor_vs_torch.py [--rounds 16] [--microbatches 8] [--tape]

Not part of the test suite; it takes about two minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spawn_ranks import run_ranks

PP = 4
SCHEDULES = {  # megapipe name -> (torch class name, stages per rank)
    "1f1b": ("Schedule1F1B", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
    "zbv": ("ScheduleZBVZeroBubble", 2),
    "dualpipev": ("ScheduleDualPipeV", 2),
}


@dataclass(frozen=True)
class Settings:
    rounds: int
    microbatches: int
    micro_batch: int
    hidden: int
    layers: int
    seq: int
    use_tape: bool


def _model_config(s: Settings):
    from megapipe.models.config import GPTConfig

    return GPTConfig(
        vocab_size=256,
        hidden_size=s.hidden,
        num_layers=s.layers,
        num_heads=4,
        seq_length=s.seq,
        ffn_hidden_size=2 * s.hidden,
        num_experts=4,
        moe_top_k=2,
        moe_ffn_hidden_size=s.hidden,
        first_k_dense_layers=1,
    )


def _batches(s: Settings, config, step: int):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(
        0, config.vocab_size, (s.microbatches * s.micro_batch, s.seq + 1), generator=g
    )
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _worker(rank: int, s: Settings, out) -> None:
    dist.init_process_group("gloo")  # run_ranks set torchrun's variables, one thread per rank
    import torch.distributed.pipelining as tp

    from megapipe import ExecutorOptions, PipelineExecutor, TensorSpec
    from megapipe.models.gpt import gpt_loss
    from megapipe.models.split import build_stage
    from megapipe.schedule import build_schedule

    config = _model_config(s)
    megapipe_group = dist.new_group(list(range(PP)))
    torch_group = dist.new_group(list(range(PP)))
    lines = []
    worst = 0.0
    for name, (torch_class, per_rank) in SCHEDULES.items():
        schedule = build_schedule(name, PP, s.microbatches, vpp=per_rank)
        stage_ids = schedule.stages_of_rank(rank)
        parts = schedule.num_stages

        def stages():
            return {i: build_stage(config, i, parts) for i in stage_ids}

        ours = stages()
        executor = PipelineExecutor(
            schedule, ours,
            ExecutorOptions(spec=TensorSpec((s.micro_batch, s.seq, s.hidden)), loss_fn=gpt_loss,
                            pp_group=megapipe_group, use_tape=s.use_tape),
        )
        theirs = stages()
        torch_stages = [
            tp.PipelineStage(theirs[i], i, parts, torch.device("cpu"), group=torch_group)
            for i in stage_ids
        ]
        cls = getattr(tp, torch_class)
        torch_schedule = cls(
            torch_stages[0] if per_rank == 1 else torch_stages, s.microbatches, loss_fn=gpt_loss
        )
        holds_first = any(schedule.is_first_stage(i) for i in stage_ids)
        holds_last = any(schedule.is_last_stage(i) for i in stage_ids)

        def run_megapipe(step: int) -> None:
            tokens, labels = _batches(s, config, step)
            inputs = list(tokens.chunk(s.microbatches)) if holds_first else None
            targets = list(labels.chunk(s.microbatches)) if holds_last else None
            executor.step(inputs, targets)
            for module in ours.values():
                module.zero_grad(set_to_none=True)

        def run_torch(step: int) -> None:
            tokens, labels = _batches(s, config, step)
            args = (tokens,) if holds_first else ()
            torch_schedule.step(*args, target=labels if holds_last else None)
            for module in theirs.values():
                module.zero_grad(set_to_none=True)

        def timed(fn, step: int) -> tuple[float, float]:
            """Wall time of one step (between barriers) and the CPU time all ranks spent."""
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            fn(step)
            cpu = torch.tensor([time.process_time() - cpu])
            dist.barrier()
            wall = time.perf_counter() - start
            dist.all_reduce(cpu)
            return wall, cpu.item()

        for warmup in range(2):
            run_megapipe(warmup)
            run_torch(warmup)
        wall = {"megapipe": [], "torch": []}
        cpu = {"megapipe": [], "torch": []}
        for r in range(s.rounds):
            order = [("megapipe", run_megapipe), ("torch", run_torch)]
            for label, fn in order if r % 2 == 0 else order[::-1]:
                w, c = timed(fn, r)
                wall[label].append(w)
                cpu[label].append(c)
        # the two steps of a round ran back to back: their ratio cancels slow drifts in load
        ratio = statistics.median(m / t for m, t in zip(wall["megapipe"], wall["torch"]))
        cpu_ratio = statistics.median(m / t for m, t in zip(cpu["megapipe"], cpu["torch"]))
        m, t = statistics.median(wall["megapipe"]), statistics.median(wall["torch"])
        worst = max(worst, ratio)
        lines.append(
            f"{name:<17} megapipe {m * 1e3:7.1f} ms   torch {t * 1e3:7.1f} ms   "
            f"ratio {ratio:.2f}   (cpu ratio {cpu_ratio:.2f})"
        )
    dist.barrier()
    if rank == 0:
        out.put((lines, worst))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument(
        "--tape", action="store_true",
        help="run every megapipe microbatch node by node on the tape (default: plain autograd, "
        "as these schedules have no OVERLAP actions)",
    )
    a = parser.parse_args(argv)
    settings = Settings(
        a.rounds, a.microbatches, a.micro_batch, a.hidden, a.layers, a.seq,
        a.tape,
    )
    lines, worst = run_ranks(_worker, PP, settings)
    print(
        f"gloo, CPU, {PP} processes, {settings.microbatches} microbatches of {settings.micro_batch}"
        f"x{settings.seq} tokens, hidden {settings.hidden}, {settings.layers} layers"
        " (MoE, 4 experts)"
    )
    for line in lines:
        print(line)
    print(f"ratio_max: {worst:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
