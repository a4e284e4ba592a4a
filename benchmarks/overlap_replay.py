"""Replay: the real engine with every node lasting its time in a profile (``overlap.py --replay``).

Four gloo processes (pp = 2, dp = 2, ep = 2) run the real executor, streams, combined step and p2p
on a tiny MoE GPT whose every node (attention, dispatch, experts, combine, embedding, head) does
its real work and then sleeps until its profile time has passed (``replay_stage``): the host
and the cores are left free as a GPU kernel leaves them, so the CPU's limits drop out and what
is measured is the engine's issue order. Per schedule the plain schedule and its combined
variant take turns step by step; beside each the simulator's prediction for the same profile
and issue order (``megapipe.sim`` with ``NodeCosts``, CPU host: the compute stream is the host
thread). Also the steady-state layer pair alone: one wave's forward beside another
microbatch's backward, combined vs the same nodes one after the other. First a calibration
replay of a uniform profile measures the engine's host cost per node on this machine
(``replay_calibration``); the predictions are printed without and with it.

Profile (JSON, milliseconds per MoE layer; ``megapipe/sim/profile.py``)::

    {"compute": {"attn_F", "attn_B", "attn_W", "mlp_F", "mlp_B", "mlp_W"},
     "comm": {"dispatch_F", "dispatch_B", "combine_F", "combine_B"},
     optional "embedding", "head", "dense_layer": {"F", "B"}}

Other top-level keys are ignored. ``--time-scale`` multiplies every time (so the real work of the
tiny model, printed as the "real work alone" step, stays negligible beside the waits).

    python benchmarks/overlap.py --replay benchmarks/profiles/deepseek_v3_h800.json \\
        [--schedules all] [--time-scale 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from spawn_ranks import run_ranks

DEFAULT_SCHEDULE = "interleaved-1f1b"
FIXED_VPP = {"gpipe": 1, "1f1b": 1, "zbv": 2, "dualpipev": 2, "dualpipe": 2}


@dataclass(frozen=True)
class ReplaySettings:
    profile: str
    schedules: tuple[str, ...]
    pp: int = 2
    vpp: int = 2
    dp: int = 2
    ep: int = 2
    microbatches: int = 16
    moe_layers: int = 4  # per model chunk
    rounds: int = 2
    time_scale: float = 3.0
    a2a_waves: int | None = None  # None: the simulator's choice
    delay_wgrad: bool = True
    pair: bool = True
    calibrate: bool = True


def _profile(s: ReplaySettings):
    from megapipe.sim.profile import NodeProfile

    return NodeProfile.load(s.profile).scaled(s.time_scale)


def _config(s: ReplaySettings, num_stages: int):
    from megapipe.models.config import GPTConfig

    return GPTConfig(vocab_size=64, hidden_size=16, num_layers=num_stages * s.moe_layers,
                     num_heads=2, seq_length=8, ffn_hidden_size=32, num_experts=4 * s.ep,
                     moe_top_k=2, moe_ffn_hidden_size=16, first_k_dense_layers=0)


def _schedule(s: ReplaySettings, name: str, overlap: bool):
    from megapipe.schedule import build_schedule

    return build_schedule(
        name, s.pp, s.microbatches, vpp=FIXED_VPP.get(name, s.vpp), overlap=overlap
    )


def node_costs(s: ReplaySettings, schedule, overlap: bool, waves: int = 1,
               early: str | None = None, host_cost: float = 0.0, profile=None):
    """The simulator's view of one run (CPU host: the compute stream is the host thread;
    ``early``: the executor's ``early_send_rule``, None: the simulator's default;
    ``host_cost``: ms per node, ``replay_calibration``; ``profile``: default the run's)."""
    from megapipe.sim.costs import NodeCosts

    nodes = NodeCosts(profile or _profile(s), schedule.stages_per_pipeline, s.moe_layers,
                      a2a_waves=waves, defer_wgrad=s.delay_wgrad and overlap,
                      host_runs_compute=True, combined=overlap, wgrad_by_time=True,
                      host_cost=host_cost)
    return nodes if early is None else replace(nodes, early_sends=early)


def chunks_for(s: ReplaySettings, name: str) -> int:
    """``--a2a-waves`` as given, else the simulator's pick (``choose_a2a_waves``)."""
    from megapipe.sim.pick import choose_a2a_waves

    if s.a2a_waves is not None:
        return s.a2a_waves
    schedule = _schedule(s, name, True)
    return choose_a2a_waves(schedule, node_costs(s, schedule, True), max_waves=4)


