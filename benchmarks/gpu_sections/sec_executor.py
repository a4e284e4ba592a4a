"""executor: the pipeline executor on one GPU -- pp = 1, 1f1b, 8 microbatches of the
reference MoE GPT in bf16 (fp32 main gradients, ``cast_to_bf16``), plain schedule vs its
combined variant.

- Bitwise, under deterministic kernels (``megapipe.train.determinism``, non-strict: attention
  on the math backend, ``CUBLAS_WORKSPACE_CONFIG`` set for this section): one step of the
  plain schedule, the plain schedule again (the control: if two plain runs differ, a kernel is
  non-deterministic and no comparison below says anything about megapipe, and the report says
  so), the combined one, the combined one with deferred expert weight gradients
  (``delay_wgrad_compute``), and the combined one with a slow communication stream (an
  ``EmulatedLink`` of 2 ms per all-to-all whose rows are written after its wait: the race
  detector, since a consumer that skips a cross-stream wait then reads unwritten memory).
  Every loss and every fp32 main gradient must equal the plain run's (``torch.equal``).
- Step times: plain and combined steps alternating, median GPU milliseconds and host
  milliseconds per step (time until ``step`` returned), and the device allocations
  (``cudaMalloc``) a warm step makes; without a link (ep = 1: the comm nodes move nothing, so
  the ratio is the co-scheduling's own cost) and with megapipe's ``EmulatedLink`` making each
  all-to-all last the mean experts node (comm ~ compute: the whole pipeline step's gain from
  hiding it).
- GPU idle share and exposed all-to-all of a combined step, from the executor's own node trace
  (``record_trace``: CUDA events around every node on the streams).
"""

from __future__ import annotations

import statistics
import warnings

import torch

from megapipe.models.config import GPTConfig
from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage
from megapipe.overlap.main_grad import accumulated_grad, zero_grads
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.schedule import build_schedule
from megapipe.train.determinism import deterministic_kernels
from megapipe.train.mixed_precision import cast_to_bf16

from gpu_sections import timeline
from gpu_sections.gpu_timing import Timed, node_spans, time_ms
from gpu_sections.link_model import make_link, set_link

MICROBATCHES = 8
REAL = (GPTConfig(hidden_size=1024, num_heads=16, num_layers=4, seq_length=1024,
                  ffn_hidden_size=4096, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=2048,
                  first_k_dense_layers=1), 2)
DRY = (GPTConfig(hidden_size=32, num_heads=2, num_layers=2, seq_length=16, ffn_hidden_size=64,
                 num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, first_k_dense_layers=1), 2)
WAYS = {"plain": {"overlap": False}, "combined": {"overlap": True},
        "combined, wgrad delayed": {"overlap": True, "delay_wgrad_compute": True}}


def batch(config: GPTConfig, micro_batch: int, device: torch.device, seed: int = 0):  # noqa: ANN201
    """Token ids and labels, split into the microbatches."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (MICROBATCHES * micro_batch, config.seq_length + 1),
                        generator=generator).to(device)
    return list(ids[:, :-1].chunk(MICROBATCHES)), list(ids[:, 1:].chunk(MICROBATCHES))


def executor(config: GPTConfig, device: torch.device, overlap: bool,
             **options) -> PipelineExecutor:  # noqa: ANN003
    """A bf16 stage (fp32 main gradients) under 1f1b, plain or combined."""
    stage = build_stage(config, 0, 1).to(device)
    cast_to_bf16([stage], list(stage.parameters()))
    schedule = build_schedule("1f1b", 1, MICROBATCHES, overlap=overlap)
    return PipelineExecutor(schedule, {0: stage}, loss_fn=gpt_loss, **options)


def run(ctx, result) -> None:  # noqa: ANN001
    config, micro_batch = REAL if ctx.cuda else DRY
    result.figure("model", f"{config.num_layers} layers ({config.first_k_dense_layers} dense), "
                  f"hidden {config.hidden_size}, {config.num_experts} experts x "
                  f"{config.moe_ffn_hidden_size} top-{config.moe_top_k}, {MICROBATCHES} "
                  f"microbatches of {micro_batch} x {config.seq_length} tokens, bf16")
    _bitwise(ctx, result, config, micro_batch)
    if ctx.enough_time(result, "step times", 20.0 if ctx.cuda else 2.0):
        _step_times(ctx, result, config, micro_batch)


RACE_LINK_MS = 2.0  # per all-to-all: long enough for a consumer that does not wait to run


def _bitwise(ctx, result, config: GPTConfig, micro_batch: int) -> None:  # noqa: ANN001
    inputs, targets = batch(config, micro_batch, ctx.device)
    payload = micro_batch * config.seq_length * config.moe_top_k * config.hidden_size * 2
    race_link = make_link("sleep", RACE_LINK_MS, ctx.device, payload)
    runs = {"plain": ({}, None), "plain again (control)": ({}, None),
            **{way: (options, None) for way, options in WAYS.items() if way != "plain"},
            f"combined, slow comm stream ({RACE_LINK_MS:g} ms per all-to-all)":
                ({"overlap": True}, race_link)}
    steps = {}
    with warnings.catch_warnings(record=True) as caught, \
            deterministic_kernels(strict=False):
        warnings.simplefilter("always")
        for way, (options, link) in runs.items():
            with executor(config, ctx.device, **{"overlap": False, **options}) as run_executor:
                stage = run_executor.stages[0]
                set_link(stage.moe_layers(), link)
                out = run_executor.step(inputs, targets)
                steps[way] = ([out.losses[m] for m in sorted(out.losses)],
                              [(n, accumulated_grad(p)) for n, p in stage.named_parameters()])
    kernels = sorted({str(w.message).splitlines()[0][:160] for w in caught
                      if "determinis" in str(w.message)})
    result.figure("nondeterministic_warnings", len(kernels), "kinds",
                  "non-deterministic kernels torch warned about")
    for text in kernels:
        result.note(f"torch warned: {text}")
    plain = steps.pop("plain")
    control = steps.pop("plain again (control)")
    same, detail = _compare(plain, control)
    if not result.check("control: two plain runs give the same bits (else a kernel is "
                        "non-deterministic, which no comparison below can tell from megapipe)",
                        same, detail):
        for way in steps:
            result.skip(f"{way} vs plain, bitwise", "inconclusive: the control differs, a kernel "
                        "is non-deterministic on this machine (not a megapipe defect)")
        return
    for way, run in steps.items():
        same, detail = _compare(plain, run)
        result.check(f"{way}: losses and fp32 main gradients equal the plain schedule's "
                     "bitwise (bf16)", same, detail)


def _compare(reference, run) -> tuple[bool, str]:  # noqa: ANN001
    """Whether two runs' losses and gradients are bitwise equal, and what differs."""
    (ref_losses, ref_grads), (losses, grads) = reference, run
    losses_same = len(losses) == len(ref_losses) == MICROBATCHES and all(
        torch.equal(a, b) for a, b in zip(ref_losses, losses))
    differ = [n for (n, a), (_, b) in zip(ref_grads, grads)
              if a is None or b is None or not torch.equal(a, b)]
    detail = (f"{len(losses)} microbatch losses ({'equal' if losses_same else 'differ'}), "
              f"{len(grads)} gradients" + (f"; differ: {', '.join(differ[:5])}" if differ else ""))
    return losses_same and not differ and len(grads) == len(ref_grads), detail


