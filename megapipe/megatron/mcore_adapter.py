"""The Megatron-Core adapter: a Megatron ``GPTModel`` chunk as a ``StageModule``.

``McoreGPTStage(chunk)`` wraps a model chunk a Megatron script built (a ``GPTModel``, possibly
inside Megatron's ``Float16Module`` and ``DistributedDataParallel``). Called with the chunk's own
arguments it is the chunk: ``stage(input_ids, position_ids, attention_mask, labels=...)`` runs
``chunk(...)`` unchanged. While the engine has set its ``node_runner`` (a combined step, or the
tape), the same call runs the ``GPTModel`` as node plans through that runner, with exactly the
operations of ``GPTModel.forward``:

- embedding: one compute node, ``GPTModel._preprocess`` (first stage only);
- each layer: a dense layer one compute node, a MoE layer attn -> dispatch -> mlp -> combine
  (``mcore_layers``);
- MTP layers: the same split, with the MTP layer's own pre- and postprocessing (last stage);
- head: one compute node, the final norm (unless MTP applied it) and ``GPTModel._postprocess``.

This is Megatron's own split for its combined 1F1B. What is checked when the adapter is built,
before any collective: the release (``mcore_release``), every config field
(``mcore_config``), the forward's arguments (each one it does not mirror is refused when given),
the process groups, and that every deferred weight gradient is driven (``mcore_wgrad``).
Full recompute wraps the layers Megatron would recompute (``mcore_recompute``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from megapipe.megatron.mcore_config import check_config
from megapipe.megatron.mcore_layers import (
    ForwardCall,
    final_norm,
    is_moe_layer,
    layer_plan,
    mtp_plan,
)
from megapipe.megatron.mcore_recompute import recompute_layer, recompute_mtp, recomputed_layers
from megapipe.megatron.mcore_release import McoreRelease, release
from megapipe.megatron.mcore_support import chain_of, check_groups, find_megatron_model
from megapipe.megatron.mcore_wgrad import check_driven, delayed_modules
from megapipe.overlap.plan import LayerState, Node, NodeKind, NodeRunner, run_nodes

Tensors = tuple[Any, ...]

# GPTModel.forward's arguments the node plans mirror; any other one given with a value other
# than its default is refused (so an argument a new release adds cannot slip through)
MIRRORED_ARGUMENTS = frozenset(
    {
        "input_ids",
        "position_ids",
        "attention_mask",
        "decoder_input",
        "labels",
        "runtime_gather_output",
        "loss_mask",
        "padding_mask",
        "output_processor",
        "output_processor_context",
    }
)


class _PlainRunner:
    """Runs each layer plan with ordinary autograd (``run_nodes``): the chunk's forward outside
    megapipe's tape, for chunks whose weight gradients must be driven by the plans."""

    def run_layer(self, nodes: Sequence[Node], inputs: Tensors) -> Tensors:
        return run_nodes(nodes, inputs)


