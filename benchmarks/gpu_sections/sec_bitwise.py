"""bitwise: the executor's runs compared bit for bit on one GPU, each against a control -- pp = 1,
1f1b, 8 microbatches of the reference MoE GPT at hidden 1024 in bf16 (fp32 main gradients),
built on the device.

Under deterministic kernels (``megapipe.train.determinism``, non-strict: attention on the math
backend, ``CUBLAS_WORKSPACE_CONFIG`` set for this section): one step of the plain schedule, the
plain schedule again (the control: if two plain runs differ, a kernel is non-deterministic and
no comparison below says anything about megapipe, and the report says so), the combined one,
the combined one with deferred expert weight gradients (``delay_wgrad_compute``), and the
combined one with a slow communication stream (an ``EmulatedLink`` of 2 ms per all-to-all whose
rows are written after its wait: the race detector, since a consumer that skips a cross-stream
wait then reads unwritten memory). Every loss and every fp32 main gradient must equal the plain
run's (``torch.equal``). The same comparisons with CUDA graphs on (``cuda_graph_impl="local"``,
the static nodes: ``attn moe_router moe_preprocess mlp``): plain and combined with graphs
against the plain run without.
"""

from __future__ import annotations

import warnings

import torch

from gpu_sections.executor_steps import GRAPHS, MICROBATCHES, batch, describe, executor
from gpu_sections.link_model import make_link, set_link
from gpu_sections.sec_executor import DRY, REAL
from megapipe.models.config import GPTConfig
from megapipe.precision.main_grad import accumulated_grad
from megapipe.train.determinism import deterministic_kernels

WAYS = {"plain": {"overlap": False}, "combined": {"overlap": True},
        "combined, wgrad delayed": {"overlap": True, "delay_wgrad_compute": True},
        "plain, CUDA graphs": {"overlap": False, **GRAPHS},
        "combined, CUDA graphs": {"overlap": True, **GRAPHS},
        "combined, wgrad delayed, CUDA graphs": {"overlap": True, "delay_wgrad_compute": True,
                                                 **GRAPHS}}


def run(ctx, result) -> None:  # noqa: ANN001
    config, micro_batch = REAL if ctx.cuda else DRY
    result.figure("model", describe(config, micro_batch))
    _bitwise(ctx, result, config, micro_batch)


RACE_LINK_MS = 2.0  # per all-to-all: long enough for a consumer that does not wait to run


def _bitwise(ctx, result, config: GPTConfig, micro_batch: int) -> None:  # noqa: ANN001
    inputs, targets = batch(config, micro_batch, ctx.device)
    payload = micro_batch * config.seq_length * config.moe_top_k * config.hidden_size * 2
    race_link = make_link("sleep", RACE_LINK_MS, ctx.device, payload)
    runs = {"plain": ({}, None), "plain again (control)": ({}, None),
            **{way: (options, None) for way, options in WAYS.items() if way != "plain"
               and (ctx.cuda or "graph" not in way)},  # without CUDA graphs run eager
            f"combined, slow comm stream ({RACE_LINK_MS:g} ms per all-to-all)":
                ({"overlap": True}, race_link)}
    if not ctx.cuda:
        result.note("CUDA graphs need CUDA: the runs with graphs are left out here")
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

