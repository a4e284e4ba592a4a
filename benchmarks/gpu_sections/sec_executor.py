"""executor: the pipeline executor on one GPU -- pp = 1, 1f1b, 8 microbatches of the
reference MoE GPT in bf16 (fp32 main gradients, ``cast_to_bf16``), plain schedule vs its
combined variant.

- Bitwise: one step of the plain schedule, the combined one, and the combined one with deferred
  expert weight gradients (``delay_wgrad_compute``), from the same weights and batch under
  ``torch.use_deterministic_algorithms`` (``CUBLAS_WORKSPACE_CONFIG`` is set for this
  section): every loss and every fp32 main gradient must be equal (``torch.equal``).
- Step times: plain and combined steps alternating, median GPU milliseconds; without a link
  (ep = 1: the comm nodes move nothing, so the ratio is the co-scheduling's own cost) and with
  megapipe's ``EmulatedLink`` making each all-to-all last the mean experts node (comm ~
  compute: the whole pipeline step's gain from hiding it).
- GPU idle share and exposed all-to-all of a combined step, from the executor's own node trace
  (``record_trace``: CUDA events around every node on the streams).
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager

import torch

from megapipe.models.config import GPTConfig
from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage
from megapipe.overlap.main_grad import accumulated_grad, zero_grads
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.schedule import build_schedule
from megapipe.train.mixed_precision import cast_to_bf16

from gpu_sections import timeline
from gpu_sections.gpu_timing import node_spans, time_ms
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


@contextmanager
def _deterministic(cuda: bool):  # noqa: ANN202
    if not cuda:
        yield
        return
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _bitwise(ctx, result, config: GPTConfig, micro_batch: int) -> None:  # noqa: ANN001
    inputs, targets = batch(config, micro_batch, ctx.device)
    steps = {}
    with _deterministic(ctx.cuda):
        for way, options in WAYS.items():
            with executor(config, ctx.device, **options) as run_executor:
                out = run_executor.step(inputs, targets)
                stage = run_executor.stages[0]
                steps[way] = ([out.losses[m] for m in sorted(out.losses)],
                              [(n, accumulated_grad(p)) for n, p in stage.named_parameters()])
    plain_losses, plain_grads = steps["plain"]
    for way in list(WAYS)[1:]:
        losses, grads = steps[way]
        same = len(plain_losses) == MICROBATCHES and all(
            torch.equal(a, b) for a, b in zip(plain_losses, losses))
        differ = [n for (n, a), (_, b) in zip(plain_grads, grads)
                  if a is None or b is None or not torch.equal(a, b)]
        result.check(f"{way}: losses equal the plain schedule's bitwise (bf16)", same,
                     f"{len(losses)} microbatch losses")
        result.check(f"{way}: fp32 main gradients equal the plain schedule's bitwise", not differ,
                     f"{len(grads)} parameters"
                     + (f"; differ: {', '.join(differ[:5])}" if differ else ""))


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
            rows.append([label, med["plain"], med["combined"], med["plain"] / med["combined"],
                         f"{exposed:.0%}", f"{timeline.idle_share(spans):.0%}"])
            key = "link_" if with_link else ""
            result.figure(f"{key}combined_vs_plain", med["plain"] / med["combined"], "x",
                          f"plain / combined step, {label}", headline=True)
    finally:
        for run_executor in runs.values():
            run_executor.close()
    result.table("1f1b step, bf16", ["all-to-all", "plain ms", "combined ms", "plain / combined",
                                     "exposed a2a (combined)", "GPU idle (combined)"], rows)
    result.note(f"median of {rounds} rounds after one warm-up; the link: {link.describe()}; GPU "
                "idle: share of the combined step's node window with no node on either stream")


def _median_steps(ctx, runs: dict, inputs, targets,  # noqa: ANN001
                  rounds: int) -> dict[str, float]:
    """Median GPU ms per executor, plain and combined steps alternating (round 0 warms up)."""
    times: dict[str, list[float]] = {label: [] for label in runs}
    for round_index in range(rounds + 1):
        for label, run_executor in runs.items():
            ms = time_ms(lambda: run_executor.step(inputs, targets), ctx.device).device_ms
            zero_grads(run_executor.stages[0].parameters())
            if round_index:
                times[label].append(ms)
    return {label: statistics.median(values) for label, values in times.items()}


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
