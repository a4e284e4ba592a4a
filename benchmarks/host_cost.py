"""The engine's host time per node: one process, no distributed, every node's time 0 (or X ms).

The replay (``overlap.py --replay``) hides each node's own work inside its profile time; what
stays exposed is the engine's work around the node (tape boundaries, autograd's start and end,
the hand-off to the comm stream's worker, the deferred-W bookkeeping). This measures that work
alone, on the replay's stage (``replay_stage.ReplayStage``) with every time 0 and no expert
parallelism (the all-to-alls are local), for the steady-state layer pair: ``moe_layers`` MoE
layers' forward beside another microbatch's backward of them, run one after the other (plain
tape path) and combined (``combined_step``, deferred expert weight gradients). Printed per node
(forward and backward nodes of the pair): the process's CPU time (both threads, so it does not
depend on what else the machine runs) and the wall time, median over rounds, beside the model's
own work (``model``: the same layers by plain autograd, no tape, no streams); the difference is
the engine's own host time per node. ``--node-ms X``
gives every node X ms instead and solves the host cost per node at which the simulator's pair
equals the measured one, as the replay's calibration does (``replay_calibration``).

    python benchmarks/host_cost.py [--moe-layers 4] [--a2a-waves 1] [--rounds 30]
        [--node-ms X] [--profile N]  # N top functions by own time (cProfile, both threads)
    python benchmarks/host_cost.py --engine [--rounds 1500]
    python benchmarks/host_cost.py --launches

``--engine`` measures the engine's own host work alone: the same pair of layers of five nodes
(compute, comm, compute, comm, compute) whose every node is one elementwise multiply, with both
streams on the calling thread (as a GPU host issues both), CPU time of that thread, median over
rounds: plain autograd over the nodes, the tape path, the combined step; the difference to
plain autograd per node is the engine's. ``--megatron`` compares with Megatron-Core
(``megatron_host.py``). ``--launches`` counts the kernel launches of one MoE layer's forward +
backward (naive eager loop, plain tape path, combined step) and prints them per node
(``launch_count.py``; the counting rule is in docs/combined-step.md).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from overlap_replay import ReplaySettings, _config
from replay_stage import ReplayStage, precise_sleeps


def _uniform(ms: float):
    """Every F, B and W time ``ms`` (0: the real work alone)."""
    from megapipe.sim.profile import COMM_KEYS, COMPUTE_KEYS, NodeProfile

    return NodeProfile.from_dict({"compute": dict.fromkeys(COMPUTE_KEYS, ms),
                                  "comm": dict.fromkeys(COMM_KEYS, ms)})


def _stage(s: ReplaySettings, profile) -> ReplayStage:
    return ReplayStage(profile, _config(s, 3), range(s.moe_layers, 2 * s.moe_layers),
                       False, False, None)


def _plans(stage: ReplayStage, waves: int) -> list:
    from megapipe.overlap.plan import WavePlan

    plans = stage.layer_plans()
    return [p.in_waves(waves) if waves > 1 and isinstance(p, WavePlan) else p
            for p in plans]


def _node_count(plans: list) -> int:
    """Forward plus backward nodes of one pair of these plans."""
    from megapipe.overlap.plan import layer_graph

    return 2 * sum(len(layer_graph(plan).nodes) for plan in plans)


class _Pair:
    """One plain and one combined run of the layer pair on ``stage``."""

    def __init__(self, s: ReplaySettings, waves: int, streams, profile) -> None:
        self.stage = _stage(s, profile)
        self.plans = _plans(self.stage, waves)
        self.nodes = _node_count(self.plans)
        self.streams = streams
        self.delay_wgrad = s.delay_wgrad
        self.generator = torch.Generator().manual_seed(0)
        self.shape = (1, self.stage.config.seq_length, self.stage.config.hidden_size)

    def _hidden(self) -> torch.Tensor:
        return torch.randn(self.shape, generator=self.generator).requires_grad_()

    def prepare(self, label: str = "plain"):
        """A recorded tape and its output gradients (not timed); for ``model`` the same layers
        recorded by plain autograd."""
        from megapipe.overlap.plan import run_nodes
        from megapipe.overlap.sequential import record_forward

        if label == "model":
            values = (self._hidden(),)
            for plan in self.plans:
                values = run_nodes(plan, values)
            return values[0], torch.ones_like(values[0]), self._hidden()
        outputs, tape = record_forward(self.plans, (self._hidden(),))
        return tape, [torch.ones_like(outputs[0])], self._hidden()

    def model(self, output, grad, x) -> None:
        """The model's own work: the forward of ``x`` and the backward of ``output`` with plain
        autograd (no tape, no streams): what any engine has to run."""
        from megapipe.overlap.plan import run_nodes

        values = (x,)
        for plan in self.plans:
            values = run_nodes(plan, values)
        torch.autograd.backward(output, grad)

    def plain(self, tape, grads, x) -> None:
        """The nodes one after the other (as the replay's pair: W inside B)."""
        from megapipe.overlap.sequential import record_forward, run_backward

        record_forward(self.plans, (x,))
        run_backward(tape, grads)

    def combined(self, tape, grads, x) -> None:
        from megapipe.overlap.combined import combined_step

        combined_step(self.plans, (x,), tape, grads, self.streams,
                      delay_wgrad_compute=self.delay_wgrad)
        self.streams.comm.synchronize()


LABELS = ("plain", "combined")


def _timed_rounds(pair: _Pair, rounds: int, labels: tuple[str, ...] = LABELS) -> dict:
    """Per label, the median (CPU ms, wall ms) of ``rounds`` runs (the labels take turns; one
    warm-up run each)."""
    cpu: dict = {label: [] for label in labels}
    wall: dict = {label: [] for label in labels}
    for r in range(rounds + 1):
        for label in labels if r % 2 else labels[::-1]:
            args = pair.prepare(label)
            c0, w0 = time.process_time(), time.perf_counter()
            getattr(pair, label)(*args)
            cpu[label].append((time.process_time() - c0) * 1e3)
            wall[label].append((time.perf_counter() - w0) * 1e3)
            pair.stage.zero_grad(set_to_none=True)
    return {label: (statistics.median(cpu[label][1:]), statistics.median(wall[label][1:]))
            for label in labels}


def _simulated(s: ReplaySettings, profile, waves: int, host_cost: float) -> tuple[float, float]:
    """The simulator's pair (plain, combined) ms with ``host_cost`` ms per F and B node."""
    from megapipe.schedule.ir import Action, Kind
    from megapipe.sim.costs import NodeCosts
    from megapipe.sim.programs import node_ops, op_times

    def pair_time(action, defer: bool) -> float:
        nodes = NodeCosts(profile, 3, s.moe_layers, a2a_waves=waves, defer_wgrad=defer,
                          host_runs_compute=True, wgrad_by_time=True, host_cost=host_cost)
        return max(end for _, end in op_times(node_ops(action, nodes), 0.0))

    forward, backward = Action(1, Kind.F, 1), Action(1, Kind.B, 0)
    plain = pair_time(forward, False) + pair_time(backward, False)
    return plain, pair_time(Action.overlap(forward, backward), s.delay_wgrad)


def _host_cost_line(s: ReplaySettings, profile, waves: int, label: str, wall: float) -> str:
    """The measured pair ``label`` beside the simulator's, and the host cost per F/B node at
    which the two agree (``replay_calibration.solve_host_cost``)."""
    from replay_calibration import solve_host_cost

    index = LABELS.index(label)
    h = solve_host_cost(lambda h: _simulated(s, profile, waves, h)[index], wall)
    simulated = _simulated(s, profile, waves, 0.0)[index]
    return (f"  {label:<8} wall {wall:8.1f} ms, simulated {simulated:8.1f} ms -> host cost "
            f"{h:.3f} ms per node")


def _profiled(pair: _Pair, label: str, rounds: int, top: int) -> None:
    """cProfile of ``rounds`` runs of ``label`` on the host thread and the comm worker."""
    host, worker = cProfile.Profile(), cProfile.Profile()
    comm = pair.streams.comm
    comm.submit(worker.enable).synchronize()
    run = getattr(pair, label)
    for _ in range(rounds):
        args = pair.prepare(label)
        host.enable()
        run(*args)
        host.disable()
        pair.stage.zero_grad(set_to_none=True)
    comm.submit(worker.disable).synchronize()
    stats = pstats.Stats(host)
    stats.add(worker)
    print(f"--- {label}: top {top} by own time, {rounds} runs x {pair.nodes} nodes "
          "(host thread + comm worker)")
    stats.sort_stats("tottime").print_stats(top)


def _engine(rounds: int) -> int:
    """``--engine`` (module docstring)."""
    from megapipe.overlap import combined_step, record_forward, run_backward
    from megapipe.overlap.plan import Node, NodeKind, run_nodes
    from megapipe.overlap.streams import InlineStream, Streams

    try:  # plans built once with their graphs, as the reference GPT's are
        from megapipe.overlap.plan import Plan
    except ImportError:
        Plan = list

    torch.set_num_threads(1)
    weight = torch.nn.Parameter(torch.ones(8))
    kinds = [NodeKind.COMPUTE, NodeKind.COMM, NodeKind.COMPUTE, NodeKind.COMM, NodeKind.COMPUTE]
    plans = [Plan([Node(f"n{i}", k, lambda state, t: (t[0] * weight,))
                   for i, k in enumerate(kinds)]) for _ in range(4)]
    nodes = 2 * 4 * len(kinds)
    streams = Streams(InlineStream("compute"), InlineStream("comm"))

    def leaf() -> torch.Tensor:
        return torch.randn(4, 8, requires_grad=True)

    def autograd() -> float:
        values = (leaf(),)
        for plan in plans:
            values = run_nodes(plan, values)
        x, grad = leaf(), torch.ones(4, 8)
        start = time.thread_time()
        other = (x,)
        for plan in plans:
            other = run_nodes(plan, other)
        torch.autograd.backward(values[0], grad)
        return time.thread_time() - start

    def plain() -> float:
        _, tape = record_forward(plans, (leaf(),))
        x, grads = leaf(), [torch.ones(4, 8)]
        start = time.thread_time()
        record_forward(plans, (x,))
        run_backward(tape, grads)
        return time.thread_time() - start

    def combined() -> float:
        _, tape = record_forward(plans, (leaf(),))
        x, grads = leaf(), [torch.ones(4, 8)]
        start = time.thread_time()
        combined_step(plans, (x,), tape, grads, streams, delay_wgrad_compute=True)
        return time.thread_time() - start

    runs = {"autograd": autograd, "plain": plain, "combined": combined}
    samples: dict[str, list[float]] = {label: [] for label in runs}
    for r in range(rounds + 100):  # 100 warm-up rounds
        for label, run in runs.items():
            seconds = run()
            if r >= 100:
                samples[label].append(seconds)
    us = {label: statistics.median(v) * 1e6 / nodes for label, v in samples.items()}
    print(f"trivial nodes, {nodes} F+B nodes, one thread, CPU time, median of {rounds} rounds:")
    for label, value in us.items():
        print(f"  {label:<8} {value:5.1f} us/node")
    print(f"engine's own host time per node: plain {us['plain'] - us['autograd']:.1f} us, "
          f"combined {us['combined'] - us['autograd']:.1f} us")
    return 0


def _launches() -> int:
    """``--launches`` (module docstring)."""
    from launch_count import histogram, moe_layer_launches

    torch.set_num_threads(1)
    counters = moe_layer_launches()
    print("kernel launches of one MoE layer forward + backward (the demo's layer: hidden 96, "
          "4 experts top-2, dropless, ep 1), counted on CPU (docs/combined-step.md):")
    for way, counter in counters.items():
        free = sum(sum(c.values()) for c in counter.free.values())
        print(f"  {way:<8} {counter.total():4d} launches ({free} ops that launch nothing)")
    for way in ("naive", "plain"):
        counter = counters[way]
        print(f"{way}, per node (launches, top ops; free: views, metadata, allocations):")
        for label in sorted(set(counter.launches) | set(counter.free)):
            print("  " + histogram(counter, label))
    plain, combined = counters["plain"].total(), counters["combined"].total()
    from engine_primitives import PRIMITIVES, count

    per_node, nodes = count()
    print(f"engine primitives per node of a combined step (CUDA path, counted on CPU, {nodes} "
          "nodes; benchmarks/engine_primitives.py): " + ", ".join(
              f"{name} {per_node[name]:.2f}" for name in PRIMITIVES))
    from launch_count import HOST_PROCESSES, HOST_ROUNDS, host_times

    ms = host_times()
    print(f"host time per MoE layer forward + backward (CPU time of the issuing thread, one "
          f"thread, each way in processes of its own: the median of {HOST_PROCESSES} processes' "
          f"medians of {HOST_ROUNDS} rounds): naive {ms['naive']:.2f} ms, plain "
          f"{ms['plain']:.2f} ms, combined {ms['combined']:.2f} ms; combined / naive "
          f"{ms['combined'] / ms['naive']:.2f}, plain / naive {ms['plain'] / ms['naive']:.2f}; "
          f"the combined step's work by plain autograd (F of one microbatch, B of another) "
          f"{ms['interleaved']:.2f} ms: combined / it {ms['combined'] / ms['interleaved']:.2f}")
    from outside_graphs import PARTIAL_LAYER, RANK_CAPACITY, WHOLE_LAYER, launches_outside_graphs

    outside, counter = launches_outside_graphs()
    in_grad, _ = launches_outside_graphs(main_grads=False)
    partial, _ = launches_outside_graphs(modules=PARTIAL_LAYER)
    print(f"launches per MoE layer outside CUDA graphs: {outside} (combined step, "
          f"--moe-expert-rank-capacity-factor {RANK_CAPACITY:g}, ep 1, --cuda-graph-modules "
          f"{' '.join(WHOLE_LAYER)}, fp32 main gradients: attention, experts and finish "
          f"replayed, a replay one launch; {in_grad} with gradients in .grad (fp32 without "
          f"main_grad: autograd copies each parameter's out of its graph); {partial} with "
          f"{' '.join(PARTIAL_LAYER)}, the attention node alone)")
    for label in sorted(counter.launches):
        print("  " + histogram(counter, label))
    print(f"launches per MoE layer: plain {plain}, combined {combined}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from megapipe.overlap import make_streams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moe-layers", type=int, default=4)
    parser.add_argument("--a2a-waves", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--node-ms", type=float, default=0.0,
                        help="every node's time (0: the real work alone); > 0 also solves the "
                        "host cost per node against the simulator, as the replay's calibration")
    parser.add_argument("--no-delay-wgrad", action="store_true")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print the N top functions by own time (cProfile)")
    parser.add_argument("--megatron", action="store_true",
                        help="instead: host time per layer pair of Megatron-Core's combined_1f1b "
                        "beside megapipe's combined step (megatron_host.py)")
    parser.add_argument("--engine", action="store_true",
                        help="instead: the engine's own host time per node on trivial nodes")
    parser.add_argument("--launches", action="store_true",
                        help="instead: kernel launches per MoE layer forward + backward, naive, "
                        "plain and combined, per node (launch_count.py)")
    a = parser.parse_args(argv)
    if a.launches:
        return _launches()
    if a.engine:
        return _engine(a.rounds)
    if a.megatron:
        from megatron_host import run

        return run(a.rounds)
    torch.set_num_threads(1)
    precise_sleeps()  # as the replay's ranks do
    s = ReplaySettings("", (), moe_layers=a.moe_layers, delay_wgrad=not a.no_delay_wgrad)
    profile = _uniform(a.node_ms)
    with make_streams("cpu") as streams:
        pair = _Pair(s, a.a2a_waves, streams, profile)
        figures = _timed_rounds(pair, a.rounds, ("model",) + LABELS)
        print(f"layer pair of {a.moe_layers} MoE layers, {a.a2a_waves} wave(s), {pair.nodes} "
              f"F+B nodes, every node {a.node_ms:g} ms, {a.rounds} rounds (median):")
        for label, (cpu, wall) in figures.items():
            print(f"  {label:<8} CPU {cpu / pair.nodes:.3f} ms/node, wall {wall / pair.nodes:.3f}"
                  " ms/node")
        model = figures["model"][0]
        print(f"  engine's own CPU per node (the row minus model): plain "
              f"{(figures['plain'][0] - model) / pair.nodes:.3f}, combined "
              f"{(figures['combined'][0] - model) / pair.nodes:.3f} ms")
        print(f"  combined / plain CPU: {figures['combined'][0] / figures['plain'][0]:.2f}")
        for label in LABELS if a.node_ms > 0 else ():
            print(_host_cost_line(s, profile, a.a2a_waves, label, figures[label][1]))
        for label in LABELS if a.profile else ():
            _profiled(pair, label, max(a.rounds // 3, 1), a.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
