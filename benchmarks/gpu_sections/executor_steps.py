"""The executor section's step times: plain and combined 1f1b steps of the reference GPT in
bf16, CUDA graphs off and on, without a link and with a sleep link as long as the experts node.

Per shape one bf16 stage is shared by four executors (plain and combined, graphs off and on;
each executor captures its own graphs), stepped alternately: median GPU and host milliseconds
per step (host: until ``step`` returned, the issue time), the summed kernel time of one step
(torch.profiler) and the host's share of it, the exposed all-to-all and GPU idle share of a
combined step (the executor's node trace), the device allocations of a warm step, and the
graphs' instances and private-pool memory (``StepResult.graph_instances``, ``graph_bytes``).
"""

from __future__ import annotations

import statistics

import torch

from gpu_sections import timeline
from gpu_sections.gpu_timing import Timed, node_spans, time_ms
from gpu_sections.link_model import make_link, set_link
from megapipe.models.config import GPTConfig
from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.executor_options import ExecutorOptions
from megapipe.precision.main_grad import zero_grads
from megapipe.schedule import build_schedule
from megapipe.train.optim.mixed_precision import cast_to_bf16

MICROBATCHES = 8
GRAPHS = {"cuda_graph_impl": "local",
          "cuda_graph_modules": ("attn", "moe_router", "moe_preprocess", "mlp")}
WAYS = ("plain", "combined")
COLUMNS = ["all-to-all", "CUDA graphs", "plain ms", "combined ms", "plain / combined",
           "plain host ms", "combined host ms", "plain kernel ms", "combined kernel ms",
           "combined host / kernel", "exposed a2a (combined)", "GPU idle (combined)",
           "plain cudaMallocs", "combined cudaMallocs"]


