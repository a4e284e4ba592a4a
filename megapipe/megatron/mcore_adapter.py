"""The Megatron-Core adapter: a Megatron ``GPTModel`` chunk as a ``StageModule``.

``McoreGPTStage(chunk)`` wraps a model chunk a Megatron script built (a ``GPTModel``, possibly
inside Megatron's ``Float16Module`` and ``DistributedDataParallel``). Called with the chunk's own
arguments it is the chunk: ``stage(input_ids, position_ids, attention_mask, labels=...)`` runs
``chunk(...)`` unchanged. While the engine has set its ``node_runner`` (a combined step, or the
tape), the same call runs the ``GPTModel`` as node plans through that runner, with exactly the
operations of ``GPTModel.forward``:

| plan        | nodes                                                                   |
|-------------|-------------------------------------------------------------------------|
| embedding   | one compute node: ``GPTModel._preprocess`` (first stage only)            |
| dense layer | one compute node: the ``TransformerLayer``                               |
| MoE layer   | attn (compute: attention, pre-MLP norm, shared experts, route, preprocess) |
|             | -> dispatch (comm: the token all-to-all) -> mlp (compute: routed experts) |
|             | -> combine (comm: combine all-to-all, postprocess, bias-dropout-add)     |
| head        | one compute node: final norm and ``GPTModel._postprocess`` (last stage)  |

This is Megatron's own split for its combined 1F1B (``fine_grained_callables``). The residual,
the shared experts' output and the router probabilities ride along in the node tuples, so each
node's backward is driven by the tape; per-call inputs that need no gradient (masks, rotary
embeddings, labels) are held by the forward call that builds the plans.

It relies on Megatron internals (``_preprocess``, ``_forward_attention``, the MoE layer's
``route``/``preprocess``/``dispatch``/``routed_experts_compute``/``combine``/``postprocess``,
``_forward_post_mlp``, ``_postprocess``), so the supported versions are pinned
(``mcore_support.SUPPORTED_MCORE_VERSIONS``, the ``megapipe[megatron]`` extra) and the tests
exercise them.
Features the split does not cover are refused when the adapter is built (``mcore_support``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from megapipe.megatron.mcore_support import (
    check_groups,
    check_mcore_version,
    check_supported,
    chain_of,
    find_gpt_model,
)
from megapipe.overlap.plan import LayerState, Node, NodeKind, NodeRunner

Tensors = tuple[Any, ...]

@dataclass
class _Call:
    """The arguments of one forward call that every node may read (no gradients flow
    through them), and what ``_preprocess`` derived from them."""

    input_ids: Optional[torch.Tensor]
    position_ids: Optional[torch.Tensor]
    attention_mask: Optional[torch.Tensor]
    decoder_input: Optional[torch.Tensor] = None
    labels: Optional[torch.Tensor] = None
    packed_seq_params: Any = None
    runtime_gather_output: Optional[bool] = None
    loss_mask: Optional[torch.Tensor] = None
    padding_mask: Optional[torch.Tensor] = None
    fp32_output: bool = True
    rotary_pos_emb: Any = None
    rotary_pos_cos: Any = None
    rotary_pos_sin: Any = None
    sequence_len_offset: Any = None

    def preprocess(self, gpt: nn.Module) -> torch.Tensor | None:
        """Run ``GPTModel._preprocess``; keep what it derives, return the decoder input."""
        (decoder_input, self.rotary_pos_emb, self.rotary_pos_cos, self.rotary_pos_sin,
         self.sequence_len_offset, self.padding_mask) = gpt._preprocess(
            input_ids=self.input_ids, position_ids=self.position_ids,
            decoder_input=self.decoder_input, packed_seq_params=self.packed_seq_params,
            padding_mask=self.padding_mask,
        )[:6]
        return decoder_input

    def layer_kwargs(self) -> dict[str, Any]:
        """The keyword arguments ``TransformerBlock.forward`` gives each layer."""
        return dict(
            attention_mask=self.attention_mask, rotary_pos_emb=self.rotary_pos_emb,
            rotary_pos_cos=self.rotary_pos_cos, rotary_pos_sin=self.rotary_pos_sin,
            packed_seq_params=self.packed_seq_params,
            sequence_len_offset=self.sequence_len_offset, padding_mask=self.padding_mask,
        )


class McoreGPTStage(nn.Module):
    """A Megatron-Core ``GPTModel`` chunk as a ``StageModule`` (see the module docstring).

    ``module`` is the chunk as given (parameters are shared, not copied); ``config`` is the
    ``GPTModel``'s ``TransformerConfig``. ``set_input_tensor`` is Megatron's;
    ``set_aux_loss_scale(s)`` sets ``MoEAuxLossAutoScaler``'s scale to ``s`` as Megatron's
    schedules do (``1 / num_microbatches``).
    """

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        gpt = find_gpt_model(chunk)
        if gpt is None:
            raise TypeError(
                f"{type(chunk).__name__} is not (and does not wrap) a Megatron-Core GPTModel"
            )
        check_mcore_version()
        check_supported(gpt.config)
        check_groups(gpt)
        self.module = chunk
        self.__dict__["gpt"] = gpt  # the same module, not registered twice
        self.__dict__["_half_wrapped"] = any(
            type(m).__name__ == "Float16Module" for m in chain_of(chunk)
        )
        self.node_runner: NodeRunner | None = None

    @property
    def config(self) -> Any:
        return self.gpt.config

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.gpt.set_input_tensor(input_tensor)

    def set_aux_loss_scale(self, scale: float) -> None:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        device = next(self.gpt.parameters()).device
        MoEAuxLossAutoScaler.set_loss_scale(
            torch.full((1,), scale, dtype=torch.float32, device=device)
        )

    def check_stage(self, stage: int, first: bool, last: bool) -> None:
        """The chunk must have the embedding exactly when its stage is the first, and the
        head exactly when it is the last (built for the schedule's placement)."""
        gpt = self.gpt
        if gpt.pre_process != first or gpt.post_process != last:
            raise ValueError(
                f"the schedule puts this chunk at stage {stage} (first: {first}, last: {last}) "
                f"but it was built with pre_process={gpt.pre_process}, "
                f"post_process={gpt.post_process}; build chunk j of a rank as the j-th stage "
                "the schedule places there (V placement for zbv and dualpipev)"
            )

    def layer_plans(self) -> list[list[Node]]:
        raise RuntimeError(
            "a Megatron-Core chunk's node plans depend on its forward arguments (masks, "
            "position ids, labels): run it through its forward, e.g. from a forward_step_func "
            "under megapipe.get_forward_backward_func, which sets node_runner around the call"
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.node_runner is None:
            return self.module(*args, **kwargs)
        return self._forward_nodes(*args, **kwargs)

    # ------------------------------------------------------------------ node plans
    def _forward_nodes(
        self,
        input_ids: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor],
        decoder_input: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        extra_block_kwargs: Optional[dict] = None,
        runtime_gather_output: Optional[bool] = None,
        *,
        inference_params: Any = None,
        loss_mask: Optional[torch.Tensor] = None,
        padding_mask: Optional[torch.Tensor] = None,
        fp32_output: bool = True,
    ) -> torch.Tensor:
        """``GPTModel.forward`` (training), every plan through ``self.node_runner``."""
        if inference_context is not None or inference_params is not None or extra_block_kwargs:
            raise NotImplementedError(
                "the adapter runs training forwards: inference_context, inference_params and "
                "extra_block_kwargs are not supported while megapipe drives the chunk"
            )
        gpt, runner = self.gpt, self.node_runner
        assert runner is not None
        call = _Call(
            input_ids, position_ids, attention_mask, decoder_input, labels, packed_seq_params,
            runtime_gather_output, loss_mask, padding_mask, fp32_output,
        )
        if gpt.pre_process:
            values: Tensors = runner.run_layer(self._embedding_plan(call), (input_ids,))
        else:
            call.preprocess(gpt)  # rotary embeddings etc.: no gradient flows through them
            values = (gpt.decoder.input_tensor,)
        for layer in gpt.decoder.layers:
            values = runner.run_layer(self._layer_plan(layer, call), values)
        if gpt.post_process:
            values = runner.run_layer(self._head_plan(call), values)
        return values[0]

    def _embedding_plan(self, call: _Call) -> list[Node]:
        from megatron.core.utils import make_viewless_tensor

        def embedding(state: LayerState, inputs: Tensors) -> Tensors:
            hidden = call.preprocess(self.gpt)
            return (make_viewless_tensor(inp=hidden, requires_grad=True, keep_graph=True),)

        return [Node("embedding", NodeKind.COMPUTE, embedding)]

    def _head_plan(self, call: _Call) -> list[Node]:
        from megatron.core.transformer.module import float16_to_fp32
        from megatron.core.utils import make_viewless_tensor

        gpt = self.gpt

        def head(state: LayerState, inputs: Tensors) -> Tensors:
            (hidden,) = inputs
            if gpt.decoder.final_layernorm is not None:
                hidden = gpt.decoder.final_layernorm(hidden)
                hidden = make_viewless_tensor(inp=hidden, requires_grad=True, keep_graph=True)
            output = gpt._postprocess(
                hidden_states=hidden, input_ids=call.input_ids, position_ids=call.position_ids,
                labels=call.labels, rotary_pos_emb=call.rotary_pos_emb,
                rotary_pos_cos=call.rotary_pos_cos, rotary_pos_sin=call.rotary_pos_sin,
                mtp_in_postprocess=False, loss_mask=call.loss_mask,
                decoder_input=call.decoder_input, attention_mask=call.attention_mask,
                packed_seq_params=call.packed_seq_params,
                sequence_len_offset=call.sequence_len_offset,
                runtime_gather_output=call.runtime_gather_output,
            )
            if self._half_wrapped and call.fp32_output:  # what Float16Module does last
                output = float16_to_fp32(output)
            return (output,)

        return [Node("head", NodeKind.COMPUTE, head)]

    def _layer_plan(self, layer: nn.Module, call: _Call) -> list[Node]:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        name = f"layer{layer.layer_number - 1}"
        if not isinstance(layer.mlp, MoELayer):

            def dense(state: LayerState, inputs: Tensors) -> Tensors:
                (hidden,) = inputs
                output, _ = layer(hidden_states=hidden, **call.layer_kwargs())
                return (output,)

            return [Node(name, NodeKind.COMPUTE, dense)]
        return moe_layer_plan(layer, call, name)


def moe_layer_plan(layer: nn.Module, call: _Call, name: str) -> list[Node]:
    """Megatron's four-node split of a MoE ``TransformerLayer`` (module docstring). The tuples
    carry (residual, [shared experts' output], tokens, probabilities)."""
    moe = layer.mlp
    shared = moe.use_shared_expert
    lead = 2 if shared else 1  # residual and, with shared experts, their output

    def attn(state: LayerState, inputs: Tensors) -> Tensors:
        (hidden,) = inputs
        kwargs = call.layer_kwargs()
        hidden, _ = layer._forward_attention(hidden_states=hidden, **kwargs)
        normed = layer._forward_pre_mlp_layernorm(hidden)
        shared_out = moe.shared_experts_compute(normed)
        padding = kwargs["padding_mask"]
        if padding is not None:  # as MoELayer.forward hands it to the router
            padding = padding.transpose(0, 1).bool()
        probs, routing_map = moe.route(normed, padding)
        tokens, probs = moe.preprocess(normed, probs, routing_map)
        return (hidden, shared_out, tokens, probs) if shared else (hidden, tokens, probs)

    def dispatch(state: LayerState, inputs: Tensors) -> Tensors:
        tokens, probs = moe.dispatch(*inputs[lead:])
        return (*inputs[:lead], tokens, probs)

    def mlp(state: LayerState, inputs: Tensors) -> Tensors:
        output, bias = moe.routed_experts_compute(*inputs[lead:])
        assert bias is None, "the MoE layer's experts returned a bias Megatron does not support"
        return (*inputs[:lead], output)

    def combine(state: LayerState, inputs: Tensors) -> Tensors:
        residual, shared_out = inputs[0], (inputs[1] if shared else None)
        output = moe.postprocess(moe.combine(inputs[-1]), shared_out)
        return (layer._forward_post_mlp((output, None), residual),)

    return [
        Node(f"{name}.attn", NodeKind.COMPUTE, attn),
        Node(f"{name}.dispatch", NodeKind.COMM, dispatch, group=moe.token_dispatcher.ep_group),
        Node(f"{name}.mlp", NodeKind.COMPUTE, mlp),
        Node(f"{name}.combine", NodeKind.COMM, combine, group=moe.token_dispatcher.ep_group),
    ]


def as_stage_module(chunk: nn.Module) -> nn.Module:
    """``McoreGPTStage(chunk)`` for a Megatron-Core GPTModel chunk, else ``chunk`` itself."""
    if isinstance(chunk, McoreGPTStage) or find_gpt_model(chunk) is None:
        return chunk
    return McoreGPTStage(chunk)