class McoreGPTStage(nn.Module):
    """A Megatron-Core ``GPTModel`` chunk as a ``StageModule`` (see the module docstring).

    ``module`` is the chunk as given (parameters are shared, not copied); ``config`` is the
    ``GPTModel``'s ``TransformerConfig``. ``set_input_tensor`` is Megatron's;
    ``set_aux_loss_scale(s)`` sets the scale of ``MoEAuxLossAutoScaler`` (and of
    ``MTPLossAutoScaler`` with MTP) to ``s``, as Megatron's schedules do (1 / num_microbatches).
    """

    # set through __dict__ (not registered as submodules a second time); Megatron's modules are
    # untyped, so the GPT model and its Float16Module wrapper are Any
    release: McoreRelease
    gpt: Any
    _half: Any
    needs_tape: bool
    defers_weight_grads: bool

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        gpt = find_megatron_model(chunk)
        if gpt is None:
            raise TypeError(
                f"{type(chunk).__name__} is not (and does not wrap) a Megatron-Core GPTModel"
            )
        self.__dict__["release"] = release()
        check_config(gpt.config)
        problem = self.release.config_problem(gpt.config)
        if problem is not None:
            raise NotImplementedError(problem)
        check_groups(gpt)
        if getattr(gpt, "mtp_process", False) and not gpt.post_process:
            raise NotImplementedError(
                "a chunk with MTP layers but without the output layer (MTP on a stage of its "
                "own) is not mirrored; build the MTP layers on the chunk with the head"
            )
        self.module = chunk
        self.__dict__["gpt"] = gpt  # the same module, not registered twice
        half = [m for m in chain_of(chunk) if type(m).__name__ == "Float16Module"]
        self.__dict__["_half"] = half[0] if half else None
        self._check_delayed_wgrad(gpt)
        # the engine's generic I/W split differentiates with autograd.grad, which Megatron's
        # checkpoints refuse and which would re-run a TE layer's whole backward: such chunks
        # run on megapipe's tape in every schedule (its W action is the weight-gradient queue)
        self.__dict__["needs_tape"] = (
            self.defers_weight_grads or gpt.config.recompute_granularity is not None
        )
        self.node_runner: NodeRunner | None = None

    def _check_delayed_wgrad(self, gpt: Any) -> None:
        """Every deferred weight gradient sits in a module the plans drive; with any, the
        chunk always runs as node plans (Megatron's own forward would leave them undriven)."""
        self.__dict__["defers_weight_grads"] = bool(delayed_modules(gpt))
        if not self.defers_weight_grads:
            return
        driven: list[nn.Module] = []
        layers = list(gpt.decoder.layers)
        if getattr(gpt, "mtp_process", False):
            for mtp_layer in gpt.mtp.layers:
                layers.append(self.release.mtp_inner_layer(mtp_layer))
                driven.append(mtp_layer.eh_proj)
        for layer in layers:  # what each node's backward_dw calls reach (mcore_layers)
            driven.append(layer.self_attention)
            if not is_moe_layer(layer):
                driven.append(layer.mlp)
                continue
            moe, config = layer.mlp, layer.config
            driven.append(moe.experts)
            if moe.use_shared_expert and not moe.shared_expert_overlap:
                driven.append(moe.shared_experts)
            if config.moe_latent_size and config.overlap_moe_expert_parallel_comm:
                driven += [moe.fc1_latent_proj, moe.fc2_latent_proj]  # MoELayer.backward_dw's
        check_driven(gpt, driven)

    @property
    def config(self) -> Any:
        return self.gpt.config

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.gpt.set_input_tensor(input_tensor)

    def set_aux_loss_scale(self, scale: float) -> None:
        device = next(self.gpt.parameters()).device
        value = torch.full((1,), scale, dtype=torch.float32, device=device)
        if self.config.num_moe_experts is not None:
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            MoEAuxLossAutoScaler.set_loss_scale(_shaped_as(value, MoEAuxLossAutoScaler))
        if self.config.mtp_num_layers is not None:
            from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

            MTPLossAutoScaler.set_loss_scale(_shaped_as(value, MTPLossAutoScaler))

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
        runner = self.node_runner
        if runner is None:
            if not (self.defers_weight_grads and torch.is_grad_enabled()):
                return self.module(*args, **kwargs)
            runner = _PlainRunner()
        return self._forward_nodes(runner, args, kwargs)

    # ------------------------------------------------------------------ node plans
    def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """``GPTModel.forward``'s arguments by name (defaults filled in); one clear error for
        an argument given with a value the plans do not mirror."""
        fp32_output = kwargs.pop("fp32_output", True)
        if self._half is not None and _float16_end(self._half, "first"):
            from megatron.core.transformer.module import fp32_to_float16

            args = fp32_to_float16(args, self._half.float16_convertor)  # as Float16Module does
        signature = inspect.signature(type(self.gpt).forward)
        bound = signature.bind(self.gpt, *args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        values.pop("self")
        for name, value in values.items():
            default = signature.parameters[name].default
            if name not in MIRRORED_ARGUMENTS and value is not default and value is not None:
                raise NotImplementedError(
                    f"GPTModel.forward({name}=...) is not mirrored by megapipe's Megatron-Core "
                    "adapter (it runs training forwards); call the chunk without it"
                )
        values["fp32_output"] = fp32_output
        return values

    def _forward_nodes(self, runner: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        """``GPTModel.forward`` (training), every plan through ``runner``."""
        a = self._bind(args, dict(kwargs))
        gpt, config = self.gpt, self.config
        call = ForwardCall(
            self.release,
            a["input_ids"],
            a["position_ids"],
            a["attention_mask"],
            a["decoder_input"],
            a["labels"],
            None,
            a["runtime_gather_output"],
            a["loss_mask"],
            a["padding_mask"],
            a.get("output_processor"),
            a.get("output_processor_context"),
            delay_wgrad=bool(config.delay_wgrad_compute),
        )
        if gpt.pre_process:
            values: Tensors = runner.run_layer(self._embedding_plan(call), (a["input_ids"],))
        else:
            call.preprocess(gpt)  # rotary embeddings etc.: no gradient flows through them
            values = (gpt.decoder.input_tensor,)
        layers = list(gpt.decoder.layers)
        recomputed = recomputed_layers(config, len(layers))
        for index, layer in enumerate(layers):
            plan = layer_plan(layer, call, f"layer{layer.layer_number - 1}")
            if index in recomputed:
                plan = recompute_layer(plan, layer, self.release, list(layer.parameters()))
            values = runner.run_layer(plan, values)
        if not layers and not gpt.pre_process and gpt.decoder.final_layernorm is None:
            values = runner.run_layer(self._clone_plan(), values)  # as TransformerBlock does
        if getattr(gpt, "mtp_process", False):
            for index in range(len(gpt.mtp.layers)):
                plan = mtp_plan(gpt, index, call)
                if recompute_mtp(config):
                    params = list(gpt.mtp.layers[index].parameters())
                    params += list(gpt.embedding.parameters())
                    if index == 0 and gpt.decoder.final_layernorm is not None:
                        params += list(gpt.decoder.final_layernorm.parameters())
                    plan = recompute_layer(
                        plan,
                        self.release.mtp_inner_layer(gpt.mtp.layers[index]),
                        self.release,
                        params,
                    )
                values = runner.run_layer(plan, values)
        if gpt.post_process:
            values = runner.run_layer(self._head_plan(call, a["fp32_output"]), values)
        return values[0]

    def _embedding_plan(self, call: ForwardCall) -> list[Node]:
        from megatron.core.utils import make_viewless_tensor

        def embedding(state: LayerState, inputs: Tensors) -> Tensors:
            hidden = call.preprocess(self.gpt)
            return (make_viewless_tensor(inp=hidden, requires_grad=True, keep_graph=True),)

        return [Node("embedding", NodeKind.COMPUTE, embedding)]

    def _clone_plan(self) -> list[Node]:
        def clone(state: LayerState, inputs: Tensors) -> Tensors:
            return (inputs[0].clone(),)

        return [Node("empty_block", NodeKind.COMPUTE, clone)]

    def _head_plan(self, call: ForwardCall, fp32_output: bool) -> list[Node]:
        from megatron.core.transformer.module import float16_to_fp32

        gpt = self.gpt
        mtp = getattr(gpt, "mtp_process", False)

        def head(state: LayerState, inputs: Tensors) -> Tensors:
            if mtp:  # the MTP block's output: the decoder's and each MTP layer's, stacked
                hidden = torch.cat(inputs, dim=0)
            else:
                hidden = final_norm(gpt, inputs[0])
            output = gpt._postprocess(
                hidden_states=hidden,
                input_ids=call.input_ids,
                position_ids=call.position_ids,
                labels=call.labels,
                rotary_pos_emb=call.rotary_pos_emb,
                rotary_pos_cos=call.rotary_pos_cos,
                rotary_pos_sin=call.rotary_pos_sin,
                mtp_in_postprocess=False,
                loss_mask=call.loss_mask,
                decoder_input=call.decoder_input,
                attention_mask=call.attention_mask,
                packed_seq_params=call.packed_seq_params,
                sequence_len_offset=call.sequence_len_offset,
                runtime_gather_output=call.runtime_gather_output,
                **call.release.postprocess_kwargs(
                    call.padding_mask, call.output_processor, call.output_processor_context
                ),
            )
            if self._half is not None and fp32_output and _float16_end(self._half, "last"):
                output = float16_to_fp32(output)  # what Float16Module does last
            return (output,)

        return [Node("head", NodeKind.COMPUTE, head)]


def _float16_end(half: Any, end: str) -> bool:  # Megatron's Float16Module (untyped)
    """Whether ``Float16Module`` casts at this end ("first": its inputs, "last": its output):
    Megatron decides by its own pipeline and virtual-stage ranks."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import utils

    group = (
        parallel_state.get_pipeline_model_parallel_group()
        if half.pg_collection is None
        else half.pg_collection.pp
    )
    if end == "first":
        return utils.is_vp_first_stage(half.vp_stage, half.vp_size) and utils.is_pp_first_stage(
            group
        )
    return utils.is_vp_last_stage(half.vp_stage, half.vp_size) and utils.is_pp_last_stage(group)


def as_stage_module(chunk: nn.Module) -> nn.Module:
    """``McoreGPTStage(chunk)`` for a Megatron-Core GPTModel chunk, else ``chunk`` itself (a
    Megatron model that is not a GPTModel is refused by ``find_megatron_model``)."""
    if isinstance(chunk, McoreGPTStage) or find_megatron_model(chunk) is None:
        return chunk
    return McoreGPTStage(chunk)


def _shaped_as(value: torch.Tensor, scaler: Any) -> torch.Tensor:
    """``value`` in the shape of the scale ``scaler`` holds already: Megatron's releases copy a
    new scale into the one they hold, which its own schedules may have made of shape [] or [1]
    earlier in the process."""
    held = getattr(scaler, "main_loss_backward_scale", None)
    return value.reshape(held.shape) if isinstance(held, torch.Tensor) else value
