"""Rank-side code for the Megatron-Core adapter tests: Megatron's schedules and megapipe's front
end on the same weights and data (run inside a RankPool of 4 per megatron-core release).

Every task starts with ``use_release`` (the pool's processes import one release). Every case
uses the whole pool (4 ranks: dp = 4 / (pp * tp)), because Megatron's ``parallel_state`` spans
the world; it is re-initialised per case. Models come from ``mcore_models``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from support import megatron_cpu
from support.mcore_models import MICRO_BATCH, SEQ, VOCAB, McoreCase, TEContractLinear, build_chunks
from support.mcore_releases import use_release

Release = tuple[str, "str | None"]  # (version, directory to import it from)


def warm_up(release: Release | None = None) -> str:
    """Import the release (None: the installed one) and patch it for CPU (seconds per process,
    once per pool)."""
    import importlib

    if release is not None:
        use_release(*release)
    megatron_cpu.apply()
    for name in ("megatron.core.models.gpt.gpt_model", "megatron.core.distributed"):
        importlib.import_module(name)
    import megatron.core

    return megatron.core.__version__


_LAYOUT: list = [None]  # the (tp, pp, ep) Megatron's parallel_state is set up for
_LAYOUTS: dict[tuple, dict[str, Any]] = {}  # (tp, pp, ep) -> Megatron's parallel state for it


def _setup(case: McoreCase) -> None:
    """Megatron's parallel state for ``case``: made once per layout and kept (a layout met
    again gets its groups back), the virtual pipeline size and the seeds set for every case.
    Groups are never ended: on gloo each keeps threads while anything holds it, and the earlier
    cases' Megatron modules keep theirs alive (through hooks held by autograd), so ending and
    making them again per layout change only added threads (a pool past its thread limit
    starts afresh and imports Megatron again: seconds per restart)."""
    megatron_cpu.apply()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random

    _reset_moe_metrics()
    vpp = case.vpp if case.vpp > 1 else None
    layout = (case.tp, case.pp, case.ep)
    if _LAYOUT[0] != layout or not parallel_state.model_parallel_is_initialized():
        if _LAYOUT[0] is not None and parallel_state.model_parallel_is_initialized():
            _LAYOUTS[_LAYOUT[0]] = _parallel_state(parallel_state)
        if layout in _LAYOUTS:
            vars(parallel_state).update(_LAYOUTS[layout])
        else:
            parallel_state.destroy_model_parallel()  # forgets the groups, ends none (no gloo ones)
            parallel_state.initialize_model_parallel(
                case.tp, case.pp, vpp, expert_model_parallel_size=case.ep,
                expert_tensor_parallel_size=1, create_gloo_process_groups=False,
            )
        _LAYOUT[0] = layout
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp)
    parallel_state.set_virtual_pipeline_model_parallel_rank(0 if vpp else None)
    random.model_parallel_cuda_manual_seed(1234)


def _parallel_state(parallel_state: Any) -> dict[str, Any]:
    """Megatron's module-level parallel state (its ``_UPPER_CASE`` globals: groups, ranks)."""
    return {name: value for name, value in vars(parallel_state).items()
            if name.startswith("_") and not name.startswith("__") and name.isupper()}


def _reset_moe_metrics() -> None:
    """Megatron keeps one process-wide tracker of MoE metrics, sized by the first model's layer
    count; each case starts a fresh one (its model may have MTP layers)."""
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:  # before 0.18: a dict in moe_utils
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
    else:
        destroy_moe_metrics_tracker()


