"""The combined step's speedup: the same pipeline without and with the EP all-to-all overlap.

Four gloo processes on CPU (one thread each): pp = 2, dp = 2, ep = 2, a small MoE GPT. gloo on
one machine moves tokens almost for free, so the all-to-all runs over an EMULATED link
(``EmulatedLink``: after the real exchange the communication thread sleeps for the rest of the
modelled time). The link is set from a measurement: a traced warm-up step gives the mean time
of an experts node (forward and backward), and the link's latency is chosen so that one
all-to-all takes about as long.

Per schedule family (``interleaved-1f1b`` with vpp = 2, and ``dualpipev``) the plain schedule
and its combined variant (``overlap=True``) take turns step by step, the order flipping every
round; torch.distributed.pipelining's ``ScheduleDualPipeV`` runs the same model over the same
link beside dualpipev (torch runs the F and B of its OVERLAP actions one after the other). The
speedup of a family is the median over rounds of plain step time / combined step time; the
exposed-communication fraction (all-to-all time during which no compute ran, from the stream
trace of the combined run) is the median over rounds on rank 0. The ceiling beside each speedup
is the best any overlap could reach on this machine: the combined run still has the plain run's
CPU work to do on min(cores, ranks) cores, and each rank still waits out the link's modelled time
of all its all-to-alls one after another. Were a plain step nothing but compute and link waits,
4 ranks on 2 cores could not gain more than 1.5 whatever the link: a rank computing for a share
c of the plain step keeps 4c / 2 cores busy, and overlap still needs max(4c / 2, 1 - c) of the
plain step, at least 1 / 1.5 of it (at c = 1/3); the measured ceiling also credits overlap with
removing every idle wait of the plain run, so it can come out a little higher. ``--pp 1`` runs the
same model without pipelining on 2 ranks (a core
each, no DualPipeV). The last line is ``speedup: X.XX`` for interleaved-1f1b (``1f1b`` with
``--pp 1``).

    python benchmarks/overlap.py [--pp 1] [--rounds 8] [--microbatches 8]

``--replay PROFILE.json`` runs the replay mode instead (``overlap_replay.py``): every node of
the real engine lasts its time in a node-time profile, beside the simulator's prediction.

Not part of the test suite; about three minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spawn_ranks import run_ranks

DP = EP = 2
# pp -> {schedule: stages per rank}; the first is the headline (the last line's speedup)
FAMILIES = {
    2: {"interleaved-1f1b": 2, "dualpipev": 2},
    1: {"1f1b": 1},  # no pipelining: Megatron's combined_1f1b_schedule_for_no_pipelining
}


@dataclass(frozen=True)
class Settings:
    pp: int
    rounds: int
    microbatches: int
    micro_batch: int
    seq: int
    hidden: int
    expert_hidden: int
    layers: int
    link_scale: float
    delay_wgrad: bool = False
    a2a_waves: int = 1


def _config(s: Settings, link=None):
    from megapipe.models.config import GPTConfig

    return GPTConfig(
        vocab_size=256, hidden_size=s.hidden, num_layers=s.layers, num_heads=4,
        seq_length=s.seq, ffn_hidden_size=2 * s.hidden, num_experts=4, moe_top_k=2,
        moe_ffn_hidden_size=s.expert_hidden, first_k_dense_layers=0, moe_link=link,
    )


def _even_stage(config, part: int, num_parts: int, ep_group):
    """Model part ``part`` with an equal share of the layers (the embedding and the head are
    tiny at vocabulary 256), so the two halves of every combined step have as many MoE layers."""
    from megapipe.models.gpt import GPTStage

    if config.num_layers % num_parts:
        raise ValueError(f"--layers {config.num_layers} must be a multiple of {num_parts} parts")
    per = config.num_layers // num_parts
    layers = range(part * per, (part + 1) * per)
    return GPTStage(config, layers, part == 0, part == num_parts - 1, ep_group)


def _batches(s: Settings, config, dp_rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    ids = torch.randint(0, config.vocab_size, (s.microbatches * s.micro_batch, s.seq + 1),
                        generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


class _Runs:
    """This rank's pipelines of one family: megapipe plain, megapipe combined, (torch)."""

    def __init__(self, s: Settings, config, groups, name: str, per_rank: int, with_torch: bool):
        from megapipe import ExecutorOptions, PipelineExecutor, TensorSpec
        from megapipe.models.gpt import gpt_loss
        from megapipe.schedule import build_schedule

        build_stage = _even_stage
        self.s, self.config, self.groups = s, config, groups
        spec = TensorSpec((s.micro_batch, s.seq, s.hidden))
        self.executors, self.stages = {}, {}
        for label, overlap in (("plain", False), ("overlap", True)):
            schedule = build_schedule(name, s.pp, s.microbatches, vpp=per_rank, overlap=overlap)
            ids = schedule.stages_of_rank(groups.pp_rank)
            stages = {i: build_stage(config, i, schedule.num_stages, groups.ep) for i in ids}
            self.stages[label] = stages
            self.executors[label] = PipelineExecutor(
                schedule, stages, ExecutorOptions(
                    spec=spec, loss_fn=gpt_loss, groups=groups,
                    record_trace=overlap, moe_a2a_waves=s.a2a_waves if overlap else 1,
                    delay_wgrad_compute=s.delay_wgrad and overlap),
            )
        self.schedule = schedule
        self.torch_schedule = None
        if with_torch:
            self._build_torch(name, per_rank, build_stage, gpt_loss)

    def _build_torch(self, name, per_rank, build_stage, gpt_loss) -> None:
        import torch.distributed.pipelining as tp

        s, config, schedule = self.s, self.config, self.schedule
        ids = schedule.stages_of_rank(self.groups.pp_rank)
        theirs = {i: build_stage(config, i, schedule.num_stages, self.groups.ep) for i in ids}
        for module in theirs.values():
            for layer in module.moe_layers():
                layer.aux_loss_scale = 1.0 / s.microbatches
        # shapes are inferred at the first step (it runs the same forward on both EP peers)
        torch_stages = [
            tp.PipelineStage(theirs[i], i, schedule.num_stages, torch.device("cpu"),
                             group=self.groups.pp)
            for i in ids
        ]
        self.stages["torch"] = theirs
        self.torch_schedule = tp.ScheduleDualPipeV(torch_stages, s.microbatches, loss_fn=gpt_loss)

    def step(self, label: str, step: int):
        from megapipe.pipeline.grad_sync import all_reduce_grads

        s, schedule = self.s, self.schedule
        tokens, labels = _batches(s, self.config, self.groups.dp_rank, step)
        stages = self.stages[label]
        first = any(schedule.is_first_stage(i) for i in stages)
        last = any(schedule.is_last_stage(i) for i in stages)
        result = None
        if label == "torch":
            args = (tokens,) if first else ()
            self.torch_schedule.step(*args, target=labels if last else None)
            all_reduce_grads(stages, self.groups)
        else:
            result = self.executors[label].step(
                list(tokens.chunk(s.microbatches)) if first else None,
                list(labels.chunk(s.microbatches)) if last else None,
            )
        for module in stages.values():
            module.zero_grad(set_to_none=True)
        return result

    def close(self) -> None:
        for executor in self.executors.values():
            executor.close()


