"""Megatron-Core layers as node plans: the operations of ``TransformerBlock``, ``TransformerLayer``
and ``MultiTokenPredictionLayer`` in the training forward, split where Megatron's combined
1F1B splits them.

- dense layer: one compute node, the ``TransformerLayer``;
- MoE layer: attn (compute: attention, pre-MLP norm, shared experts, route, preprocess) ->
  dispatch (comm: token all-to-all) -> mlp (compute: routed experts) -> combine (comm:
  all-to-all, postprocess, bias-dropout-add);
- MTP layer: a MoE or dense layer whose first node starts with the MTP layer's own
  preprocessing (roll the ids, embed, norms, ``eh_proj``) and whose last node ends with its
  final norm.

The residual, the shared experts' output and the router probabilities ride along in the node
tuples; tensors that need no gradient (masks, rotary embeddings, ids) live in the per-call
``ForwardCall``. Where releases differ the ``McoreRelease`` answers (``mcore_release``). With
sequence parallelism the compute nodes run inside Megatron's model-parallel RNG fork, as
``TransformerBlock.forward`` runs its layers. With ``delay_wgrad_compute`` each node hands the
``backward_dw`` of its modules to megapipe's weight-gradient queue (``mcore_wgrad``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from megapipe.megatron.mcore_release import McoreRelease
from megapipe.megatron.mcore_wgrad import after_backward
from megapipe.overlap.plan import LayerState, Node, NodeKind, Plan

Tensors = tuple[Any, ...]


@dataclass
class ForwardCall:
    """The arguments of one ``GPTModel.forward`` call that every node may read (no gradient
    flows through them), and what ``_preprocess`` derived from them."""

    release: McoreRelease
    input_ids: torch.Tensor | None
    position_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    decoder_input: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    packed_seq_params: Any = None
    runtime_gather_output: bool | None = None
    loss_mask: torch.Tensor | None = None
    padding_mask: torch.Tensor | None = None
    output_processor: Any = None
    output_processor_context: Any = None
    rotary_pos_emb: Any = None
    rotary_pos_cos: Any = None
    rotary_pos_sin: Any = None
    sequence_len_offset: Any = None
    # the MTP layers' rolled ids: (input ids, position ids, padding mask) for the next one
    mtp_ids: tuple[Any, Any, Any] | None = None
    delay_wgrad: bool = False

    def preprocess(self, gpt: Any) -> torch.Tensor | None:
        """Run ``GPTModel._preprocess``; keep what it derives, return the decoder input."""
        (
            decoder_input,
            self.rotary_pos_emb,
            self.rotary_pos_cos,
            self.rotary_pos_sin,
            self.sequence_len_offset,
            self.padding_mask,
        ) = gpt._preprocess(
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            decoder_input=self.decoder_input,
            packed_seq_params=self.packed_seq_params,
            padding_mask=self.padding_mask,
        )[:6]
        self.mtp_ids = (self.input_ids, self.position_ids, self.padding_mask)
        return decoder_input

    def layer_kwargs(self, padding_mask: Any = None, own_mask: bool = False) -> dict[str, Any]:
        """The keyword arguments ``TransformerBlock.forward`` gives each layer (an MTP layer
        gives its inner layer its own, rolled, padding mask: ``own_mask``)."""
        return dict(
            attention_mask=self.attention_mask,
            rotary_pos_emb=self.rotary_pos_emb,
            rotary_pos_cos=self.rotary_pos_cos,
            rotary_pos_sin=self.rotary_pos_sin,
            packed_seq_params=self.packed_seq_params,
            sequence_len_offset=self.sequence_len_offset,
            padding_mask=padding_mask if own_mask else self.padding_mask,
        )


@dataclass(eq=False, slots=True)
class McoreLayerState(LayerState):
    """What the nodes of one Megatron-Core decoder or MTP layer leave for later ones, for one
    microbatch (``layer_plan``, ``mtp_plan``; the last three: ``mcore_recompute``)."""

    moe_mbs: int | None = None  # the batch size unflatten_for_moe restored, for combine
    mtp_ids: tuple[Any, Any, Any] | None = None  # an MTP layer's (ids, positions, padding mask)
    dispatcher: Any = None  # this microbatch's copy of the layer's token dispatcher
    dispatcher_at: dict[str, Any] = field(default_factory=dict)  # per node: as it found it
    buffers_at_first_forward: dict[str, list[torch.Tensor]] = field(default_factory=dict)


def rng_fork(config: Any) -> AbstractContextManager:
    """Megatron's model-parallel RNG fork under sequence parallelism (what its block and MTP
    layers run inside), where dropout draws from it; else nothing. (Without dropout nothing
    draws, and leaving the fork out keeps the comm stream's thread, on CPU, from switching
    the process-wide generator beside the compute stream.)"""
    if not config.sequence_parallel or not (config.hidden_dropout or config.attention_dropout):
        return nullcontext()
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker().fork()


# -------------------------------------------------------------------------------- dense
def dense_plan(
    layer: Any,
    call: ForwardCall,
    name: str,
    before: Callable[[McoreLayerState, Tensors], Tensors] | None = None,
    after: Callable[[McoreLayerState, torch.Tensor], Tensors] | None = None,
) -> list[Node]:
    """A dense ``TransformerLayer`` as one compute node (``before``/``after``: an MTP layer's
    own preprocessing and final norm around it)."""
    work = (
        [
            ("attention.backward_dw", layer.self_attention.backward_dw),
            ("mlp.backward_dw", layer.mlp.backward_dw),
        ]
        if call.delay_wgrad
        else []
    )

    def dense(state: McoreLayerState, inputs: Tensors) -> Tensors:
        lead, hidden, kwargs = _enter(state, inputs, before, call)
        (hidden,) = after_backward(state, work, (hidden,))
        with rng_fork(layer.config):
            output, _ = layer(hidden_states=hidden, **kwargs)
        return (*lead, *(after(state, output) if after else (output,)))

    return [Node(name, NodeKind.COMPUTE, dense)]


def _enter(
    state: McoreLayerState, inputs: Tensors, before: Any, call: ForwardCall
) -> tuple[Tensors, torch.Tensor, dict[str, Any]]:
    """(tensors passed on untouched, the layer's hidden input, its keyword arguments);
    ``before(state, inputs)`` -> (passed on, hidden, padding mask) for an MTP layer."""
    if before is None:
        (hidden,) = inputs
        return (), hidden, call.layer_kwargs()
    lead, hidden, padding = before(state, inputs)
    return lead, hidden, call.layer_kwargs(padding, own_mask=True)


# -------------------------------------------------------------------------------- MoE
def moe_plan(
    layer: Any,
    call: ForwardCall,
    name: str,
    before: Callable[[McoreLayerState, Tensors], Tensors] | None = None,
    after: Callable[[McoreLayerState, torch.Tensor], Tensors] | None = None,
) -> list[Node]:
    """Megatron's four-node split of a MoE ``TransformerLayer`` (module docstring): the
    operations of ``TransformerLayer._forward_attention``, ``_forward_mlp`` and
    ``MoELayer.forward``. Tuples carry (passed-on tensors, residual, [shared experts' output],
    tokens, probabilities)."""
    nodes = _MoENodes(layer, call, before, after)
    group = layer.mlp.token_dispatcher.ep_group
    return [
        Node(f"{name}.attn", NodeKind.COMPUTE, nodes.attn),
        Node(f"{name}.dispatch", NodeKind.COMM, nodes.dispatch, group=group),
        Node(f"{name}.mlp", NodeKind.COMPUTE, nodes.mlp),
        Node(f"{name}.combine", NodeKind.COMM, nodes.combine, group=group),
    ]


class _MoENodes:
    """The four node functions of one Megatron MoE layer (``moe_plan``), sharing the layer,
    the call's settings and how many passed-on tensors lead the tuples."""

    def __init__(
        self,
        layer: Any,
        call: ForwardCall,  # Megatron's layer: megatron is untyped
        before: Callable[[McoreLayerState, Tensors], Tensors] | None,
        after: Callable[[McoreLayerState, torch.Tensor], Tensors] | None,
    ) -> None:
        moe = layer.mlp
        self.layer, self.moe, self.call, self.before, self.after = layer, moe, call, before, after
        self.shared = moe.use_shared_expert and not moe.shared_expert_overlap
        self.attn_work = (
            [
                ("attention.backward_dw", layer.self_attention.backward_dw),
                (
                    "shared_experts.backward_dw",
                    lambda: moe.backward_dw(routed_experts=False, shared_experts=True),
                ),
            ]
            if call.delay_wgrad
            else []
        )
        self.mlp_work = (
            [
                (
                    "experts.backward_dw",
                    lambda: moe.backward_dw(routed_experts=True, shared_experts=False),
                ),
            ]
            if call.delay_wgrad
            else []
        )
        self.carried = 0  # how many passed-on tensors lead the tuples (set by the attn node)

    def attn(self, state: McoreLayerState, inputs: Tensors) -> Tensors:
        layer, moe, call, release = self.layer, self.moe, self.call, self.call.release
        lead, hidden, kwargs = _enter(state, inputs, self.before, call)
        self.carried = len(lead)
        (hidden,) = after_backward(state, self.attn_work, (hidden,))
        with rng_fork(layer.config):
            hidden, _ = layer._forward_attention(hidden_states=hidden, **kwargs)
            normed, residual = release.pre_mlp(layer, hidden)
            normed, padding, state.moe_mbs = release.unflatten_for_moe(
                layer, normed, kwargs["padding_mask"], call.packed_seq_params
            )
            if padding is not None:  # as MoELayer.forward hands it to the router
                padding = padding.transpose(0, 1).bool()
            shared_out = moe.shared_experts_compute(normed)
            probs, routing_map = moe.route(normed, padding)
            tokens, probs = moe.preprocess(normed, probs, routing_map)
        mid = (residual, shared_out) if self.shared else (residual,)
        return (*lead, *mid, tokens, probs)

    def dispatch(self, state: McoreLayerState, inputs: Tensors) -> Tensors:
        tokens, probs = self.moe.dispatch(*inputs[-2:])
        return (*inputs[:-2], tokens, probs)

    def mlp(self, state: McoreLayerState, inputs: Tensors) -> Tensors:
        tokens, probs = after_backward(state, self.mlp_work, inputs[-2:])
        with rng_fork(self.layer.config):
            output, bias = self.moe.routed_experts_compute(tokens, probs)
        if bias is not None:
            raise NotImplementedError(
                "the MoE layer's experts returned a bias; Megatron's "
                "alltoall dispatcher does not support one either"
            )
        return (*inputs[:-2], output)

    def combine(self, state: McoreLayerState, inputs: Tensors) -> Tensors:
        layer, carried = self.layer, self.carried
        lead = inputs[:carried]
        residual = inputs[carried]
        shared_out = inputs[carried + 1] if self.shared else None
        with rng_fork(layer.config):
            output = self.moe.postprocess(self.moe.combine(inputs[-1]), shared_out)
            output = self.call.release.reflatten_from_moe(
                layer, output, self.call.packed_seq_params, state.moe_mbs
            )
            hidden = layer._forward_post_mlp((output, None), residual)
        return (*lead, *(self.after(state, hidden) if self.after else (hidden,)))


def is_moe_layer(layer: Any) -> bool:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return isinstance(getattr(layer, "mlp", None), MoELayer)


def layer_plan(layer: Any, call: ForwardCall, name: str, **around: Any) -> Plan:
    """The plan of a decoder layer: four nodes for a MoE layer, one for a dense layer; its
    state is a ``McoreLayerState``."""
    nodes = (moe_plan if is_moe_layer(layer) else dense_plan)(layer, call, name, **around)
    return Plan(nodes, McoreLayerState)


# -------------------------------------------------------------------------------- MTP
def mtp_plan(gpt: Any, index: int, call: ForwardCall) -> Plan:
    """MTP layer ``index`` of the chunk (``MultiTokenPredictionBlock.forward`` and the layer's
    own forward): its input tuple is (decoder output, earlier MTP outputs...), its output the
    same with its own appended; the head concatenates them as the block does. The first MTP
    layer applies the decoder's final norm first (where ``TransformerBlock`` applies it)."""
    mtp_layer = gpt.mtp.layers[index]
    inner = call.release.mtp_inner_layer(mtp_layer)
    config = mtp_layer.config

    def before(state: McoreLayerState, inputs: Tensors) -> tuple[Tensors, torch.Tensor, Any]:
        if index == 0:
            (hidden,) = inputs
            hidden = final_norm(gpt, hidden)
            inputs = (hidden,)
        if not state.recomputing:
            state.mtp_ids = call.mtp_ids
        assert state.mtp_ids is not None  # the chunk's preprocess set them before any MTP layer
        ids, positions, padding = state.mtp_ids
        ids, positions, padding, decoder_input, hidden = call.release.mtp_embeddings(
            mtp_layer,
            ids,
            positions,
            gpt.embedding,
            inputs[-1],
            call.packed_seq_params,
            padding,
        )
        if not state.recomputing:
            call.mtp_ids = (ids, positions, padding)
        with rng_fork(config):
            hidden = mtp_layer._concat_embeddings(hidden, decoder_input)
        return inputs, hidden, padding

    def after(state: McoreLayerState, hidden: torch.Tensor) -> Tensors:
        return (mtp_layer._postprocess(hidden),)

    plan = layer_plan(inner, call, f"mtp{index}", before=before, after=after)
    if call.delay_wgrad:  # the projection's backward_dw, with the first node's
        work = ("eh_proj.backward_dw", mtp_layer.eh_proj.backward_dw)
        plan = plan.wrapped(lambda nodes: [_with_work(nodes[0], work)] + nodes[1:])
    return plan


def _with_work(node: Node, work: tuple[str, Callable[[], None]]) -> Node:
    """``node`` with one more delayed weight gradient driven after its backward."""

    def fn(state: McoreLayerState, inputs: Tensors) -> Tensors:
        return node.fn(state, after_backward(state, [work], inputs))

    return replace(node, fn=fn)


def final_norm(gpt: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``TransformerBlock``'s final layer norm, as it applies it (none: unchanged)."""
    from megatron.core.utils import make_viewless_tensor

    norm = gpt.decoder.final_layernorm
    if norm is None:
        return hidden
    return make_viewless_tensor(inp=norm(hidden), requires_grad=True, keep_graph=True)