def microbatches(case: McoreCase, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for i in range(case.microbatches):
        g = torch.Generator().manual_seed(100 * dp_rank + i)
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def _loss_func(output: torch.Tensor):
    """Megatron's 3-tuple form: summed token losses, the token count, the logged mean."""
    total = output.float().sum()
    num_tokens = torch.tensor(output.numel(), dtype=torch.int)
    return total, num_tokens, {"lm loss": (total / num_tokens).detach()}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """A Megatron forward_step_func (the ``return_schedule_plan`` form is what Megatron's own
    combined 1F1B asks for)."""
    tokens, labels = next(data_iterator)
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
    if return_schedule_plan:
        return model.build_schedule_plan(tokens, positions, None, labels=labels), _loss_func
    output = model(tokens, positions, None, labels=labels)
    return output, _loss_func


def portable(value: Any) -> Any:
    """``value`` with every tensor as a numpy array: results cross the process boundary by
    value (tensors would each keep a shared-memory file descriptor open in the test process)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(portable(v) for v in value)
    return value


def _grads(chunks, names) -> dict[str, torch.Tensor]:
    out = {}
    for chunk, chunk_names in zip(chunks, names):
        for name, p in chunk.named_parameters():
            grad = getattr(p, "main_grad", None)
            grad = p.grad if grad is None else grad
            if grad is not None:
                out[chunk_names[name]] = grad.detach().clone().float()
    return out


def _expert_biases(chunks, names) -> dict[str, torch.Tensor]:
    """Each router's expert bias (a buffer; 0.19's quantile-balancing ``qb_beta`` too), keyed
    by the global name of its weight."""
    out = {}
    for chunk, chunk_names in zip(chunks, names):
        for name, module in chunk.named_modules():
            weight = chunk_names.get(f"{name}.weight")
            for kind in ("expert_bias", "qb_beta"):
                bias = getattr(module, kind, None)
                if isinstance(bias, torch.Tensor) and weight is not None:
                    out[weight.replace(".weight", f".{kind}")] = bias.detach().clone()
    return out


def _run(case: McoreCase, func, chunks, names) -> dict[str, Any]:
    from megatron.core import parallel_state

    data = microbatches(case, parallel_state.get_data_parallel_rank())
    iterators = [iter(data) for _ in chunks]
    for chunk in chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
    losses = func(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=case.microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
    )
    return {
        "losses": [d["lm loss"].item() for d in losses],
        "grads": _grads(chunks, names),
        "expert_bias": _expert_biases(chunks, names),
        "pending_wgrads": sum(TEContractLinear.pending(c) for c in chunks),
        "dp_rank": parallel_state.get_data_parallel_rank(),
    }


def megatron_reference(case: McoreCase) -> dict[str, Any]:
    """Megatron's own schedule (no overlap), its DDP and finalize_model_grads; delayed weight
    gradients off (Megatron drives them only in its own overlap)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config, chunks, names = build_chunks(replace(case, schedule=None), ddp=True, delay_wgrad=False)
    config.finalize_model_grads_func = finalize_model_grads
    return _run(replace(case, schedule=None), get_forward_backward_func(), chunks, names)


def megapipe_run(case: McoreCase, overlap: bool, trace: bool = False) -> dict[str, Any]:
    """megapipe's front end on Megatron's chunks (reduction as ``case.reduce`` says)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    from megapipe import get_forward_backward_func

    ddp = case.reduce == "ddp"
    config, chunks, names = build_chunks(case, ddp=ddp)
    if ddp:
        config.finalize_model_grads_func = finalize_model_grads
    if case.delay_wgrad:
        config.delay_wgrad_compute = True  # Megatron's own check wants its overlap and bf16
    func = get_forward_backward_func(
        pp=case.pp, vpp=case.vpp, schedule=case.schedule, groups=megapipe_groups(case),
        timeout=60.0, overlap_moe_expert_parallel_comm=overlap, reduce_grads=not ddp,
        record_trace=trace, delay_wgrad_compute=overlap and case.delay_wgrad,
    )
    try:
        result = _run(case, func, chunks, names)
    finally:
        func.close()
    if trace:
        from support.combined_cases import pair_names

        step = func.last_result
        result["pairs"] = pair_names(step.trace) if step is not None and step.trace else []
        spans = step.trace.by_start() if step is not None and step.trace else []
        result["wgrads"] = sorted({s.node for s in spans if s.direction == "W"})
        result["wgrad_beside_dispatch"] = any(
            p.direction == "B" and p.node.endswith("dispatch")
            for w in spans if w.direction == "W" for p in spans if p.slot == w.slot
        )
    result["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
    return result


_GROUPS: dict[tuple, Any] = {}


def megapipe_groups(case: McoreCase):
    """megapipe's process groups for the case's layout (made once per layout), checked against
    the groups Megatron's ``initialize_model_parallel`` made for the same sizes."""
    from megatron.core import parallel_state as ps

    from megapipe.parallel.config import ParallelConfig
    from megapipe.parallel.groups import create_groups

    key = (case.pp, case.ep, case.tp)
    if key not in _GROUPS:
        _GROUPS[key] = create_groups(ParallelConfig(pp=case.pp, dp=case.dp, ep=case.ep,
                                                    tp=case.tp))
    groups = _GROUPS[key]
    ranks = dist.get_process_group_ranks
    megatron = {
        "pp": ps.get_pipeline_model_parallel_group(), "dp": ps.get_data_parallel_group(),
        "ep": ps.get_expert_model_parallel_group(),
        "expert_dp": ps.get_expert_data_parallel_group(),
        "tp": ps.get_tensor_model_parallel_group(),
    }
    for name, group in megatron.items():
        mine = getattr(groups, f"{name}_ranks")
        assert tuple(ranks(group)) == tuple(mine), (name, ranks(group), mine)
    return groups