def predict(s: ReplaySettings, name: str, overlap: bool, waves: int, early: str | None = None,
            host_cost: float = 0.0, profile=None):
    """The simulator's step: (makespan ms, exposed all-to-all fraction)."""
    from megapipe.sim import Costs, simulate

    schedule = _schedule(s, name, overlap)
    nodes = node_costs(s, schedule, overlap, waves, early, host_cost, profile)
    result = simulate(schedule, Costs(nodes=nodes))
    return result.makespan, result.exposed_comm_fraction


class _ReplayRuns:
    """This rank's plain and combined executors of one schedule, on replay stages."""

    def __init__(self, s: ReplaySettings, groups, name: str, waves: int) -> None:
        from megapipe import ExecutorOptions, PipelineExecutor, TensorSpec
        from megapipe.models.gpt import gpt_loss
        from replay_stage import ReplayStage

        self.s, self.groups = s, groups
        self.executors, self.stages = {}, {}
        for label, overlap in (("plain", False), ("combined", True)):
            schedule = _schedule(s, name, overlap)
            per_pipeline = schedule.stages_per_pipeline
            config = _config(s, per_pipeline)
            stages = {}
            for i in schedule.stages_of_rank(groups.pp_rank):
                at = i % per_pipeline  # DualPipe: the second pipeline's stages hold copies
                layers = range(at * s.moe_layers, (at + 1) * s.moe_layers)
                stages[i] = ReplayStage(_profile(s), config, layers, schedule.is_first_stage(i),
                                        schedule.is_last_stage(i), groups.ep)
            self.stages[label] = stages
            self.executors[label] = PipelineExecutor(
                schedule, stages, ExecutorOptions(
                    spec=TensorSpec((1, config.seq_length, config.hidden_size)),
                    loss_fn=gpt_loss, groups=groups, record_trace=overlap,
                    moe_a2a_waves=waves if overlap else 1,
                    delay_wgrad_compute=s.delay_wgrad and overlap),
            )
        self.schedule, self.config = schedule, config
        self.early_rule = self.executors["combined"].rank_actions.early_send_rule

    def step(self, label: str, step: int):
        g = torch.Generator().manual_seed(1000 * step + self.groups.dp_rank)
        m, seq = self.s.microbatches, self.config.seq_length
        ids = torch.randint(0, self.config.vocab_size, (m, seq + 1), generator=g)
        stages = self.stages[label]
        first = any(self.schedule.is_first_stage(i) for i in stages)
        last = any(self.schedule.is_last_stage(i) for i in stages)
        result = self.executors[label].step(
            list(ids[:, :-1].chunk(m)) if first else None,
            list(ids[:, 1:].chunk(m)) if last else None,
        )
        for module in stages.values():
            module.zero_grad(set_to_none=True)
        return result

    def set_profile(self, profile) -> None:
        for stages in self.stages.values():
            for stage in stages.values():
                stage.profile = profile

    def close(self) -> None:
        for executor in self.executors.values():
            executor.close()


def _timed(fn, *args):
    dist.barrier()
    start = time.perf_counter()
    result = fn(*args)
    dist.barrier()
    return time.perf_counter() - start, result


def _measure(runs: _ReplayRuns, rounds: int) -> dict:
    """Median plain and combined step (ms), speed-up, exposed a2a (median over ranks' medians)."""
    labels = ["plain", "combined"]
    for label in labels:
        runs.step(label, 0)
    times = {label: [] for label in labels}
    exposed = []
    for r in range(rounds):
        for label in labels if r % 2 == 0 else labels[::-1]:
            wall, result = _timed(runs.step, label, r + 1)
            times[label].append(wall * 1e3)
            if label == "combined":
                exposed.append(result.exposed_comm_fraction or 0.0)
    mine = torch.tensor([statistics.median(exposed)])
    dist.all_reduce(mine)
    return {
        "plain": statistics.median(times["plain"]),
        "combined": statistics.median(times["combined"]),
        "speedup": statistics.median(p / c for p, c in zip(times["plain"], times["combined"])),
        "exposed": mine.item() / dist.get_world_size(),
        "early": runs.early_rule,
    }


def measure_schedule(s: ReplaySettings, groups, name: str, waves: int) -> dict:
    """``_measure`` of schedule ``name`` on this rank's replay stages."""
    runs = _ReplayRuns(s, groups, name, waves)
    try:
        return _measure(runs, s.rounds)
    finally:
        runs.close()


def _real_work(runs: _ReplayRuns) -> float:
    """One combined step with every profile time 0: the real work alone (ms)."""
    from megapipe.sim.profile import NodeProfile

    runs.set_profile(NodeProfile())
    wall, _ = _timed(runs.step, "combined", 99)
    runs.set_profile(_profile(runs.s))
    return wall * 1e3


