"""Rank-side code for the combined-step tests of the executor (see ``pipeline_cases``).

Each function runs inside the ranks of the 8-rank pool; a configuration uses ranks [0, world).
The bitwise check runs every case three ways in the same processes (plain schedule, combined
schedule, combined with deferred weight gradients) and compares on the rank, returning only
the verdicts, so the matrix stays cheap.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

from megapipe import get_forward_backward_func
from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage
from megapipe.moe.link import EmulatedLink
from megapipe.parallel.config import ParallelConfig
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.executor_options import ExecutorOptions
from megapipe.pipeline.p2p import TensorSpec
from megapipe.precision.main_grad import accumulated_grad
from megapipe.schedule import Kind, build_schedule
from megapipe.train.optim.mixed_precision import cast_to_bf16
from support.fake_graphs import FakeGraphApi
from support.pipeline_cases import (
    CONFIG,
    MICRO_BATCH,
    Case,
    microbatch,
    prepare_groups,
    subworld_groups,
)

GRAPH_MODULES = ("attn", "moe_router", "mlp")
WHOLE_LAYER_MODULES = ("attn", "moe", "mlp")  # a model with a rank capacity: MoE layers whole


def _run(case: Case, overlap: bool, delay: bool, config=None, trace: bool = False,
         bf16: bool = False, waves: int = 1, graphs: bool = False):
    """One training step of ``case``: (losses, {(stage, name): grad}, StepResult, wall s).

    ``config``: the model (default: the case's, ``Case.config``).
    ``bf16``: bf16 parameters and activations with float32 ``main_grad`` (what ``--bf16``
    trains with); the gradients compared are then the float32 main gradients. ``waves``: the
    all-to-alls in that many expert groups (``moe_a2a_waves``). ``graphs``: the static nodes
    as CUDA graphs, through the CPU stand-in (``fake_graphs``); with a rank capacity the MoE
    layers whole."""
    config = case.config if config is None else config
    groups = subworld_groups(ParallelConfig(case.pp, case.dp, case.ep))
    schedule = build_schedule(case.schedule, case.pp, case.microbatches, vpp=case.vpp,
                              overlap=overlap)
    ep_group = groups.ep if case.ep > 1 else None
    stages = {
        s: build_stage(config, schedule.model_part(s), schedule.stages_per_pipeline, ep_group)
        for s in schedule.stages_of_rank(groups.pp_rank)
    }
    if bf16:
        cast_to_bf16(stages.values(), [p for m in stages.values() for p in m.parameters()])
    dtype = torch.bfloat16 if bf16 else torch.float32
    spec = TensorSpec((MICRO_BATCH, config.seq_length, config.hidden_size), dtype)
    data = [microbatch(groups.dp_rank, i, 0) for i in range(case.microbatches)]
    with PipelineExecutor(
        schedule, stages, ExecutorOptions(
            spec=spec, loss_fn=gpt_loss, groups=groups, timeout=30.0,
            delay_wgrad_compute=delay, record_trace=trace, moe_a2a_waves=waves,
            **(dict(cuda_graph_impl="local", graph_api=FakeGraphApi(),
                    cuda_graph_modules=WHOLE_LAYER_MODULES
                    if config.moe_expert_rank_capacity_factor else GRAPH_MODULES)
               if graphs else {}),
        ),
    ) as executor:
        dist.barrier(groups.pp)
        start = time.perf_counter()
        result = executor.step([d[0] for d in data], [d[1] for d in data])
        wall = time.perf_counter() - start
    grads = {
        (s, n): accumulated_grad(p).clone()
        for s, m in stages.items() for n, p in m.named_parameters()
    }
    return {i: v.item() for i, v in result.losses.items()}, grads, result, wall


def _differences(a, b) -> list[str]:
    (l1, g1), (l2, g2) = a[:2], b[:2]
    problems = [] if l1 == l2 else [f"losses {l1} != {l2}"]
    for key in g1:
        if not torch.equal(g1[key], g2[key]):
            diff = (g1[key] - g2[key]).abs().max().item()
            problems.append(f"grad {key}: max diff {diff:.3e}")
    return problems


def bitwise_cases(cases: list[Case], bf16: bool = False) -> list[list[str] | None]:
    """Per case: what differs between plain, combined and combined+delay (empty: bitwise)."""
    prepare_groups([ParallelConfig(c.pp, c.dp, c.ep) for c in cases])
    out = []
    for case in cases:
        if dist.get_rank() < case.world:
            plain = _run(case, overlap=False, delay=False, bf16=bf16)
            combined = _run(case, overlap=True, delay=False, bf16=bf16)
            delayed = _run(case, overlap=True, delay=True, bf16=bf16)
            problems = [f"combined: {p}" for p in _differences(plain, combined)]
            problems += [f"combined+delay: {p}" for p in _differences(plain, delayed)]
            out.append(problems)
        else:
            out.append(None)
        dist.barrier()
    return out


def graph_cases(cases: list[Case], bf16: bool = True) -> list[list[str] | None]:
    """Per case: what differs from the plain schedule without graphs when the static nodes are
    CUDA graphs (the CPU stand-in), in the plain schedule (unless it splits I and W on plain
    autograd, which graphs refuse), the combined one and the combined one with deferred weight
    gradients (empty: bitwise); and that each run captured graphs."""
    prepare_groups([ParallelConfig(c.pp, c.dp, c.ep) for c in cases])
    out = []
    for case in cases:
        if dist.get_rank() < case.world:
            reference = _run(case, overlap=False, delay=False, bf16=bf16)
            ways = {"combined": (True, False), "combined+delay": (True, True)}
            if case.schedule not in ("zb1p", "zbv"):
                ways["plain"] = (False, False)
            problems = []
            for way, (overlap, delay) in ways.items():
                run = _run(case, overlap=overlap, delay=delay, bf16=bf16, graphs=True)
                problems += [f"{way} with graphs: {p}" for p in _differences(reference, run)]
                if not run[2].graph_instances:
                    problems.append(f"{way}: no graph was captured")
            out.append(problems)
        else:
            out.append(None)
        dist.barrier()
    return out


def recompute_cases(cases: list[Case], settings: dict[str, dict],
                    combined_only: tuple[str, ...] = ()) -> list[dict | None]:
    """Per case, per recompute setting (name -> ``GPTConfig`` fields): what differs from the
    plain run without recompute, in the plain and in the combined schedule (empty: bitwise;
    the settings in ``combined_only``: the combined schedule only). The reference runs once
    per case."""
    prepare_groups([ParallelConfig(c.pp, c.dp, c.ep) for c in cases])
    out = []
    for case in cases:
        if dist.get_rank() < case.world:
            reference = _run(case, overlap=False, delay=False)
            verdicts = {}
            for name, fields in settings.items():
                config = dataclasses.replace(case.config, **fields)
                problems = []
                for overlap in (True,) if name in combined_only else (False, True):
                    again = _run(case, overlap=overlap, delay=False, config=config)
                    problems += [f"overlap={overlap}: {p}" for p in _differences(reference, again)]
                verdicts[name] = problems
            out.append(verdicts)
        else:
            out.append(None)
        dist.barrier()
    return out


def pair_names(trace) -> list[tuple[tuple[str, str], ...]]:
    """Per combined step slot with two nodes: ((direction, node), ...) sorted by stream."""
    pairs = []
    for slot in trace.slots():
        nodes = [s for s in slot if s.direction in ("F", "B")]
        if len(nodes) == 2:
            nodes.sort(key=lambda s: s.stream)  # comm before compute
            pairs.append(tuple((s.direction, s.node.split(".")[-1]) for s in nodes))
    return pairs


def traced_run(case: Case) -> dict | None:
    """A combined run with the trace on: the pairs issued in each OVERLAP action's MoE layers."""
    prepare_groups([ParallelConfig(case.pp, case.dp, case.ep)])
    if dist.get_rank() >= case.world:
        return None
    _, _, result, _ = _run(case, overlap=True, delay=True, trace=True)
    spans = result.trace.by_start()
    wgrad_beside_dispatch = False
    for span in spans:
        if span.direction == "W":
            partners = [s for s in spans if s.slot == span.slot and s.node.endswith("dispatch")]
            wgrad_beside_dispatch |= any(p.direction == "B" for p in partners)
    return {
        "pairs": pair_names(result.trace),
        "fraction": result.exposed_comm_fraction,
        "a2a": result.a2a_time,
        "wgrad_beside_dispatch": wgrad_beside_dispatch,
    }


def concurrency_run(case: Case, latency_s: float) -> dict | None:
    """Wall time of a combined step against the sum of its comm and compute (emulated link)."""
    prepare_groups([ParallelConfig(case.pp, case.dp, case.ep)])
    if dist.get_rank() >= case.world:
        return None
    # wider than CONFIG so that a node computes for about as long as an all-to-all takes
    config = dataclasses.replace(
        CONFIG, hidden_size=64, num_heads=4, ffn_hidden_size=256, moe_ffn_hidden_size=256,
        moe_link=EmulatedLink(bandwidth_bytes_per_s=1e12, latency_s=latency_s),
    )
    _run(case, overlap=True, delay=False, config=config)  # warm-up (first exchanges are slow)
    _, _, result, wall = _run(case, overlap=True, delay=False, config=config, trace=True)
    # the combined step's paired slots (a comm node of one microbatch beside a compute node of
    # the other): their wall time against the summed time of their nodes
    paired_wall = paired_sum = 0.0
    for slot in result.trace.slots():
        nodes = [s for s in slot if s.direction in ("F", "B")]
        if len(nodes) == 2:
            paired_wall += max(s.end for s in slot) - min(s.start for s in slot)
            paired_sum += sum(s.duration for s in slot)
    return {
        "wall": wall,
        "a2a": result.a2a_time,
        "compute": result.compute_time,
        "fraction": result.exposed_comm_fraction,
        "paired_wall": paired_wall,
        "paired_sum": paired_sum,
    }


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    output = model(tokens if model.is_first else None)
    return output, lambda out: (gpt_loss(out, labels), {"lm loss": gpt_loss(out, labels).detach()})


def front_end_run(case: Case) -> dict | None:
    """get_forward_backward_func with and without the Megatron overlap flags: same bits?"""
    prepare_groups([ParallelConfig(case.pp, case.dp, case.ep)])
    if dist.get_rank() >= case.world:
        return None
    groups = subworld_groups(ParallelConfig(case.pp, case.dp, case.ep))
    outcomes = []
    for flags in ({}, dict(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True,
                          record_trace=True)):
        func = get_forward_backward_func(
            pp=case.pp, vpp=case.vpp, schedule=case.schedule, groups=groups, timeout=30.0,
            **flags,
        )
        schedule = build_schedule(func.schedule_name, case.pp, case.microbatches, vpp=case.vpp,
                                  overlap=func.options.overlap)
        stage_ids = schedule.stages_of_rank(groups.pp_rank)
        ep_group = groups.ep if case.ep > 1 else None
        chunks = [build_stage(case.config, s, case.pp * case.vpp, ep_group) for s in stage_ids]
        data = [microbatch(groups.dp_rank, i, 0) for i in range(case.microbatches)]
        losses = func(
            forward_step_func=_forward_step,
            data_iterator=[iter(data) for _ in chunks],
            model=chunks,
            num_microbatches=case.microbatches,
            seq_length=CONFIG.seq_length,
            micro_batch_size=MICRO_BATCH,
        )
        func.close()
        grads = {(s, n): p.grad.clone() for s, c in zip(stage_ids, chunks)
                 for n, p in c.named_parameters()}
        overlaps = sum(a.kind is Kind.OVERLAP for row in schedule.actions for a in row)
        outcomes.append(([d["lm loss"].item() for d in losses], grads, func.last_result,
                         overlaps, all(c.node_runner is None for c in chunks)))
    (l1, g1, _, plain_overlaps, _), (l2, g2, result, overlaps, restored) = outcomes
    return {
        "differences": _differences((l1, g1), (l2, g2)),
        "plain_overlaps": plain_overlaps,
        "overlaps": overlaps,
        "pairs": pair_names(result.trace),
        "runner_restored": restored,
    }


class _PlainBlock(nn.Module):
    """A stage without layer_plans(): the executor cannot split it into nodes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


def non_node_stage(overlap: bool) -> tuple[list[str], dict[int, float], torch.Tensor]:
    """pp = 1, one process: warnings raised over two steps, the losses and the gradient."""
    schedule = build_schedule("1f1b", 1, 4, overlap=overlap)
    stage = _PlainBlock()
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, 4, generator=gen) for _ in range(4)]
    with PipelineExecutor(
        schedule, {0: stage},
        ExecutorOptions(loss_fn=lambda out, target: ((out - target) ** 2).mean()),
    ) as executor:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                result = executor.step(inputs, [x.flip(0) for x in inputs])
    messages = [str(w.message) for w in caught]
    return messages, {i: v.item() for i, v in result.losses.items()}, stage.proj.weight.grad


def host_sync_run(case: Case) -> dict | None:
    """One training step of ``case`` (after a warm-up step) under ``HostSyncs``: every host
    sync this rank made, and how many MoE-layer forwards it ran."""
    from support.host_syncs import HostSyncs
    from support.pipeline_cases import build_pipeline

    prepare_groups([ParallelConfig(case.pp, case.dp, case.ep)])
    if dist.get_rank() >= case.world:
        return None
    groups, schedule, stages, executor = build_pipeline(case)
    data = [microbatch(groups.dp_rank, i, 0) for i in range(case.microbatches)]
    with executor:
        executor.step([d[0] for d in data], [d[1] for d in data])
        with HostSyncs() as syncs:
            executor.step([d[0] for d in data], [d[1] for d in data])
    moe_forwards = case.microbatches * sum(len(m.moe_layers()) for m in stages.values())
    return {"events": syncs.events, "moe_forwards": moe_forwards}


def early_send_order(case: Case) -> dict | None:
    """A combined step with delayed weight gradients, logging in order when each p2p batch is
    posted and when each OVERLAP's combined step returns."""
    from megapipe.pipeline.executor import PipelineExecutor
    from megapipe.pipeline.transit import StepTensors
    from megapipe.schedule.ir import Kind

    prepare_groups([ParallelConfig(case.pp, case.dp, case.ep)])
    if dist.get_rank() >= case.world:
        return None
    log: list[tuple[str, str]] = []
    post, run = StepTensors.post, PipelineExecutor._run_combined

    def logged_post(self, actions):
        log.append(("post", " ".join(str(a) for a in actions)))
        return post(self, actions)

    def logged_run(self, action, state, *sends):
        done = run(self, action, state, *sends)
        if action.kind is Kind.OVERLAP:
            f, b = action.forward, action.backward
            log.append(("pair end", f"F{f.microbatch} B{b.microbatch}"))
        return done

    StepTensors.post, PipelineExecutor._run_combined = logged_post, logged_run
    try:
        losses, grads, _, _ = _run(case, overlap=True, delay=True)
        plain = _run(case, overlap=False, delay=False)
    finally:
        StepTensors.post, PipelineExecutor._run_combined = post, run
    return {"log": log, "differences": _differences(plain, (losses, grads))}


def wave_cases(cases: list[Case]) -> list[dict | None]:
    """Per case: what differs between the plain schedule and the combined one with the
    all-to-alls in 2 waves (with and without deferred weight gradients), and, from the trace,
    the nodes of one microbatch that ran side by side (a wave's all-to-all beside another's
    experts: only lone actions do that)."""
    prepare_groups([ParallelConfig(c.pp, c.dp, c.ep) for c in cases])
    out = []
    for case in cases:
        if dist.get_rank() < case.world:
            plain = _run(case, overlap=False, delay=False)
            waved = _run(case, overlap=True, delay=False, waves=2, trace=True)
            delayed = _run(case, overlap=True, delay=True, waves=2)
            problems = [f"waved: {p}" for p in _differences(plain, waved)]
            problems += [f"waves+delay: {p}" for p in _differences(plain, delayed)]
            same_microbatch, pairings = [], set()
            for slot in waved[2].trace.slots():
                nodes = [s for s in slot if s.direction in ("F", "B")]
                if len(nodes) == 2 and nodes[0].microbatch == nodes[1].microbatch:
                    same_microbatch.append(sorted(n.node.split(".")[-1] for n in nodes))
                if {n.direction for n in nodes} == {"F", "B"}:  # a pair: waves grouped
                    pairings.add(frozenset(
                        (n.direction, n.node.split(".")[-1].rstrip("0123456789")) for n in nodes
                    ))
            out.append({"problems": problems, "same_microbatch": same_microbatch,
                        "pairings": pairings})
        else:
            out.append(None)
        dist.barrier()
    return out