def compare_case(release: Release, case: McoreCase,
                 runs: tuple[str, ...] = ("plain", "overlap")) -> dict:
    """On one rank: Megatron's reference and megapipe's runs of ``case``."""
    use_release(*release)
    _setup(case)
    out = {"reference": megatron_reference(case)}
    for run in runs:
        out[run] = megapipe_run(case, overlap=run != "plain", trace=run == "overlap")
    dist.barrier()
    return portable(out)


def undriven_case(release: Release, case: McoreCase) -> dict:
    """The negative control of ``delay_wgrad_compute``: Megatron's own (non-overlapped) schedule
    never calls ``backward_dw()``, so the TE-contract layers end the step without gradients."""
    use_release(*release)  # first: a restarted pool process has imported no Megatron yet
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _setup(case)
    config, chunks, names = build_chunks(replace(case, schedule=None))
    config.delay_wgrad_compute = True
    out = _run(replace(case, schedule=None), get_forward_backward_func(), chunks, names)
    dist.barrier()
    return portable(out)


def _bf16_chunks(case: McoreCase, megatron_overlap: bool):
    """bf16 chunks as a Megatron bf16 script builds them: config.bf16, Float16Module, DDP with
    fp32 gradient buffers, finalize_model_grads."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer.module import Float16Module

    config, chunks, names = build_chunks(case)
    config.bf16 = True
    config.pipeline_dtype = torch.bfloat16
    config.overlap_moe_expert_parallel_comm = megatron_overlap
    config.finalize_model_grads_func = finalize_model_grads
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    wrapped = [
        DistributedDataParallel(config, ddp_config, Float16Module(config, chunk),
                                disable_bucketing=j > 0)
        for j, chunk in enumerate(chunks)
    ]
    names = [{f"module.module.{n}": v for n, v in chunk_names.items()} for chunk_names in names]
    return wrapped, names


def bf16_combined_case(release: Release, case: McoreCase) -> dict:
    """bf16: Megatron's own combined 1F1B (its overlap) against megapipe's combined step on
    the same bf16 chunks (Megatron's DDP reduction in both)."""
    use_release(*release)  # first: a restarted pool process has imported no Megatron yet
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_func

    from megapipe import get_forward_backward_func

    _setup(case)
    chunks, names = _bf16_chunks(replace(case, schedule=None), megatron_overlap=True)
    out = {"reference": _run(replace(case, schedule=None), megatron_func(), chunks, names)}
    chunks, names = _bf16_chunks(case, megatron_overlap=False)
    func = get_forward_backward_func(
        pp=case.pp, vpp=case.vpp, schedule=case.schedule, groups=megapipe_groups(case),
        timeout=60.0, overlap_moe_expert_parallel_comm=True, reduce_grads=False,
    )
    try:
        out["overlap"] = _run(case, func, chunks, names)
    finally:
        func.close()
    dist.barrier()
    return portable(out)


def cyclic_garbage_case(case: McoreCase, trace: bool) -> dict[str, int]:
    """On one rank: megapipe's front end, overlap on, on Megatron's chunks for ``case``; what
    the cyclic collector frees after a step (``support.cyclic_garbage``: megapipe objects and
    tensors by type name; empty when the step leaves no reference cycle). A first step runs
    outside the probe (Megatron builds some state on its first call)."""
    from megapipe import get_forward_backward_func
    from support.cyclic_garbage import cyclic_garbage

    _setup(case)
    config, chunks, names = build_chunks(case)
    if case.delay_wgrad:
        config.delay_wgrad_compute = True
    func = get_forward_backward_func(
        pp=case.pp, vpp=case.vpp, schedule=case.schedule, groups=megapipe_groups(case),
        timeout=60.0, overlap_moe_expert_parallel_comm=True, record_trace=trace,
        delay_wgrad_compute=case.delay_wgrad,
    )
    try:
        _run(case, func, chunks, names)
        found = cyclic_garbage(lambda: _run(case, func, chunks, names))
    finally:
        func.close()
    dist.barrier()
    return found