def _pair(s: ReplaySettings, groups) -> dict:
    """The steady-state layer pair alone: forward of ``moe_layers`` MoE layers beside another
    microbatch's backward of them, combined vs one after the other (ms, median of 3)."""
    from megapipe.overlap import make_streams
    from megapipe.overlap.combined import combined_step
    from megapipe.overlap.sequential import record_forward, run_backward
    from replay_stage import ReplayStage

    config = _config(s, 3)
    stage = ReplayStage(_profile(s), config, range(s.moe_layers, 2 * s.moe_layers), False,
                        False, groups.ep)
    plans = stage.layer_plans()
    g = torch.Generator().manual_seed(groups.dp_rank)

    def hidden() -> torch.Tensor:
        shape = (1, config.seq_length, config.hidden_size)
        return torch.randn(shape, generator=g).requires_grad_()

    times = {"sequential": [], "combined": []}
    with make_streams("cpu") as streams:
        for _ in range(4):
            outputs, tape = record_forward(plans, (hidden(),))
            grads = [torch.ones_like(outputs[0])]
            wall, _ = _timed(lambda: (record_forward(plans, (hidden(),)),
                                      run_backward(tape, grads)))
            times["sequential"].append(wall * 1e3)
            outputs, tape = record_forward(plans, (hidden(),))
            wall, _ = _timed(lambda: combined_step(
                plans, (hidden(),), tape, grads, streams, delay_wgrad_compute=s.delay_wgrad))
            times["combined"].append(wall * 1e3)
    stage.zero_grad(set_to_none=True)
    return {label: statistics.median(v[1:]) for label, v in times.items()}


def _predict_pair(s: ReplaySettings, host_cost: float = 0.0) -> tuple[float, float]:
    """The simulator's pair: (combined, sequential) ms."""
    from megapipe.schedule.ir import Action, Kind
    from megapipe.sim.costs import NodeCosts
    from megapipe.sim.programs import node_ops, op_times

    profile = _profile(s)
    nodes = NodeCosts(profile, 3, s.moe_layers, defer_wgrad=s.delay_wgrad, host_runs_compute=True,
                      wgrad_by_time=True, host_cost=host_cost)
    ops = node_ops(Action.overlap(Action(1, Kind.F, 1), Action(1, Kind.B, 0)), nodes)
    combined = max(end for _, end in op_times(ops, 0.0))
    per_layer = sum(profile.layer_time(d) for d in "FBW")
    return combined, per_layer * s.moe_layers


def _pair_line(s: ReplaySettings, measured: dict, host: dict) -> str:
    combined_sim, sequential_sim = _predict_pair(s)
    calibrated, _ = _predict_pair(s, host.get("combined", 0.0))
    return (
        f"layer pair ({s.moe_layers} MoE layers F beside B): sequential "
        f"{measured['sequential']:.1f} ms, combined {measured['combined']:.1f} ms, speed-up "
        f"{measured['sequential'] / measured['combined']:.2f} | simulated {sequential_sim:.1f}"
        f" / {combined_sim:.1f} ms, speed-up {sequential_sim / combined_sim:.2f} | "
        f"measured/simulated combined {measured['combined'] / combined_sim:.3f}"
        + (f"; with host cost {measured['combined'] / calibrated:.3f}" if host else ""))


def _schedule_line(s: ReplaySettings, name: str, m: dict, waves: int, host: dict) -> str:
    plain_sim, _ = predict(s, name, False, 1)
    combined_sim, exposed_sim = predict(s, name, True, waves, m["early"])
    line = (
        f"{name:<17} plain {m['plain']:8.1f} ms  combined {m['combined']:8.1f} ms  "
        f"speed-up {m['speedup']:.2f}  exposed a2a {m['exposed']:4.0%}  waves {waves}  | "
        f"simulated {plain_sim:8.1f} / {combined_sim:8.1f} ms  speed-up "
        f"{plain_sim / combined_sim:.2f}  exposed {exposed_sim:4.0%}  | measured/simulated "
        f"plain {m['plain'] / plain_sim:.3f} combined {m['combined'] / combined_sim:.3f}"
    )
    if not host:
        return line
    plain_h, _ = predict(s, name, False, 1, host_cost=host["plain"])
    combined_h, _ = predict(s, name, True, waves, m["early"], host["combined"])
    return (line + f"; with host cost: simulated {plain_h:8.1f} / {combined_h:8.1f} ms, "
            f"measured/simulated plain {m['plain'] / plain_h:.3f} combined "
            f"{m['combined'] / combined_h:.3f}")