def _timed(fn, *args):
    """Wall time of one step between barriers, the CPU cores all ranks kept busy on average
    (CPU seconds of every rank / wall; near the machine's core count: CPU-bound), and the
    step's result."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    result = fn(*args)
    cpu = torch.tensor([time.process_time() - cpu])
    dist.barrier()
    wall = time.perf_counter() - start
    dist.all_reduce(cpu)
    return wall, cpu.item() / wall, result


def _pick_link(s: Settings, groups):
    """Latency so that one all-to-all takes about as long as one experts node (measured,
    forward and backward averaged, over a warm-up without the link)."""
    from megapipe.moe.link import EmulatedLink

    name, per_rank = next(iter(FAMILIES[s.pp].items()))
    one_wave = dataclasses.replace(s, a2a_waves=1)  # the same link with or without waves
    runs = _Runs(one_wave, _config(s), groups, name, per_rank, with_torch=False)
    for step in range(2):
        result = runs.step("overlap", step)
    runs.close()
    assert result is not None and result.trace is not None
    spans = result.trace.spans
    experts = [x.duration for x in spans if x.node.endswith("experts") and x.direction in "FB"]
    a2a = [
        x.duration for x in spans if x.kind == "comm" and x.node.endswith(("dispatch", "combine"))
    ]
    measured = torch.tensor([statistics.median(experts), statistics.median(a2a)])
    dist.all_reduce(measured)
    expert_s, a2a_s = (measured / dist.get_world_size()).tolist()
    # bytes are nearly free on this link: the latency carries the modelled time, which
    # includes the real exchange (the link sleeps only for the rest)
    latency = s.link_scale * expert_s
    return EmulatedLink(bandwidth_bytes_per_s=100e9, latency_s=latency), expert_s, a2a_s


def _ceiling(plain_wall: float, plain_cores: float, link_time: float) -> float:
    """The best speedup any overlapped schedule could reach on this machine: it still does the
    plain run's CPU work (CPU seconds of all ranks, spread over at most min(cores, ranks)
    cores: one compute thread per rank) and still waits out the link's modelled time of every
    all-to-all of a rank, one after the other on its comm stream (``link_time``, the largest
    over ranks)."""
    cores = min(os.cpu_count() or 1, dist.get_world_size())
    return plain_wall / max(plain_wall * plain_cores / cores, link_time)


def _worker(rank: int, s: Settings, out) -> None:
    dist.init_process_group("gloo")  # run_ranks set torchrun's variables, one thread per rank
    from megapipe.parallel.config import ParallelConfig
    from megapipe.parallel.groups import create_groups

    groups = create_groups(ParallelConfig(pp=s.pp, dp=DP, ep=EP))
    link, expert_s, a2a_s = _pick_link(s, groups)
    config = _config(s, link)
    lines = [
        f"experts node {expert_s * 1e3:.2f} ms, gloo all-to-all node {a2a_s * 1e3:.2f} ms (medians "
        f"measured without the link) -> {link.describe()}"
    ]
    speedups = {}
    for name, per_rank in FAMILIES[s.pp].items():
        runs = _Runs(s, config, groups, name, per_rank, with_torch=name == "dualpipev")
        labels = ["plain", "overlap"] + (["torch"] if runs.torch_schedule is not None else [])
        for warmup in range(2):
            for label in labels:
                runs.step(label, warmup)
        times = {label: [] for label in labels}
        cores = {label: [] for label in labels}
        exposed, a2a, link_time = [], [], []
        for r in range(s.rounds):
            for label in labels if r % 2 == 0 else labels[::-1]:
                wall, busy, result = _timed(runs.step, label, r)
                times[label].append(wall)
                cores[label].append(busy)
                if label == "overlap":
                    exposed.append(result.exposed_comm_fraction)
                    a2a.append(result.a2a_time)
                    # the link's share of this rank's all-to-alls: each lasts >= the latency
                    comm_nodes = sum(1 for x in result.trace.spans if x.kind == "comm")
                    link_time.append(comm_nodes * link.latency_s)
        runs.close()
        ratio = statistics.median(p / o for p, o in zip(times["plain"], times["overlap"]))
        speedups[name] = ratio
        med = {label: statistics.median(v) * 1e3 for label, v in times.items()}
        busy = {label: statistics.median(v) for label, v in cores.items()}
        slowest_link = torch.tensor([max(link_time)])
        dist.all_reduce(slowest_link, op=dist.ReduceOp.MAX)
        ceiling = _ceiling(med["plain"] / 1e3, busy["plain"], slowest_link.item())
        line = (
            f"{name:<17} no overlap {med['plain']:7.1f} ms ({busy['plain']:.1f} cores busy)   "
            f"overlap {med['overlap']:7.1f} ms ({busy['overlap']:.1f} cores)   "
            f"speedup {ratio:.2f} (ceiling {ceiling:.2f})   exposed a2a "
            f"{statistics.median(exposed):.0%} of {statistics.median(a2a) * 1e3:.0f} ms (rank 0)"
        )
        if "torch" in med:
            torch_ratio = statistics.median(t / o for t, o in zip(times["torch"], times["overlap"]))
            line += (
                f"   torch DualPipeV {med['torch']:7.1f} ms (x{torch_ratio:.2f} megapipe overlap)"
            )
        lines.append(line)
    dist.barrier()
    if rank == 0:
        out.put((lines, speedups))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a == "--replay" or a.startswith("--replay=") for a in args):
        from overlap_replay import main as replay_main  # the replay mode: its own options

        return replay_main(args)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, choices=sorted(FAMILIES), default=2,
                        help="pipeline stages (ranks = pp x 2: dp = ep = 2)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--expert-hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--link-scale", type=float, default=1.0,
                        help="all-to-all time as a multiple of the measured experts node time")
    parser.add_argument("--a2a-waves", type=int, default=1,
                        help="the combined run's MoE all-to-alls in this many expert groups "
                        "(moe_a2a_waves; each wave pays the link's latency)")
    parser.add_argument("--delay-wgrad", action="store_true",
                        help="the combined run defers expert weight gradients "
                        "(delay_wgrad_compute)")
    a = parser.parse_args(argv)
    s = Settings(a.pp, a.rounds, a.microbatches, a.micro_batch, a.seq, a.hidden,
                 a.expert_hidden, a.layers, a.link_scale, a.delay_wgrad, a.a2a_waves)
    world = s.pp * DP
    lines, speedups = run_ranks(_worker, world, s)
    cores = os.cpu_count() or 1
    print(
        f"gloo, CPU, pp={s.pp} dp={DP} ep={EP} ({world} processes, 1 thread each), "
        f"{s.microbatches} microbatches of {s.micro_batch}x{s.seq} tokens, hidden {s.hidden}, "
        f"experts 4 x {s.expert_hidden} (top-2), {s.layers} MoE layers (even split)"
        f"{f', all-to-alls in {s.a2a_waves} waves' if s.a2a_waves > 1 else ''}; "
        f"EMULATED all-to-all link; machine: {cores} cores, load average "
        f"{os.getloadavg()[0]:.1f} at the end"
    )
    for line in lines:
        print(line)
    if cores < world:
        print(
            f"note: {world} ranks share {cores} cores; the ceiling is the best any overlap could "
            "reach here (plain CPU work / cores, or the link time, whichever is longer)"
        )
    print(f"speedup: {speedups[next(iter(FAMILIES[s.pp]))]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
