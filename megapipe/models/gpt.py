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

from collections.abc import Sequence
from dataclasses import replace
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megapipe.graphs.nodes import Graphable
from megapipe.models.attention import CausalSelfAttention
from megapipe.models.config import GPTConfig
from megapipe.models.norm import RMSNorm
from megapipe.moe.experts import SwiGLUMLP
from megapipe.moe.layer import MoELayer, MoEState
from megapipe.moe.seeding import seeded_normal
from megapipe.overlap.plan import Fork, LayerState, Node, NodeKind, NodeRunner, Plan, run_nodes
from megapipe.recompute.full import recompute_plan
from megapipe.recompute.layer_groups import group_plans

Tensors = tuple[torch.Tensor, ...]
MOE_ATTENTION_GRAPH_MODULES = ("attn", "moe_router", "moe_preprocess")
DENSE_GRAPH_MODULES = ("attn", "mlp")
MOE_GRAPH_MODULES = ("moe",)
"""What a MoE layer's attention node, a dense layer's node and a MoE layer's experts and finish
nodes hold, in Megatron's CUDA-graph module names (``graphs.nodes``)."""


def graph_holders(config: GPTConfig) -> list[tuple[str, ...]]:
    """The modules of each kind of capturable node the model has (``graphs.rules``): a MoE
    layer's experts and finish nodes only with a rank capacity (static shapes)."""
    kinds = {config.is_moe_layer(layer) for layer in range(config.num_layers)}
    static_moe = True in kinds and config.moe_config().rank_capacity_factor is not None
    return (
        [MOE_ATTENTION_GRAPH_MODULES] * (True in kinds)
        + [DENSE_GRAPH_MODULES] * (False in kinds)
        + [MOE_GRAPH_MODULES] * static_moe
    )


