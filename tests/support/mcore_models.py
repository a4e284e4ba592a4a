"""Megatron-Core models for the adapter tests: configs, layer specs, chunks with known weights.

Runs inside a RankPool whose processes imported one megatron-core release
(``mcore_releases.use_release``). Weights are a pure function of each parameter's *global*
name (global layer and expert index, the tensor-parallel shard), so chunks built for any
placement (loop or V), any ep and any release hold the same model; gradients come back keyed
by global name.

``TEContractLinear`` makes Megatron's local linear layers follow TransformerEngine's deferred
weight-gradient contract (``delay_wgrad_compute``): TE itself cannot be installed here, so this
is what the adapter's ``backward_dw`` driving is tested against.
"""

from __future__ import annotations

import re
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

NUM_LAYERS = 4
VOCAB = 64
SEQ = 8
MICRO_BATCH = 2
WORLD = 4
EXPERTS = 4


@dataclass(frozen=True)
class McoreCase:
    """One configuration: Megatron's layout and features, and megapipe's schedule on it."""

    pp: int
    vpp: int = 1
    ep: int = 1
    tp: int = 1  # with sequence parallelism
    schedule: str | None = None  # megapipe's schedule; None: Megatron's default for pp/vpp
    microbatches: int = 4
    tie: bool = False  # share_embeddings_and_output_weights
    shared_expert: bool = False
    reduce: str = "megapipe"  # "megapipe": reduce_grads=True; "ddp": Megatron's DDP + finalize
    mtp: int = 0  # mtp_num_layers
    recompute: str | None = None  # "selective" (core_attn, layernorm, shared_experts, mlp), "full"
    recompute_method: str = "uniform"
    expert_bias: bool = False  # aux-loss-free balancing (sigmoid router with expert bias)
    balancing: str = "aux_loss"  # moe_router_load_balancing_type (0.19: "quantile_balancing")
    delay_wgrad: bool = False  # TE-contract linear layers with delay_wgrad_compute
    fused_norm: bool = False  # a pre-MLP norm that returns (output, residual), 0.17+

    @property
    def dp(self) -> int:
        return WORLD // (self.pp * self.tp)

    @property
    def v_placement(self) -> bool:
        return self.schedule in ("zbv", "dualpipev")

    def __str__(self) -> str:
        extra = "".join(f"+{f}" for f in ("tie", "shared_expert", "expert_bias", "delay_wgrad",
                                          "fused_norm") if getattr(self, f))
        extra += f"+{self.balancing}" if self.balancing != "aux_loss" else ""
        extra += f"+mtp{self.mtp}" if self.mtp else ""
        extra += (f"+recompute={self.recompute}"
                  + (f"/{self.recompute_method}" if self.recompute == "full" else "")
                  if self.recompute else "")
        tp = f"tp={self.tp}+sp," if self.tp > 1 else ""
        return (f"{self.schedule or 'megatron-default'}({tp}pp={self.pp},vpp={self.vpp},"
                f"ep={self.ep},dp={self.dp},reduce={self.reduce}{extra})")


def make_config(case: McoreCase, dtype: torch.dtype = torch.float32, **overrides: Any):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=NUM_LAYERS, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
        num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=16,
        moe_layer_freq=[0] + [1] * (NUM_LAYERS - 1),
        moe_shared_expert_intermediate_size=16 if case.shared_expert else None,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01, pipeline_model_parallel_size=case.pp,
        virtual_pipeline_model_parallel_size=case.vpp if case.vpp > 1 else None,
        tensor_model_parallel_size=case.tp, sequence_parallel=case.tp > 1,
        expert_model_parallel_size=case.ep, expert_tensor_parallel_size=1,
        pipeline_dtype=dtype, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, add_bias_linear=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, batch_p2p_comm=False,
        batch_p2p_sync=False, deallocate_pipeline_outputs=False,
        mtp_num_layers=case.mtp or None,
    )
    if case.balancing != "aux_loss":
        fields.update(moe_router_load_balancing_type=case.balancing, moe_aux_loss_coeff=0.0)
    if case.expert_bias:
        fields.update(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                      moe_router_bias_update_rate=0.01)
    if case.recompute == "selective":
        fields.update(recompute_granularity="selective",
                      recompute_modules=["core_attn", "layernorm", "mlp"]
                      + (["shared_experts"] if case.shared_expert else []))
    elif case.recompute == "full":
        fields.update(recompute_granularity="full", recompute_method=case.recompute_method,
                      recompute_num_layers=1)
    fields.update(overrides)
    return TransformerConfig(**fields)