def _worker(rank: int, s: ReplaySettings, out) -> None:
    from replay_stage import precise_sleeps

    precise_sleeps()  # before any stream's worker thread starts: they inherit it
    dist.init_process_group("gloo")
    from megapipe.parallel.config import ParallelConfig
    from megapipe.parallel.groups import create_groups
    from megapipe.schedule.errors import ScheduleError
    from megapipe.schedule.ir import Kind
    from replay_calibration import calibrate, calibration_line

    groups = create_groups(ParallelConfig(pp=s.pp, dp=s.dp, ep=s.ep))
    lines, speedups, real, host = [], {}, None, {}
    if s.calibrate:
        host = calibrate(s, groups, s.schedules[0], chunks_for(s, s.schedules[0]))
        lines.append(calibration_line(host, s.schedules[0]))
    if s.pair:
        lines.append(_pair_line(s, _pair(s, groups), host))
    for name in s.schedules:
        try:
            combined = _schedule(s, name, True)
            waves = chunks_for(s, name)
        except ScheduleError as error:
            lines.append(f"{name:<17} skipped: {error}")
            continue
        if not any(a.kind is Kind.OVERLAP for row in combined.actions for a in row):
            lines.append(f"{name:<17} skipped: the overlap pass pairs nothing here")
            continue
        runs = _ReplayRuns(s, groups, name, waves)
        measured = _measure(runs, s.rounds)
        if real is None:
            real = (name, _real_work(runs), measured["combined"])
        runs.close()
        speedups[name] = measured["speedup"]
        lines.append(_schedule_line(s, name, measured, waves, host))
    dist.barrier()
    if rank == 0:
        out.put((lines, speedups, real))
    dist.destroy_process_group()


def parse(argv: list[str] | None) -> ReplaySettings:
    from megapipe.schedule import SCHEDULES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replay", required=True, metavar="PROFILE.json")
    parser.add_argument("--schedules", default=DEFAULT_SCHEDULE,
                        help="comma-separated schedule names, or 'all'")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--vpp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--moe-layers", type=int, default=4, help="MoE layers per model chunk")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--time-scale", type=float, default=3.0,
                        help="multiply every profile time by this")
    parser.add_argument("--a2a-waves", type=int, default=None,
                        help="combined runs' all-to-all waves (default: the simulator's choice)")
    parser.add_argument("--no-delay-wgrad", action="store_true",
                        help="combined runs compute expert weight gradients inside B")
    parser.add_argument("--no-pair", action="store_true", help="skip the layer pair alone")
    parser.add_argument("--no-calibration", action="store_true",
                        help="skip the host-cost calibration replay (replay_calibration.py)")
    a = parser.parse_args(argv)
    names = list(SCHEDULES) if a.schedules == "all" else a.schedules.split(",")
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        parser.error(f"--schedules: unknown {', '.join(unknown)}; known: {', '.join(SCHEDULES)}")
    if DEFAULT_SCHEDULE in names:  # the headline first
        names.insert(0, names.pop(names.index(DEFAULT_SCHEDULE)))
    return ReplaySettings(a.replay, tuple(names), a.pp, a.vpp, 2, 2, a.microbatches,
                          a.moe_layers, a.rounds, a.time_scale, a.a2a_waves,
                          not a.no_delay_wgrad, not a.no_pair, not a.no_calibration)


def main(argv: list[str] | None = None) -> int:
    s = parse(argv)
    _profile(s)  # a bad profile fails here, in one line, before any process starts
    lines, speedups, real = run_ranks(_worker, s.pp * s.dp, s)
    cores = os.cpu_count() or 1
    print(f"REPLAY of {s.profile} (times x{s.time_scale:g}): gloo, CPU, pp={s.pp} dp={s.dp} "
          f"ep={s.ep} ({s.pp * s.dp} processes on {cores} cores), {s.microbatches} microbatches, "
          f"{s.moe_layers} MoE layers per chunk, combined runs "
          f"{'defer' if s.delay_wgrad else 'do not defer'} expert weight gradients; every node "
          "sleeps out its profile time after its real work (the simulator models a CPU host)")
    for line in lines:
        print(line)
    if real is not None:
        name, alone, step = real
        print(f"real work alone (every time 0), {name} combined: {alone:.1f} ms per step = "
              f"{alone / step:.1%} of the replayed step (kept small by the tiny model and "
              "--time-scale)")
    headline = DEFAULT_SCHEDULE if DEFAULT_SCHEDULE in speedups else next(iter(speedups), None)
    print(f"speedup: {speedups[headline]:.2f}" if headline else "speedup: -")
    return 0
