"""The reference MoE GPT, written as node plans so the overlap engine can interleave its layers.

A transformer layer is pre-norm: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``. A dense layer
(the first ``first_k_dense_layers``, DeepSeek style) is one compute node. An MoE layer is five
nodes that reuse ``MoELayer``'s own node functions with the residual ``h`` riding along as a
leading tensor::

    attention   (compute)  (x,)          -> h = x + attn(norm(x)); MoE route of norm(h)
    dispatch    (comm)     (h, ...)      -> (h, ...)      MoE dispatch all-to-all
    experts     (compute)  (h, ...)      -> (h, ...)      MoE local experts
    combine     (comm)     (h, ...)      -> (h, ...)      MoE combine all-to-all
    finish      (compute)  (h, ...)      -> (h + moe_out,)

``forward`` of every layer and of ``GPTStage`` just runs these plans, so there is one copy of the
forward code. Every parameter is drawn from a generator keyed by (seed, global layer or expert
index, name), so any stage split and any EP size rebuild the single-process model's weights.
"""

from __future__ import annotations

from dataclasses import replace

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megapipe.models.config import GPTConfig
from megapipe.moe.experts import SwiGLUMLP
from megapipe.moe.layer import MoELayer
from megapipe.moe.seeding import seeded_normal
from megapipe.overlap.full_recompute import recompute_plan
from megapipe.overlap.graphs import Graphable
from megapipe.overlap.layer_groups import group_plans
from megapipe.overlap.recompute import recompute
from megapipe.overlap.plan import (
    ChunkedPlan, Fork, LayerState, Node, NodeKind, NodeRunner, Plan, run_nodes,
)

Tensors = tuple[torch.Tensor, ...]
MOE_ATTENTION_GRAPH_MODULES = ("attn", "moe_router", "moe_preprocess")
DENSE_GRAPH_MODULES = ("attn", "mlp")
"""What a MoE layer's attention node and a dense layer's node hold, in Megatron's CUDA-graph
module names (``overlap.graphs``)."""


def graph_holders(config: GPTConfig) -> list[tuple[str, ...]]:
    """The modules of each kind of capturable node the model has (``graph_rules``)."""
    kinds = {config.is_moe_layer(layer) for layer in range(config.num_layers)}
    return [MOE_ATTENTION_GRAPH_MODULES] * (True in kinds) + [DENSE_GRAPH_MODULES] * (
        False in kinds)