class TransformerLayer(nn.Module):
    """One pre-norm layer with a dense SwiGLU MLP or an MoE FFN, described by ``node_plan``."""

    def __init__(
        self, config: GPTConfig, layer_index: int, ep_group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.attention_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attention = CausalSelfAttention(config, layer_index)
        self.ffn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.is_moe = config.is_moe_layer(layer_index)
        if self.is_moe:
            self.moe = MoELayer(
                config.moe_config(), ep_group=ep_group, layer_index=layer_index, seed=config.seed
            )
        else:
            self.mlp = SwiGLUMLP(
                config.hidden_size,
                config.ffn_hidden_size,
                config.seed,
                "dense_mlp",
                layer_index,
                init_std=config.init_std,
            )

    def _attention_block(self, x: torch.Tensor) -> torch.Tensor:
        normed, x = self.attention_norm(x, with_residual=True)  # its backward adds x's gradient
        return x + self.attention(normed)

    def _dense(self, state: LayerState, inputs: Tensors) -> Tensors:
        (x,) = inputs
        h = self._attention_block(x)
        normed, h = self.ffn_norm(h, with_residual=True)  # its backward adds h's gradient
        return (h + self.mlp(normed),)

    def node_plan(self) -> Plan:
        """``[layer]`` (dense) or ``[attention, dispatch, experts, combine, finish]`` (MoE; its
        ``.in_waves(k)`` has a fork of k expert groups in the middle, ``MoELayer.wave_plan``)."""
        name = f"layer{self.layer_index}"
        if not self.is_moe:
            graphable = Graphable(
                DENSE_GRAPH_MODULES, tuple(self.parameters()), buffers=tuple(self.buffers())
            )
            return Plan(
                [Node(name, NodeKind.COMPUTE, self._dense, graphable=graphable)], LayerState
            )
        return self.moe.node_plan().wrapped(self._with_residual)

    def _with_residual(self, moe_plan: list) -> list:
        """The MoE plan with the attention block before its route and the residual after its
        finish (the residual ``h`` rides along as a leading tensor, past any fork)."""
        name = f"layer{self.layer_index}"
        route, *middle, finish = moe_plan

        def attention(state: MoEState, inputs: Tensors) -> Tensors:
            (x,) = inputs
            h = self._attention_block(x)
            return route.fn(state, (h, self.ffn_norm(h)))

        def finish_with_residual(state: MoEState, inputs: Tensors) -> Tensors:
            h, moe_out = finish.fn(state, inputs)
            return (h + moe_out,)

        def named(node: Node) -> Node:
            return replace(node, name=f"{name}.{node.name}")

        middle = [
            Fork(tuple(tuple(named(n) for n in b) for b in item.branches), item.width)
            if isinstance(item, Fork)
            else named(item)
            for item in middle
        ]
        return [
            Node(
                f"{name}.attention",
                NodeKind.COMPUTE,
                attention,
                graphable=self._attention_graphable(),
            ),
            *middle,
            Node(
                f"{name}.finish", NodeKind.COMPUTE, finish_with_residual, graphable=finish.graphable
            ),
        ]

    def _attention_graphable(self) -> Graphable:
        """What the MoE attention node holds for CUDA graphs (``graphs.nodes``): Megatron's
        attn, moe_router and moe_preprocess (route's permutation into expert order); every
        parameter of the layer but the experts' (their nodes come later); the auxiliary-loss
        scale it reads and whether a rank capacity is on (route then places the sends), the
        log it records into; the rotary tables it reads in place, and
        the rank capacity's overflow flag it ORs into."""
        moe = self.moe
        later = ("moe.experts.", "moe.shared_expert.")
        params = tuple(p for n, p in self.named_parameters() if not n.startswith(later))
        return Graphable(
            MOE_ATTENTION_GRAPH_MODULES,
            params,
            key=lambda: (moe.aux_loss_scale, moe.sync_free),
            logs=((moe, "aux_loss_log"),),
            buffers=tuple(self.attention.buffers()) + (moe.rank_overflow,),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_nodes(self.node_plan(), (x,))[0]


class Embedding(nn.Module):
    """Token embedding, plus a learned absolute position embedding unless the model uses rope:
    int64 ids [b, s] -> hidden [b, s, h]. ``tokens_only``: the token table alone (the last
    stage's copy of a tied output weight, ``OutputHead``)."""

    def __init__(self, config: GPTConfig, tokens_only: bool = False) -> None:
        super().__init__()
        self.config = config
        h, std, seed = config.hidden_size, config.init_std, config.seed
        vocab, seq = config.vocab_size, config.seq_length
        self.tokens = nn.Parameter(seeded_normal((vocab, h), std, seed, "embedding", "tokens"))
        self.positions = None
        if config.position_embedding_type == "learned_absolute" and not tokens_only:
            self.positions = nn.Parameter(
                seeded_normal((seq, h), std, seed, "embedding", "positions")
            )

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
        tokens = F.embedding(ids, self.tokens)
        return tokens if self.positions is None else tokens + self.positions[: ids.shape[1]]


class OutputHead(nn.Module):
    """Final RMSNorm and the output projection to vocabulary logits: its own ``weight``
    (untied), or ``tied`` (the token table of the stage's ``Embedding``)."""

    def __init__(self, config: GPTConfig, tied: Embedding | None = None) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.weight: nn.Parameter | None = None
        # the tied table in a tuple, so it is not registered twice
        self._tied: tuple[Embedding, ...] = () if tied is None else (tied,)
        if tied is None:
            shape = (config.vocab_size, config.hidden_size)
            self.weight = nn.Parameter(seeded_normal(shape, config.init_std, config.seed, "head"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight is not None else self._tied[0].tokens
        return F.linear(self.norm(x), weight)


def _single_node(name: str, module: nn.Module) -> Plan:
    def fn(state: LayerState, inputs: Tensors) -> Tensors:
        (x,) = inputs
        return (module(x),)

    return Plan([Node(name, NodeKind.COMPUTE, fn)], LayerState)


class GPTStage(nn.Module):
    """One model part: embedding (first part), the layers ``layer_indices``, head (last part).

    Implements the engine's ``StageModule`` protocol (layer plans, node runner, Megatron's
    ``set_input_tensor``, the auxiliary-loss scale), so it overlaps in combined schedules.

    Parameter names use global layer indices (``layers.3.attention.w_qkv``), so the state dict
    of every stage is a slice of the single-process model's. With tied embeddings
    (``untie_embeddings_and_output_weights=False``) the output layer uses ``embedding.tokens``:
    one parameter in a stage that is first and last; else the last stage holds its own copy
    under the same name (a token-only ``Embedding``), marked ``shared_embedding`` (and Megatron's
    ``shared``) so both copies get the summed gradient (``pipeline.grad_sync``).
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
        tied = not config.untie_embeddings_and_output_weights
        self.embedding: Embedding | None = None
        if is_first or (tied and is_last):
            self.embedding = Embedding(config, tokens_only=not is_first)
            if tied and is_first != is_last:  # one weight held by two stages (Megatron's marks)
                tokens = self.embedding.tokens
                # Megatron's marks: attributes a Parameter does not declare
                tokens.shared_embedding = True  # type: ignore[attr-defined]
                if not is_first:  # the copy a gradient norm leaves out
                    tokens.shared = True  # type: ignore[attr-defined]  # Megatron's mark
        self.layers = nn.ModuleDict(
            {str(i): TransformerLayer(config, i, ep_group) for i in self.layer_indices}
        )
        self.head = None
        if is_last:
            self.head = OutputHead(config, tied=self.embedding if tied else None)
        self._layer_plans: list[Plan] | None = None  # layer_plans(), made once
        self.input_tensor: torch.Tensor | None = None  # Megatron's set_input_tensor convention
        # runs each layer plan in forward (run_layer(nodes, inputs)); None: run_nodes. The
        # engine sets a tape or co-scheduling runner here around a user's forward call
        # (the StageModule protocol, megapipe.pipeline.stage_module).
        self.node_runner: NodeRunner | None = None

    def set_input_tensor(self, input_tensor: torch.Tensor | Sequence[torch.Tensor] | None) -> None:
        """Megatron's convention (used by ``megapipe.get_forward_backward_func``): a stage after
        the first computes on this received activation instead of its ``forward`` argument."""
        if input_tensor is None or isinstance(input_tensor, torch.Tensor):
            self.input_tensor = input_tensor
        else:  # a list of one, as Megatron's schedules pass it
            self.input_tensor = input_tensor[0] if input_tensor else None

    def layer_plans(self) -> list[Plan]:
        """Node plans in execution order: embedding, each layer, final norm + head. A layer the
        config recomputes whole (``recompute_method``) has its compute nodes wrapped by
        ``recompute.full.recompute_plan``: they keep only their inputs; with the uniform
        method and N > 1 layers, each group of N is one plan (``recompute.layer_groups``). Made
        once (the engine records them every step; a copy of the stage makes its own)."""
        if self._layer_plans is None:
            embedding = self.embedding if self.is_first else None
            plans = [] if embedding is None else [_single_node("embedding", embedding)]
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
        layers = self._layers()
        size = self.config.recompute_num_layers if self.config.recompute_method == "uniform" else 1
        return [layers[i : i + size] for i in range(0, len(layers), size)]

    def _layer_group_plan(self, group: list[TransformerLayer]) -> Plan:
        plan = group_plans([layer.node_plan() for layer in group])
        position = self._layers().index(group[0])
        if not self.config.recomputes_layer(position):
            return plan
        return recompute_plan(plan, [p for layer in group for p in layer.parameters()])

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers of this stage."""
        return [layer.moe for layer in self._layers() if layer.is_moe]

    def _layers(self) -> list[TransformerLayer]:
        """The layers in order (a ``ModuleDict`` types its values as ``Module``)."""
        return cast(list[TransformerLayer], list(self.layers.values()))

    def set_aux_loss_scale(self, scale: float) -> None:
        """The factor of the MoE auxiliary losses' gradients (the engine: 1/num_microbatches)."""
        for layer in self.moe_layers():
            layer.aux_loss_scale = scale

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [b, s] (first stage) or hidden [b, s, h] -> hidden, or logits (last stage).

        A stage after the first uses the tensor given to ``set_input_tensor`` when there is one.
        """
        if not self.is_first and self.input_tensor is not None:
            x = self.input_tensor
        if x is None:
            raise ValueError(
                "GPTStage.forward needs an input (or set_input_tensor on a later stage)"
            )
        if not self.is_first and (not x.is_floating_point() or x.dim() != 3):
            raise ValueError(
                f"a stage after the first takes float hidden states [batch, seq, "
                f"{self.config.hidden_size}], got {x.dtype} of shape {tuple(x.shape)}"
            )
        values: tuple[torch.Tensor, ...] = (x,)
        runner = self.node_runner
        for plan in self.layer_plans():
            values = run_nodes(plan, values) if runner is None else runner.run_layer(plan, values)
        return values[0]


def gpt_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy (the MoE auxiliary losses enter through backward, not here)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