def batch(config: GPTConfig, micro_batch: int, device: torch.device, seed: int = 0,  # noqa: ANN201
          microbatches: int = MICROBATCHES):
    """Token ids and labels, split into the microbatches."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (microbatches * micro_batch, config.seq_length + 1),
                        generator=generator).to(device)
    return list(ids[:, :-1].chunk(microbatches)), list(ids[:, 1:].chunk(microbatches))


def bf16_stage(config: GPTConfig, device: torch.device) -> torch.nn.Module:
    """The reference GPT as one bf16 stage with fp32 main gradients, built on ``device``: its
    shapes on the meta device, then its weights drawn there (matrices N(0, init_std), norm
    weights 1) by a generator seeded with ``config.seed``. The model's own initialisation draws
    on the CPU (15-25 s of a section at hidden 4096); these weights are not its values, but
    every build is the same, which is all the timings and the bitwise comparisons need."""
    with torch.device("meta"):
        stage = build_stage(config, 0, 1)
    stage.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(config.seed)
    with torch.no_grad():
        for name, param in stage.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, config.init_std, generator=generator)
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                raise ValueError(f"bf16_stage does not know how to initialise {name}")
    cast_to_bf16([stage], list(stage.parameters()))
    return stage


def executor(config: GPTConfig, device: torch.device, overlap: bool, stage=None,  # noqa: ANN001
             microbatches: int = MICROBATCHES, **options) -> PipelineExecutor:  # noqa: ANN003
    """A bf16 stage (a new one, or ``stage`` shared) under 1f1b, plain or combined."""
    stage = bf16_stage(config, device) if stage is None else stage
    schedule = build_schedule("1f1b", 1, microbatches, overlap=overlap)
    return PipelineExecutor(schedule, {0: stage}, ExecutorOptions(loss_fn=gpt_loss, **options))


def describe(config: GPTConfig, micro_batch: int) -> str:
    return (f"{config.num_layers} layers ({config.first_k_dense_layers} dense), hidden "
            f"{config.hidden_size}, {config.num_experts} experts x {config.moe_ffn_hidden_size} "
            f"top-{config.moe_top_k}, {MICROBATCHES} microbatches of {micro_batch} x "
            f"{config.seq_length} tokens, bf16")


def step_times(ctx, result, config: GPTConfig, micro_batch: int,  # noqa: ANN001
               prefix: str = "") -> dict[tuple[str, bool], tuple[float, float | None]]:
    """The table and figures of one shape (module docstring); ``prefix`` names its figures.
    Returns per (link label, graphs on) the speed-up and the combined host / kernel share."""
    microbatches = MICROBATCHES if ctx.cuda else 4  # a dry run checks the code, not the times
    inputs, targets = batch(config, micro_batch, ctx.device, seed=1, microbatches=microbatches)
    rounds = 3 if ctx.cuda else 1
    stage = bf16_stage(config, ctx.device)
    # without CUDA (and without a graph stand-in) graphs would run eager: left out
    graphs_run = ctx.cuda or "graph_api" in GRAPHS
    variants = (False, True) if graphs_run else (False,)
    runs = {(way, graphs): executor(config, ctx.device, way == "combined", stage, microbatches,
                                    **(GRAPHS if graphs else {}))
            for graphs in variants for way in WAYS}
    note = runs[("plain", True)].cuda_graph_note if graphs_run else "left out (no CUDA)"
    on = "on" if graphs_run and runs[("plain", True)].cuda_graphs is not None else "off"
    rows: list[list] = []
    measured: dict[tuple[str, bool], tuple[float, float | None]] = {}
    try:
        traced, _ = _traced_step(runs[("combined", False)], inputs, targets)
        experts = [s.duration for s in traced
                   if s.label[:1] in "FB" and s.label.endswith("experts")]
        payload = micro_batch * config.seq_length * config.moe_top_k * config.hidden_size * 2
        link = make_link("sleep", statistics.mean(experts), ctx.device, payload)
        for label, with_link in (("no link", None), ("sleep link, comm ~ experts", link)):
            set_link(stage.moe_layers(), with_link)
            med = _median_steps(ctx, runs, inputs, targets, rounds)
            for graphs in variants:
                key = f"{prefix}{'link_' if with_link else ''}"
                rows.append(_row(ctx, result, runs, med, inputs, targets, label,
                                 on if graphs else "off", key))
                measured[(label, graphs)] = (rows[-1][4], rows[-1][9])
        graphed = runs[("combined", variants[-1])].step(inputs, targets)
        zero_grads(stage.parameters())
    finally:
        for run_executor in runs.values():
            run_executor.close()
    h = config.hidden_size
    result.table(f"1f1b step, hidden {h}, bf16", COLUMNS, rows)
    if graphed.graph_instances is not None:
        result.figure(f"{prefix}graph_instances", graphed.graph_instances, "",
                      f"CUDA graph instances of the combined executor, hidden {h}")
        result.figure(f"{prefix}graph_mib", graphed.graph_bytes / 2**20, "MiB",
                      f"their private pools and static buffers, hidden {h}")
    result.note(f"hidden {h}: median of {rounds} rounds after one warm-up; the link: "
                f"{link.describe()}; CUDA graphs: {note}; host ms: until step() returned (the "
                "issue time); kernel ms: summed GPU time of every kernel of one step "
                "(torch.profiler; more than the step's ms where kernels ran at once, less where "
                "the GPU idled); cudaMallocs: device allocations during one warm step "
                "(torch.cuda.memory_stats num_device_alloc; n/a on CPU); GPU idle: share of the "
                "combined step's node window with no node on either stream")
    return measured


def _row(ctx, result, runs, med, inputs, targets, label: str, graphs_on: str,  # noqa: ANN001
         key: str) -> list:
    graphs = graphs_on != "off"
    plain, combined = med[("plain", graphs)], med[("combined", graphs)]
    spans, exposed = _traced_step(runs[("combined", graphs)], inputs, targets)
    kernel = {way: _kernel_ms(ctx, runs[(way, graphs)], inputs, targets) for way in WAYS}
    allocs = {way: _allocations(ctx, runs[(way, graphs)], inputs, targets) for way in WAYS}
    suffix = "_graphs" if graphs else ""
    speedup = plain.device_ms / combined.device_ms
    what = f"{label}, graphs {graphs_on}"
    result.figure(f"{key}combined_vs_plain{suffix}", speedup, "x",
                  f"plain / combined step, {what}", headline=not graphs)
    result.figure(f"{key}host_combined_vs_plain{suffix}", combined.host_ms / plain.host_ms, "x",
                  f"combined / plain host ms per step, {what}")
    host_share = None if kernel["combined"] is None else combined.host_ms / kernel["combined"]
    result.figure(f"{key}host_vs_kernel{suffix}", host_share, "x",
                  f"combined step's host issue ms / its kernel ms, {what}")
    return [label, graphs_on, plain.device_ms, combined.device_ms, speedup,
            plain.host_ms, combined.host_ms, kernel["plain"], kernel["combined"], host_share,
            f"{exposed:.0%}", f"{timeline.idle_share(spans):.0%}", allocs["plain"],
            allocs["combined"]]


def _allocations(ctx, run_executor: PipelineExecutor, inputs, targets) -> int | None:  # noqa: ANN001
    """Device allocations (cudaMalloc) one more step makes on a warm caching allocator."""
    if not ctx.cuda:
        return None
    before = torch.cuda.memory_stats(ctx.device).get("num_device_alloc")
    run_executor.step(inputs, targets)
    torch.cuda.synchronize(ctx.device)
    zero_grads(run_executor.stages[0].parameters())
    after = torch.cuda.memory_stats(ctx.device).get("num_device_alloc")
    return None if before is None or after is None else after - before


def _kernel_ms(ctx, run_executor: PipelineExecutor, inputs, targets) -> float | None:  # noqa: ANN001
    """Summed GPU milliseconds of all kernels of one step (torch.profiler), None on CPU."""
    if not ctx.cuda:
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_executor.step(inputs, targets)
        torch.cuda.synchronize(ctx.device)
    zero_grads(run_executor.stages[0].parameters())
    total_us = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages())
    return total_us / 1e3


def _median_steps(ctx, runs: dict, inputs, targets,  # noqa: ANN001
                  rounds: int) -> dict:
    """Median GPU and host ms per executor, the executors' steps alternating (round 0 warms up
    and captures the graphs)."""
    times: dict = {key: [] for key in runs}
    for round_index in range(rounds + 1):
        for key, run_executor in runs.items():
            timed = time_ms(lambda: run_executor.step(inputs, targets), ctx.device)
            zero_grads(run_executor.stages[0].parameters())
            if round_index:
                times[key].append(timed)
    return {key: Timed(statistics.median(t.device_ms for t in values),
                       statistics.median(t.host_ms for t in values))
            for key, values in times.items()}


def _traced_step(run_executor: PipelineExecutor, inputs,  # noqa: ANN001
                 targets) -> tuple[list, float]:
    """One combined step with the executor's node trace on: its node spans (ms) and the
    exposed share of its all-to-all time."""
    run_executor.record_trace = True
    try:
        out = run_executor.step(inputs, targets)
    finally:
        run_executor.record_trace = False
    zero_grads(run_executor.stages[0].parameters())
    if out.trace is None:
        raise RuntimeError("the combined executor recorded no node trace (record_trace)")
    return node_spans(out.trace), out.exposed_comm_fraction