def layers_per_part(case: McoreCase) -> int:
    return NUM_LAYERS // num_parts(case)


def num_parts(case: McoreCase) -> int:
    return 2 * case.pp if case.v_placement else case.pp * case.vpp


def parts_of_rank(case: McoreCase, pp_rank: int) -> list[int]:
    """The model parts this pipeline rank holds, in chunk order (megapipe's placements)."""
    from megapipe.schedule import build_schedule

    name = case.schedule or ("interleaved-1f1b" if case.vpp > 1 else "1f1b")
    schedule = build_schedule(name, case.pp, case.microbatches, vpp=case.vpp)
    return [schedule.model_part(s) for s in schedule.stages_of_rank(pp_rank)]


class _TupleNorm(torch.nn.Module):
    """A pre-MLP norm in the fused-residual style: returns (norm(x), x) (0.17+ unpacks it)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        for p in self.norm.parameters():
            p.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor):
        return self.norm(x), x


def block_spec(case: McoreCase, config: Any, part: int):
    """The layer specs of model ``part`` (``moe_layer_freq`` honoured: a dense first layer)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    specs = list(get_gpt_decoder_layer_specs(config, use_transformer_engine=False))
    per = layers_per_part(case)
    specs = specs[part * per:(part + 1) * per]
    if case.fused_norm:
        specs = [_with_tuple_norm(spec) for spec in specs]
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl

    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=LNImpl)


def _with_tuple_norm(spec):
    import copy

    spec = copy.deepcopy(spec)
    spec.submodules.pre_mlp_layernorm = _TupleNorm
    return spec


def global_name(name: str, part: int, per_part: int, ep_rank: int, local: int,
                tp_rank: int) -> str:
    name = re.sub(r"^(module\.)+", "", name)
    name = re.sub(r"decoder\.layers\.(\d+)\.",
                  lambda m: f"decoder.layers.{part * per_part + int(m.group(1))}.", name)
    name = re.sub(r"local_experts\.(\d+)\.",
                  lambda m: f"local_experts.{ep_rank * local + int(m.group(1))}.", name)
    return f"{name}@tp{tp_rank}"


def init_weights(chunk: torch.nn.Module, names: dict[str, str], tie: bool) -> None:
    """Every parameter drawn from a generator keyed by its global name (the tied output weight
    by the embedding's; norms near one; the expert bias, a buffer, left at zero)."""
    with torch.no_grad():
        for name, p in chunk.named_parameters():
            key = names[name]
            if tie and key.startswith("output_layer.weight"):
                key = key.replace("output_layer.weight", "embedding.word_embeddings.weight")
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            values = torch.randn(p.shape, generator=g) * 0.02
            if "norm" in key.split("@")[0] and key.split("@")[0].endswith("weight"):
                values += 1.0
            p.copy_(values)


