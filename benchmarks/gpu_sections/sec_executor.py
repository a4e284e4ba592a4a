"""executor: the pipeline executor on one GPU -- pp = 1, 1f1b, 8 microbatches of the
reference MoE GPT, plain schedule vs its combined variant.

- Bitwise: one step of each from the same weights and batch in fp32 under
  ``torch.use_deterministic_algorithms`` (``CUBLAS_WORKSPACE_CONFIG`` is set for this section):
  every loss and every gradient must be equal (``torch.equal``).
- Step times: bf16 weights, plain and combined steps alternating, median GPU milliseconds.
- GPU idle share of a combined step: the executor's node trace is swapped for an
  ``EventTrace`` (CUDA events around every node), and the share of the step during which no
  node ran on either stream is reported. With ep = 1 the comm nodes move nothing, so the
  ratio measures the co-scheduling's own cost, not hidden communication (``overlap`` does that).
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager

import torch

import megapipe.pipeline.executor as executor_module
from megapipe.models.config import GPTConfig
from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.schedule import build_schedule

from gpu_sections import timeline
from gpu_sections.gpu_timing import EventTrace, time_ms

MICROBATCHES = 8
REAL = (GPTConfig(hidden_size=1024, num_heads=16, num_layers=4, seq_length=1024,
                  ffn_hidden_size=4096, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=2048,
                  first_k_dense_layers=1), 2)
DRY = (GPTConfig(hidden_size=32, num_heads=2, num_layers=2, seq_length=16, ffn_hidden_size=64,
                 num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, first_k_dense_layers=1), 2)


def batch(config: GPTConfig, micro_batch: int, device: torch.device, seed: int = 0):  # noqa: ANN201
    """Token ids and labels, split into the microbatches."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (MICROBATCHES * micro_batch, config.seq_length + 1),
                        generator=generator).to(device)
    return list(ids[:, :-1].chunk(MICROBATCHES)), list(ids[:, 1:].chunk(MICROBATCHES))


def executor(config: GPTConfig, overlap: bool, device: torch.device, dtype: torch.dtype,
             **options) -> PipelineExecutor:  # noqa: ANN003
    stage = build_stage(config, 0, 1).to(device=device, dtype=dtype)
    schedule = build_schedule("1f1b", 1, MICROBATCHES, overlap=overlap)
    return PipelineExecutor(schedule, {0: stage}, loss_fn=gpt_loss, **options)


def run(ctx, result) -> None:  # noqa: ANN001
    config, micro_batch = REAL if ctx.cuda else DRY
    result.figure("model", f"{config.num_layers} layers ({config.first_k_dense_layers} dense), "
                  f"hidden {config.hidden_size}, {config.num_experts} experts x "
                  f"{config.moe_ffn_hidden_size} top-{config.moe_top_k}, {MICROBATCHES} "
                  f"microbatches of {micro_batch} x {config.seq_length} tokens")
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
        for overlap in (False, True):
            with executor(config, overlap, ctx.device, torch.float32) as run_executor:
                out = run_executor.step(inputs, targets)
                stage = run_executor.stages[0]
                steps[overlap] = ([out.losses[m] for m in sorted(out.losses)],
                                  [(n, p.grad) for n, p in stage.named_parameters()])
    (plain_losses, plain_grads), (comb_losses, comb_grads) = steps[False], steps[True]
    same_losses = len(plain_losses) == MICROBATCHES and all(
        torch.equal(a, b) for a, b in zip(plain_losses, comb_losses))
    differ = [n for (n, a), (_, b) in zip(plain_grads, comb_grads)
              if a is None or b is None or not torch.equal(a, b)]
    result.check("combined step losses equal the plain schedule's bitwise (fp32)", same_losses,
                 f"{len(plain_losses)} microbatch losses")
    result.check("combined step gradients equal the plain schedule's bitwise (fp32)", not differ,
                 f"{len(plain_grads)} parameters" + (f"; differ: {', '.join(differ[:5])}" if differ else ""))


def _step_times(ctx, result, config: GPTConfig, micro_batch: int) -> None:  # noqa: ANN001
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    inputs, targets = batch(config, micro_batch, ctx.device, seed=1)
    rounds = 5 if ctx.cuda else 2
    plain = executor(config, False, ctx.device, dtype)
    combined = executor(config, True, ctx.device, dtype, record_trace=True)
    times: dict[str, list[float]] = {"plain": [], "combined": []}
    idle = []
    traced = hasattr(executor_module, "NodeTrace")
    if not traced:
        result.skip("GPU idle share", "megapipe.pipeline.executor no longer builds its trace "
                    "through NodeTrace; read the engine's own timings instead")
    try:
        for round_index in range(rounds + 1):  # round 0 warms up
            for label, run_executor in (("plain", plain), ("combined", combined)):
                if label == "combined" and traced:
                    ms, share = _traced_step(ctx, run_executor, inputs, targets)
                    idle.append(share)
                else:
                    ms = time_ms(lambda: run_executor.step(inputs, targets), ctx.device).device_ms
                run_executor.stages[0].zero_grad(set_to_none=True)
                if round_index:
                    times[label].append(ms)
    finally:
        plain.close()
        combined.close()
    med = {label: statistics.median(values) for label, values in times.items()}
    result.figure("plain_step_ms", med["plain"], "ms", "plain 1f1b step", headline=True)
    result.figure("combined_step_ms", med["combined"], "ms", "combined 1f1b step", headline=True)
    result.figure("combined_vs_plain", med["plain"] / med["combined"], "x", "plain / combined")
    if idle:
        result.figure("combined_idle", statistics.median(idle[1:] or idle) * 100, "%",
                      "GPU idle, combined", headline=True)
        result.note("GPU idle: share of a combined step, from its start to its last node, "
                    "during which no node ran on either stream (CUDA events around every node)")
    result.note(f"step times in {str(dtype)[6:]}, median of {rounds} rounds after one warm-up")


def _traced_step(ctx, run_executor: PipelineExecutor, inputs, targets) -> tuple[float, float]:  # noqa: ANN001
    """One timed step with the executor's trace swapped for an EventTrace: (GPU ms, GPU idle
    share from the step's start to its last node's end)."""
    made: list[EventTrace] = []

    def make_trace(*args, **kwargs) -> EventTrace:  # noqa: ANN002, ANN003 (whatever it is given)
        made.append(EventTrace(ctx.device))
        return made[-1]

    original = executor_module.NodeTrace
    executor_module.NodeTrace = make_trace
    try:
        ms = time_ms(lambda: run_executor.step(inputs, targets), ctx.device).device_ms
    finally:
        executor_module.NodeTrace = original
    if not made:
        raise RuntimeError("the executor did not build its trace through NodeTrace()")
    spans = made[0].gpu_spans()
    return ms, timeline.idle_share(spans, 0.0, timeline.window(spans)[1])