def _step_times(ctx, result, config: GPTConfig, micro_batch: int) -> None:  # noqa: ANN001
    inputs, targets = batch(config, micro_batch, ctx.device, seed=1)
    rounds = 5 if ctx.cuda else 2
    runs = {"plain": executor(config, ctx.device, False),
            "combined": executor(config, ctx.device, True)}
    rows = []
    try:
        traced, _ = _traced_step(runs["combined"], inputs, targets)
        experts = [s.duration for s in traced
                   if s.label[:1] in "FB" and s.label.endswith("experts")]
        moe_layers = [layer for r in runs.values() for layer in r.stages[0].moe_layers()]
        payload = micro_batch * config.seq_length * config.moe_top_k * config.hidden_size * 2
        link = make_link("sleep", statistics.mean(experts), ctx.device, payload)
        for label, with_link in (("no link", None), ("sleep link, comm ~ experts", link)):
            set_link(moe_layers, with_link)
            med = _median_steps(ctx, runs, inputs, targets, rounds)
            spans, exposed = _traced_step(runs["combined"], inputs, targets)
            plain, combined = med["plain"], med["combined"]
            rows.append([label, plain.device_ms, combined.device_ms,
                         plain.device_ms / combined.device_ms, plain.host_ms, combined.host_ms,
                         _allocations(ctx, runs["plain"], inputs, targets),
                         _allocations(ctx, runs["combined"], inputs, targets),
                         _kernel_ms(ctx, runs["plain"], inputs, targets),
                         _kernel_ms(ctx, runs["combined"], inputs, targets),
                         f"{exposed:.0%}", f"{timeline.idle_share(spans):.0%}"])
            key = "link_" if with_link else ""
            result.figure(f"{key}combined_vs_plain", plain.device_ms / combined.device_ms, "x",
                          f"plain / combined step, {label}", headline=True)
            result.figure(f"{key}host_combined_vs_plain", combined.host_ms / plain.host_ms, "x",
                          f"combined / plain host ms per step, {label}")
    finally:
        for run_executor in runs.values():
            run_executor.close()
    result.table("1f1b step, bf16", ["all-to-all", "plain ms", "combined ms", "plain / combined",
                                     "plain host ms", "combined host ms", "plain cudaMallocs",
                                     "combined cudaMallocs", "plain kernel ms",
                                     "combined kernel ms", "exposed a2a (combined)",
                                     "GPU idle (combined)"], rows)
    result.note(f"median of {rounds} rounds after one warm-up; the link: {link.describe()}; host "
                "ms: until step() returned; cudaMallocs: device allocations during one warm "
                "step (torch.cuda.memory_stats num_device_alloc; n/a on CPU); kernel ms: summed "
                "GPU time of every kernel of one step (torch.profiler; more than the step's ms "
                "where kernels ran at once, less where the GPU idled); GPU idle: share of "
                "the combined step's node window with no node on either stream")


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
                  rounds: int) -> dict[str, Timed]:
    """Median GPU and host ms per executor, plain and combined steps alternating (round 0
    warms up)."""
    times: dict[str, list[Timed]] = {label: [] for label in runs}
    for round_index in range(rounds + 1):
        for label, run_executor in runs.items():
            timed = time_ms(lambda: run_executor.step(inputs, targets), ctx.device)
            zero_grads(run_executor.stages[0].parameters())
            if round_index:
                times[label].append(timed)
    return {label: Timed(statistics.median(t.device_ms for t in values),
                         statistics.median(t.host_ms for t in values))
            for label, values in times.items()}


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