def build_chunks(case: McoreCase, dtype: torch.dtype = torch.float32, ddp: bool = False,
                 delay_wgrad: bool | None = None, **overrides: Any):
    """This rank's chunks (GPTModel, in DDP when asked) and their global parameter names."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = make_config(case, dtype, **overrides)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    chunks, names = [], []
    parts = parts_of_rank(case, pp_rank)
    for j, part in enumerate(parts):
        vp_stage = j if (case.vpp > 1 or case.v_placement) else None
        spec = block_spec(case, config, part)
        mtp_spec = None
        last = part == num_parts(case) - 1
        if case.mtp and last:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            mtp_spec = get_gpt_mtp_block_spec(config, spec.layer_specs[-1],
                                              use_transformer_engine=False, vp_stage=vp_stage)
        model = GPTModel(
            config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
            pre_process=part == 0, post_process=last,
            share_embeddings_and_output_weights=case.tie, position_embedding_type="rope",
            vp_stage=vp_stage, mtp_block_spec=mtp_spec,
        )
        local = EXPERTS // case.ep
        chunk_names = {
            n: global_name(n, part, layers_per_part(case), ep_rank, local, tp_rank)
            for n, _ in model.named_parameters()
        }
        init_weights(model, chunk_names, case.tie)
        if case.delay_wgrad if delay_wgrad is None else delay_wgrad:
            TEContractLinear.apply_to(model)
        elif case.delay_wgrad:
            TEContractLinear.apply_to(model, delay=False)
        if ddp:
            model = wrap_ddp(config, model, j)
            chunk_names = {f"module.{n}": v for n, v in chunk_names.items()}
        chunks.append(model)
        names.append(chunk_names)
    return config, chunks, names


def wrap_ddp(config, model, index):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False)
    return DistributedDataParallel(config, ddp_config, model, disable_bucketing=index > 0)


# -------------------------------------------------------------------- TE's wgrad contract
class WeightGradStore:
    """TransformerEngine's ``WeightGradStore`` contract: ``delay_wgrad_compute()``, and a FIFO
    of pending weight-gradient computations, one ``put`` per backward, one ``pop`` per
    ``backward_dw()``."""

    def __init__(self, delay: bool) -> None:
        self.delay = delay
        self.context: deque = deque()

    def delay_wgrad_compute(self) -> bool:
        return self.delay

    def put(self, tensors, func) -> None:
        self.context.append((tensors, func))

    def pop(self):
        if not self.context:
            raise RuntimeError("backward_dw() called more often than backward")
        tensors, func = self.context.popleft()
        return func(*tensors)


class _ContractLinear(torch.autograd.Function):
    """Megatron's linear (``input @ weight.T``, no bias, no tensor parallelism) whose weight
    gradient is deferred to ``backward_dw()`` when the module's store delays it."""

    @staticmethod
    # autograd.Function's own arguments
    def forward(ctx, input, weight, store):  # type: ignore[override]
        ctx.save_for_backward(input, weight)
        ctx.store = store
        return torch.matmul(input, weight.t())

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]  # autograd.Function's own arguments
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        g2 = grad_output.reshape(-1, grad_output.shape[-1])
        x2 = input.reshape(-1, input.shape[-1])
        if ctx.store.delay_wgrad_compute():
            ctx.store.put((g2, x2), lambda g, x: g.t().matmul(x))
            return grad_input, None, None
        return grad_input, g2.t().matmul(x2), None


class TEContractLinear:
    """Turns Megatron's local linear layers inside the decoder and MTP layers into layers that
    follow TE's deferred weight-gradient contract (the output layer keeps computing its own)."""

    @staticmethod
    def apply_to(model: torch.nn.Module, delay: bool = True) -> None:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        for name, module in model.named_modules():
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            if name.endswith("output_layer"):
                continue
            module.wgrad_store = WeightGradStore(delay)
            module._forward_impl = _forward_impl(module)
            module.backward_dw = _backward_dw(module)

    @staticmethod
    def pending(model: torch.nn.Module) -> int:
        """How many weight gradients wait for backward_dw() in ``model``."""
        return sum(len(m.wgrad_store.context) for m in model.modules()
                   if isinstance(getattr(m, "wgrad_store", None), WeightGradStore))


def _forward_impl(module):
    def impl(input, weight, bias=None, *, allreduce_dgrad=False, sequence_parallel=False, **_):
        assert bias is None and not allreduce_dgrad and not sequence_parallel, (
            "the TE-contract test layer covers tp=1 without bias")
        return _ContractLinear.apply(input, weight, module.wgrad_store)

    return impl


def _backward_dw(module):
    def backward_dw() -> None:
        if not module.wgrad_store.delay_wgrad_compute():
            return
        grad = module.wgrad_store.pop()
        weight = module.weight
        with torch.no_grad():
            if weight.grad is None:  # as autograd accumulates a gradient
                weight.grad = grad
            else:
                weight.grad += grad

    return backward_dw
