"""Rank-side code for the Megatron-Core adapter tests: Megatron's model, Megatron's schedules
and megapipe's front end on the same weights and data (run inside a RankPool of 4).

Every case uses the whole pool (4 ranks: dp = 4 / pp), because Megatron's ``parallel_state``
spans the world; it is re-initialised per case. Weights are a pure function of each
parameter's *global* name (global layer and expert index), so chunks built for any placement
(loop or V) and any ep hold the same model. Gradients come back keyed by global name, so runs
with different placements compare directly.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from support import megatron_cpu

NUM_LAYERS = 4
VOCAB = 64
SEQ = 8
MICRO_BATCH = 2
WORLD = 4


@dataclass(frozen=True)
class McoreCase:
    """One configuration: Megatron's layout (pp, vpp, ep) and megapipe's schedule on it."""

    pp: int
    vpp: int = 1
    ep: int = 1
    schedule: str | None = None  # megapipe's schedule; None: Megatron's default for pp/vpp
    microbatches: int = 4
    tie: bool = False  # share_embeddings_and_output_weights
    shared_expert: bool = False
    reduce: str = "megapipe"  # "megapipe": reduce_grads=True; "ddp": Megatron's DDP + finalize

    @property
    def dp(self) -> int:
        return WORLD // self.pp

    @property
    def v_placement(self) -> bool:
        return self.schedule in ("zbv", "dualpipev")

    def __str__(self) -> str:
        extra = "".join(f"+{f}" for f in ("tie", "shared_expert") if getattr(self, f))
        return (f"{self.schedule or 'megatron-default'}(pp={self.pp},vpp={self.vpp},ep={self.ep},"
                f"dp={self.dp},reduce={self.reduce}{extra})")


def warm_up() -> None:
    """Import Megatron-Core and patch it for CPU (seconds per process, once per pool)."""
    import importlib

    megatron_cpu.apply()
    for name in ("megatron.core.models.gpt.gpt_model", "megatron.core.distributed"):
        importlib.import_module(name)


def _setup(case: McoreCase) -> None:
    megatron_cpu.apply()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        1, case.pp, case.vpp if case.vpp > 1 else None, expert_model_parallel_size=case.ep,
        create_gloo_process_groups=False,
    )
    random.model_parallel_cuda_manual_seed(1234)


def _config(case: McoreCase, dtype: torch.dtype = torch.float32):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
        moe_layer_freq=[0] + [1] * (NUM_LAYERS - 1),
        moe_shared_expert_intermediate_size=16 if case.shared_expert else None,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01, pipeline_model_parallel_size=case.pp,
        virtual_pipeline_model_parallel_size=case.vpp if case.vpp > 1 else None,
        expert_model_parallel_size=case.ep, pipeline_dtype=dtype, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, add_bias_linear=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, batch_p2p_comm=False,
        batch_p2p_sync=False, deallocate_pipeline_outputs=False,
    )


def _parts_of_rank(case: McoreCase, pp_rank: int) -> list[int]:
    """The model parts this pipeline rank holds, in chunk order (megapipe's placements)."""
    from megapipe.schedule import build_schedule

    name = case.schedule or ("interleaved-1f1b" if case.vpp > 1 else "1f1b")
    schedule = build_schedule(name, case.pp, case.microbatches, vpp=case.vpp)
    return [schedule.model_part(s) for s in schedule.stages_of_rank(pp_rank)]


def _global_name(name: str, part: int, layers_per_part: int, ep_rank: int, local: int) -> str:
    name = re.sub(r"^(module\.)+", "", name)
    name = re.sub(r"decoder\.layers\.(\d+)\.",
                  lambda m: f"decoder.layers.{part * layers_per_part + int(m.group(1))}.", name)
    return re.sub(r"local_experts\.(\d+)\.",
                  lambda m: f"local_experts.{ep_rank * local + int(m.group(1))}.", name)


def _init_weights(chunk: torch.nn.Module, names: dict[str, str], tie: bool) -> None:
    """Every parameter drawn from a generator keyed by its global name (the tied output
    weight by the embedding's)."""
    with torch.no_grad():
        for name, p in chunk.named_parameters():
            key = names[name]
            if tie and key == "output_layer.weight":
                key = "embedding.word_embeddings.weight"
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            values = torch.randn(p.shape, generator=g) * 0.02
            if key.endswith("layernorm.weight"):
                values += 1.0
            p.copy_(values)


def build_chunks(case: McoreCase, dtype: torch.dtype = torch.float32, ddp: bool = False):
    """This rank's chunks (GPTModel, in DDP when asked) and their global parameter names."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = _config(case, dtype)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    num_parts = case.pp * case.vpp if not case.v_placement else 2 * case.pp
    chunks, names = [], []
    for j, part in enumerate(_parts_of_rank(case, pp_rank)):
        model = GPTModel(
            config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
            pre_process=part == 0, post_process=part == num_parts - 1,
            share_embeddings_and_output_weights=case.tie, position_embedding_type="rope",
            vp_stage=j if (case.vpp > 1 or case.v_placement) else None,
        )
        local = 4 // case.ep
        chunk_names = {
            n: _global_name(n, part, NUM_LAYERS // num_parts, ep_rank, local)
            for n, _ in model.named_parameters()
        }
        _init_weights(model, chunk_names, case.tie)
        if ddp:
            model = _ddp(config, model, j)
            chunk_names = {f"module.{n}": v for n, v in chunk_names.items()}
        chunks.append(model)
        names.append(chunk_names)
    return config, chunks, names


def _ddp(config, model, index):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False)
    return DistributedDataParallel(config, ddp_config, model, disable_bucketing=index > 0)


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


def _grads(chunks, names) -> dict[str, torch.Tensor]:
    out = {}
    for chunk, chunk_names in zip(chunks, names):
        for name, p in chunk.named_parameters():
            grad = getattr(p, "main_grad", None)
            grad = p.grad if grad is None else grad
            if grad is not None:
                out[chunk_names[name]] = grad.detach().clone().float()
    return out


def _run(case: McoreCase, func, chunks, names, zero: bool = True) -> dict[str, Any]:
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
        "dp_rank": parallel_state.get_data_parallel_rank(),
    }


def megatron_reference(case: McoreCase) -> dict[str, Any]:
    """Megatron's own schedule (no overlap), its DDP and finalize_model_grads."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config, chunks, names = build_chunks(replace(case, schedule=None), ddp=True)
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
    groups = _megapipe_groups(case)
    func = get_forward_backward_func(
        pp=case.pp, vpp=case.vpp, schedule=case.schedule, groups=groups, timeout=60.0,
        overlap_moe_expert_parallel_comm=overlap, reduce_grads=not ddp, record_trace=trace,
    )
    try:
        result = _run(case, func, chunks, names)
    finally:
        func.close()
    if trace:
        from support.combined_cases import pair_names

        step = func.last_result
        result["pairs"] = pair_names(step.trace) if step is not None and step.trace else []
        result["moe_layers_run"] = sorted({
            (s.microbatch, s.layer) for s in (step.trace.spans if step and step.trace else [])
            if s.node.endswith("dispatch") and s.direction == "F"
        })
    result["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
    return result


_GROUPS: dict[tuple, Any] = {}


def _megapipe_groups(case: McoreCase):
    """megapipe's process groups for the case's layout (made once per layout; Megatron's rank
    order, data parallel fastest, is megapipe's too)."""
    from megapipe.parallel.config import ParallelConfig
    from megapipe.parallel.groups import create_groups

    key = (case.pp, case.ep)
    if key not in _GROUPS:
        _GROUPS[key] = create_groups(ParallelConfig(pp=case.pp, dp=case.dp, ep=case.ep))
    return _GROUPS[key]


def compare_case(case: McoreCase, runs: tuple[str, ...] = ("plain", "overlap")) -> dict:
    """On one rank: Megatron's reference and megapipe's runs of ``case``."""
    _setup(case)
    out = {"reference": megatron_reference(case)}
    for run in runs:
        out[run] = megapipe_run(case, overlap=run != "plain", trace=run == "overlap")
    dist.barrier()
    return out


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


def bf16_combined_case(case: McoreCase) -> dict:
    """bf16: Megatron's own combined 1F1B (its overlap) against megapipe's combined step on
    the same bf16 chunks (Megatron's DDP reduction in both)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_func

    from megapipe import get_forward_backward_func

    _setup(case)
    chunks, names = _bf16_chunks(replace(case, schedule=None), megatron_overlap=True)
    out = {"reference": _run(replace(case, schedule=None), megatron_func(), chunks, names)}
    chunks, names = _bf16_chunks(case, megatron_overlap=False)
    func = get_forward_backward_func(
        pp=case.pp, vpp=case.vpp, schedule=case.schedule, groups=_megapipe_groups(case),
        timeout=60.0, overlap_moe_expert_parallel_comm=True, reduce_grads=False,
    )
    try:
        out["overlap"] = _run(case, func, chunks, names)
    finally:
        func.close()
    dist.barrier()
    return out
