"""graphs: MoE layers graphed whole against partial graphs and eager, combined against plain --
the executor section's 1f1b step (pp = 1, 8 microbatches, bf16, fp32 main gradients) on the
same model with ``--moe-expert-rank-capacity-factor 2`` (static shapes, no host read), at
hidden 1024 and 4096.

Per shape one bf16 stage is shared by six executors, stepped alternately: eager (no graphs),
partial graphs (``attn moe_router moe_preprocess mlp``: the attention node and dense layers) and
whole-layer graphs (``attn moe mlp``: attention, experts and finish of every MoE layer), each
plain and combined. Reported: median GPU and host milliseconds per step, plain / combined, the
whole-layer graphs' step against partial and eager, the graphs' instances and memory, and the
steps whose lanes overflowed (timed as they ran: a training step would rerun them dropless).
Without CUDA (a dry run) the graph rows are left out: graphs need CUDA (the CPU stand-in that
runs them is for tests, ``tests/benchmarks/test_gpu_check_graphs.py``).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from gpu_sections.executor_steps import GRAPHS, batch, bf16_stage, describe, executor
from gpu_sections.gpu_timing import Timed, time_ms
from gpu_sections.sec_executor import DRY, REAL, WIDE
from megapipe.moe.layer import take_overflow
from megapipe.precision.main_grad import zero_grads

RANK_CAPACITY = 2.0
MODES = {"eager": None, "partial": GRAPHS["cuda_graph_modules"],
         "whole": ("attn", "moe", "mlp")}
WAYS = ("plain", "combined")
COLUMNS = ["graphs", "plain ms", "combined ms", "plain / combined", "plain host ms",
           "combined host ms", "graph instances (combined)", "graph MiB (combined)"]


def run(ctx, result) -> None:  # noqa: ANN001
    shapes = (REAL, WIDE) if ctx.cuda else (DRY,)  # a dry run checks the code: one shape
    for index, (config, micro_batch) in enumerate(shapes):
        config = replace(config, moe_expert_rank_capacity_factor=RANK_CAPACITY)
        h = config.hidden_size
        result.figure(f"model_h{h}", describe(config, micro_batch)
                      + f", rank capacity factor {RANK_CAPACITY:g}")
        if ctx.enough_time(result, f"step times, hidden {h}",
                           (20.0, 30.0)[index] if ctx.cuda else 2.0):
            graph_times(ctx, result, config, micro_batch)


def graph_times(ctx, result, config, micro_batch: int,  # noqa: ANN001
                graph_api: Any = None) -> dict[tuple[str, str], Timed]:
    """The table and figures of one shape (module docstring); ``graph_api``: a stand-in for
    the graph calls (tests). Returns the median per (mode, way)."""
    microbatches = 8 if ctx.cuda else 4
    inputs, targets = batch(config, micro_batch, ctx.device, seed=1, microbatches=microbatches)
    rounds = 3 if ctx.cuda else 1
    stage = bf16_stage(config, ctx.device)
    take_overflow([stage])  # the flags cleared (a stage built on the meta device leaves its
    # buffers unwritten: to_empty)
    graphs_run = ctx.cuda or graph_api is not None
    modes = [m for m in MODES if graphs_run or MODES[m] is None]
    runs = {(mode, way): executor(config, ctx.device, way == "combined", stage, microbatches,
                                  **_options(MODES[mode], graph_api))
            for mode in modes for way in WAYS}
    try:
        times, overflowed, last = _median_steps(ctx, runs, inputs, targets, rounds)
    finally:
        for run_executor in runs.values():
            run_executor.close()
    h, rows = config.hidden_size, []
    for mode in modes:
        plain, combined = times[(mode, "plain")], times[(mode, "combined")]
        out = last[(mode, "combined")]
        mib = None if out.graph_bytes is None else out.graph_bytes / 2**20
        rows.append([mode, plain.device_ms, combined.device_ms,
                     plain.device_ms / combined.device_ms, plain.host_ms, combined.host_ms,
                     out.graph_instances, mib])
        result.figure(f"h{h}_{mode}_combined_vs_plain", plain.device_ms / combined.device_ms,
                      "x", f"plain / combined step, {mode}, hidden {h}")
    if "whole" in modes:
        for way in WAYS:
            for other in ("partial", "eager"):
                ratio = times[(other, way)].device_ms / times[("whole", way)].device_ms
                result.figure(f"h{h}_{way}_whole_vs_{other}", ratio, "x",
                              f"{way} step, {other} / whole-layer graphs ms, hidden {h}",
                              headline=way == "combined" and other == "partial")
    result.table(f"1f1b step, hidden {h}, bf16, rank capacity {RANK_CAPACITY:g}", COLUMNS, rows)
    result.figure(f"h{h}_overflowed_steps", overflowed, "",
                  f"steps whose lanes overflowed (of {len(runs) * (rounds + 1)}), hidden {h}")
    note = runs[(modes[-1], "plain")].cuda_graph_note if graphs_run else "left out (no CUDA)"
    result.note(f"hidden {h}: median of {rounds} rounds after one warm-up (which captures); "
                f"CUDA graphs: {note}; host ms: until step() returned (the issue time)")
    return times


def _options(modules: Any, graph_api: Any) -> dict[str, Any]:
    if modules is None:
        return {}
    options = {"cuda_graph_impl": "local", "cuda_graph_modules": tuple(modules)}
    return options if graph_api is None else {**options, "graph_api": graph_api}


def _median_steps(ctx, runs: dict, inputs, targets, rounds: int  # noqa: ANN001
                  ) -> tuple[dict, int, dict]:
    """Median GPU and host ms per executor, their steps alternating (round 0 warms up and
    captures), how many steps overflowed (read once at the end: no host read between), and
    each executor's last ``StepResult``."""
    times: dict = {key: [] for key in runs}
    flags, last = [], {}
    for round_index in range(rounds + 1):
        for key, run_executor in runs.items():
            timed = time_ms(lambda: last.__setitem__(key, run_executor.step(inputs, targets)),
                            ctx.device)
            zero_grads(run_executor.stages[0].parameters())
            flags.append(take_overflow(list(run_executor.stages.values())))
            if round_index:
                times[key].append(timed)
    overflowed = int(sum(int(f) for f in flags if f is not None)) if flags else 0
    medians = {key: Timed(statistics.median(t.device_ms for t in values),
                          statistics.median(t.host_ms for t in values))
               for key, values in times.items()}
    return medians, overflowed, last