def _causal_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention core: causal softmax(q k^T / sqrt(d)) v."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention via ``scaled_dot_product_attention`` (no biases)."""

    def __init__(self, config: GPTConfig, layer_index: int) -> None:
        super().__init__()
        h, std, seed = config.hidden_size, config.init_std, config.seed
        self.num_heads = config.num_heads
        # Megatron's --recompute-modules core_attn: softmax(q k^T) v re-runs in backward
        self.recompute_core = "core_attn" in config.recompute_modules
        keys = ("attention", layer_index)
        self.w_qkv = nn.Parameter(seeded_normal((3 * h, h), std, seed, *keys, "qkv"))
        self.w_out = nn.Parameter(seeded_normal((h, h), std, seed, *keys, "out"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = F.linear(x, self.w_qkv).view(b, s, 3, self.num_heads, h // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [b, heads, s, head_dim]
        y = recompute(_causal_core, q, k, v) if self.recompute_core else _causal_core(q, k, v)
        return F.linear(y.transpose(1, 2).reshape(b, s, h), self.w_out)


class TransformerLayer(nn.Module):
    """One pre-norm layer with a dense SwiGLU MLP or an MoE FFN, described by ``node_plan``."""

    def __init__(
        self, config: GPTConfig, layer_index: int, ep_group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.attention_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attention = CausalSelfAttention(config, layer_index)
        self.ffn_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.is_moe = config.is_moe_layer(layer_index)
        if self.is_moe:
            self.moe = MoELayer(
                config.moe_config(), ep_group=ep_group, layer_index=layer_index, seed=config.seed
            )
        else:
            self.mlp = SwiGLUMLP(
                config.hidden_size, config.ffn_hidden_size, config.seed, "dense_mlp", layer_index,
                init_std=config.init_std,
            )

    def _attention_block(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attention(self.attention_norm(x))

    def _dense(self, state: LayerState, inputs: Tensors) -> Tensors:
        (x,) = inputs
        h = self._attention_block(x)
        return (h + self.mlp(self.ffn_norm(h)),)

    def node_plan(self) -> Plan:
        """``[layer]`` (dense) or ``[attention, dispatch, experts, combine, finish]`` (MoE; its
        ``.chunked(k)`` has a fork of k expert groups in the middle, ``MoELayer.chunked_plan``)."""
        name = f"layer{self.layer_index}"
        if not self.is_moe:
            graphable = Graphable(DENSE_GRAPH_MODULES, tuple(self.parameters()))
            return Plan([Node(name, NodeKind.COMPUTE, self._dense, graphable=graphable)])
        return ChunkedPlan(
            self._with_residual(self.moe.node_plan()),
            lambda chunks: self._with_residual(self.moe.chunked_plan(chunks)),
        )

    def _with_residual(self, moe_plan: list) -> list:
        """The MoE plan with the attention block before its route and the residual after its
        finish (the residual ``h`` rides along as a leading tensor, past any fork)."""
        name = f"layer{self.layer_index}"
        route, *middle, finish = moe_plan

        def attention(state: LayerState, inputs: Tensors) -> Tensors:
            (x,) = inputs
            h = self._attention_block(x)
            return route.fn(state, (h, self.ffn_norm(h)))

        def finish_with_residual(state: LayerState, inputs: Tensors) -> Tensors:
            h, moe_out = finish.fn(state, inputs)
            return (h + moe_out,)

        def named(node: Node) -> Node:
            return replace(node, name=f"{name}.{node.name}")

        middle = [
            Fork(tuple(tuple(named(n) for n in b) for b in item.branches), item.width)
            if isinstance(item, Fork) else named(item)
            for item in middle
        ]
        return [
            Node(f"{name}.attention", NodeKind.COMPUTE, attention,
                 graphable=self._attention_graphable()),
            *middle,
            Node(f"{name}.finish", NodeKind.COMPUTE, finish_with_residual),
        ]

    def _attention_graphable(self) -> Graphable:
        """What the MoE attention node holds for CUDA graphs (``overlap.graphs``): Megatron's
        attn, moe_router and moe_preprocess (route's permutation into expert order); every
        parameter of the layer but the experts' (their nodes come later); the auxiliary-loss
        scale it reads and the log it records into."""
        moe = self.moe
        later = ("moe.experts.", "moe.shared_expert.")
        params = tuple(p for n, p in self.named_parameters() if not n.startswith(later))
        return Graphable(MOE_ATTENTION_GRAPH_MODULES, params,
                         key=lambda: moe.aux_loss_scale, logs=((moe, "aux_loss_log"),))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_nodes(self.node_plan(), (x,))[0]


class Embedding(nn.Module):
    """Token plus learned absolute position embedding: int64 ids [b, s] -> hidden [b, s, h]."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        h, std, seed = config.hidden_size, config.init_std, config.seed
        vocab, seq = config.vocab_size, config.seq_length
        self.tokens = nn.Parameter(seeded_normal((vocab, h), std, seed, "embedding", "tokens"))
        self.positions = nn.Parameter(seeded_normal((seq, h), std, seed, "embedding", "positions"))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype != torch.int64 or ids.dim() != 2:
            raise ValueError(
                f"the first stage takes int64 token ids [batch, seq], got {ids.dtype} of shape "
                f"{tuple(ids.shape)}"
            )
        if ids.shape[1] > self.config.seq_length:
            raise ValueError(
                f"sequence length {ids.shape[1]} exceeds GPTConfig.seq_length="
                f"{self.config.seq_length}"
            )
        return F.embedding(ids, self.tokens) + self.positions[: ids.shape[1]]


class OutputHead(nn.Module):
    """Final RMSNorm and the (untied) output projection to vocabulary logits."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        shape = (config.vocab_size, config.hidden_size)
        self.weight = nn.Parameter(seeded_normal(shape, config.init_std, config.seed, "head"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.weight)


def _single_node(name: str, module: nn.Module) -> Plan:
    def fn(state: LayerState, inputs: Tensors) -> Tensors:
        (x,) = inputs
        return (module(x),)

    return Plan([Node(name, NodeKind.COMPUTE, fn)])


class GPTStage(nn.Module):
    """One model part: embedding (first part), the layers ``layer_indices``, head (last part).

    Implements the engine's ``StageModule`` protocol (layer plans, node runner, Megatron's
    ``set_input_tensor``, the auxiliary-loss scale), so it overlaps in combined schedules.

    Parameter names use global layer indices (``layers.3.attention.w_qkv``), so the state dict
    of every stage is a slice of the single-process model's.
    """

    def __init__(
        self,
        config: GPTConfig,
        layer_indices: Sequence[int],
        is_first: bool,
        is_last: bool,
        ep_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_indices = tuple(layer_indices)
        self.is_first = is_first
        self.is_last = is_last
        self.embedding = Embedding(config) if is_first else None
        self.layers = nn.ModuleDict(
            {str(i): TransformerLayer(config, i, ep_group) for i in self.layer_indices}
        )
        self.head = OutputHead(config) if is_last else None
        self._layer_plans: list[Plan] | None = None  # layer_plans(), made once
        self.input_tensor: torch.Tensor | None = None  # Megatron's set_input_tensor convention
        # runs each layer plan in forward (run_layer(nodes, inputs)); None: run_nodes. The
        # engine sets a tape or co-scheduling runner here around a user's forward call
        # (the StageModule protocol, megapipe.pipeline.stage_module).
        self.node_runner: NodeRunner | None = None

    def set_input_tensor(self, input_tensor: torch.Tensor | Sequence[torch.Tensor] | None) -> None:
        """Megatron's convention (used by ``megapipe.get_forward_backward_func``): a stage after
        the first computes on this received activation instead of its ``forward`` argument."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0] if input_tensor else None
        self.input_tensor = input_tensor

    def layer_plans(self) -> list[Plan]:
        """Node plans in execution order: embedding, each layer, final norm + head. A layer the
        config recomputes whole (``recompute_method``) has its compute nodes wrapped by
        ``overlap.full_recompute.recompute_plan``: they keep only their inputs; with the uniform
        method and N > 1 layers, each group of N is one plan (``overlap.layer_groups``). Made
        once (the engine records them every step; a copy of the stage makes its own)."""
        if self._layer_plans is None:
            plans = [] if self.embedding is None else [_single_node("embedding", self.embedding)]
            plans += [self._layer_group_plan(group) for group in self._layer_groups()]
            if self.head is not None:
                plans.append(_single_node("head", self.head))
            self._layer_plans = plans
        return self._layer_plans

    def __getstate__(self) -> dict:
        # the plans' functions are bound to this stage's modules: a copy makes its own
        return {**super().__getstate__(), "_layer_plans": None}

    def _layer_groups(self) -> list[list[TransformerLayer]]:
        """The layers in recompute groups: N consecutive layers with uniform full recompute,
        else one layer each."""
        layers = list(self.layers.values())
        size = self.config.recompute_num_layers if self.config.recompute_method == "uniform" else 1
        return [layers[i:i + size] for i in range(0, len(layers), size)]

    def _layer_group_plan(self, group: list[TransformerLayer]) -> Plan:
        plan = group_plans([layer.node_plan() for layer in group])
        position = list(self.layers.values()).index(group[0])
        if not self.config.recomputes_layer(position):
            return plan
        return recompute_plan(plan, [p for layer in group for p in layer.parameters()])

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers of this stage."""
        return [layer.moe for layer in self.layers.values() if layer.is_moe]

    def set_aux_loss_scale(self, scale: float) -> None:
        """The factor of the MoE auxiliary losses' gradients (the engine: 1/num_microbatches)."""
        for layer in self.moe_layers():
            layer.aux_loss_scale = scale

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [b, s] (first stage) or hidden [b, s, h] -> hidden, or logits (last stage).

        A stage after the first uses the tensor given to ``set_input_tensor`` when there is one.
        """
        if self.embedding is None and self.input_tensor is not None:
            x = self.input_tensor
        if x is None:
            raise ValueError("GPTStage.forward needs an input (or set_input_tensor on a later stage)")
        if self.embedding is None and (not x.is_floating_point() or x.dim() != 3):
            raise ValueError(
                f"a stage after the first takes float hidden states [batch, seq, "
                f"{self.config.hidden_size}], got {x.dtype} of shape {tuple(x.shape)}"
            )
        values = (x,)
        runner = self.node_runner
        for plan in self.layer_plans():
            values = run_nodes(plan, values) if runner is None else runner.run_layer(plan, values)
        return values[0]


def gpt_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy (the MoE auxiliary losses enter through backward, not here)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
