"""What the Megatron-Core adapter needs of a chunk and its surroundings, checked before anything
runs (the release and the config are checked in ``mcore_release`` and ``mcore_config``).

How to find the ``GPTModel`` inside a chunk a script wrapped (``Float16Module``,
``DistributedDataParallel``), refusing other Megatron models and subclasses whose forward the
adapter would not mirror; Megatron's DDP (supported when it reduces after the step), the
reduction megapipe can do itself, the process groups the two streams drive, and the shape of the
activations Megatron sends between stages.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def chain_of(chunk: nn.Module) -> list[nn.Module]:
    """``chunk`` and the modules it wraps through ``.module`` (DDP, Float16Module, ...)."""
    chain = [chunk]
    while isinstance(inner := getattr(chain[-1], "module", None), nn.Module) and len(chain) < 8:
        chain.append(inner)
    return chain


def from_megatron(module: nn.Module) -> bool:
    """Whether ``module``'s class is Megatron's or derives from one of Megatron's."""
    return any(cls.__module__.startswith("megatron.") for cls in type(module).__mro__)


def find_gpt_model(chunk: nn.Module) -> Any:
    """The Megatron-Core ``GPTModel`` in ``chunk`` (itself or wrapped), else None. Imports
    Megatron only when the chunk comes from it."""
    chain = chain_of(chunk)
    if not any(from_megatron(m) for m in chain):
        return None
    from megatron.core.models.gpt.gpt_model import GPTModel

    return next((m for m in chain if isinstance(m, GPTModel)), None)


# the methods whose operations the adapter re-creates: a subclass that overrides one of them
# would compute something else than the adapter mirrors
_MIRRORED_METHODS = {
    "GPTModel": ("forward",),
    "TransformerLayer": ("forward", "_forward_mlp"),
    "MultiTokenPredictionLayer": ("forward", "_proj_and_transformer_layer"),
    "MultiTokenPredictionBlock": ("forward",),
}


def find_megatron_model(chunk: nn.Module) -> Any:  # a GPTModel (untyped) or None
    """``find_gpt_model``, refusing in one line a Megatron language model that is not a
    ``GPTModel`` (``HybridModel``, ``MambaModel``, ...) and a GPT model whose mirrored methods
    a subclass overrides; None for a chunk that is not Megatron's."""
    chain = chain_of(chunk)
    if not any(from_megatron(m) for m in chain):
        return None
    from megatron.core.models.common.language_module.language_module import LanguageModule

    gpt = find_gpt_model(chunk)
    if gpt is None:
        other = next((m for m in chain if isinstance(m, LanguageModule)), None)
        if other is not None:
            raise NotImplementedError(
                f"{type(other).__name__} chunks are not adapted: megapipe's Megatron-Core adapter "
                "overlaps GPTModel chunks (Megatron's GPT with attention, dense and MoE layers); "
                "build the model as a GPTModel"
            )
        return None
    check_mirrored_classes(gpt)
    return gpt


def check_mirrored_classes(gpt: Any) -> None:
    """Refuse a module whose class overrides a method the adapter re-creates."""
    import megatron.core.models.gpt.gpt_model as gpt_model
    import megatron.core.transformer.multi_token_prediction as mtp
    import megatron.core.transformer.transformer_layer as transformer_layer

    bases = {
        "GPTModel": gpt_model.GPTModel,
        "TransformerLayer": transformer_layer.TransformerLayer,
        "MultiTokenPredictionLayer": mtp.MultiTokenPredictionLayer,
        "MultiTokenPredictionBlock": mtp.MultiTokenPredictionBlock,
    }
    # Megatron's own subclass that keeps TransformerLayer's MLP path without CUDA graphs
    allowed = {getattr(transformer_layer, "MoETransformerLayer", None)}
    for module in gpt.modules():
        for base_name, methods in _MIRRORED_METHODS.items():
            base = bases[base_name]
            if not isinstance(module, base) or type(module) is base or type(module) in allowed:
                continue
            for method in methods:
                if getattr(type(module), method) is not getattr(base, method):
                    raise NotImplementedError(
                        f"{type(module).__name__} overrides {base_name}.{method}, whose "
                        "operations megapipe's Megatron-Core adapter re-creates; it would not "
                        "compute what the subclass computes"
                    )


def megatron_ddp(chunk: nn.Module) -> Any:
    """Megatron's DistributedDataParallel around ``chunk``, if any (its gradients live in
    ``main_grad`` buffers that its ``finalize_model_grads`` reduces)."""
    return next(
        (
            m
            for m in chain_of(chunk)
            if type(m).__module__.startswith("megatron.") and hasattr(m, "finish_grad_sync")
        ),
        None,
    )


def check_ddp(chunk: nn.Module, reduce_grads: bool) -> None:
    """Megatron's DDP is supported when it does the reduction (``reduce_grads=False``); with
    tensor parallelism the reduction must be Megatron's."""
    gpt = find_gpt_model(chunk)
    if reduce_grads and gpt is not None and gpt.config.tensor_model_parallel_size > 1:
        raise ValueError(
            f"tensor_model_parallel_size={gpt.config.tensor_model_parallel_size}: megapipe's own "
            "reduction (reduce_grads=True) does not all-reduce the sequence-parallel and "
            "qk-layernorm gradients over the tensor-parallel group; wrap the chunks in "
            "Megatron's DistributedDataParallel and pass reduce_grads=False so that "
            "finalize_model_grads reduces them"
        )
    ddp = megatron_ddp(chunk)
    if ddp is None:
        return
    if reduce_grads:
        raise ValueError(
            f"{type(chunk).__name__} wraps Megatron's DistributedDataParallel: its gradients "
            "live in main_grad and finalize_model_grads reduces them; pass reduce_grads=False "
            "to leave the reduction to it (megapipe then calls the config's DDP hooks as "
            "Megatron's schedules do)"
        )


def check_groups(gpt: Any) -> None:
    """The attn node's count all-gather (over ``tp_ep``) runs on the compute stream beside
    another microbatch's all-to-all (over ``ep``) on the comm stream: two groups, or the two
    streams would issue collectives on one group in an order that can differ between ranks."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for layer in gpt.decoder.layers:
        if not isinstance(layer.mlp, MoELayer):
            continue
        dispatcher = layer.mlp.token_dispatcher
        if dispatcher.ep_size > 1 and dispatcher.tp_ep_group is dispatcher.ep_group:
            raise ValueError(
                "the MoE layers' tp_ep and ep process groups are one group object; the overlap "
                "drives them from two streams, so they must be separate groups (as "
                "parallel_state.initialize_model_parallel creates them)"
            )


def finish_router_step(chunks: list[Any]) -> None:
    """After megapipe's own reduction (``reduce_grads=True``): what Megatron's
    ``finalize_model_grads`` does for the routers of the chunks' MoE layers (the expert-bias
    update of aux-loss-free balancing, the reset of the per-step token counts)."""
    gpts = [g for g in (find_gpt_model(c) for c in chunks) if g is not None]
    if not gpts or gpts[0].config.num_moe_experts is None:
        return
    from megapipe.megatron.mcore_release import release

    release().update_expert_bias(gpts, gpts[0].config)


def activation_shape(config: Any, seq_length: int, micro_batch_size: int) -> tuple[int, int, int]:
    """The (sequence, batch, hidden) shape Megatron sends between stages: the sequence is split
    over the tensor-parallel ranks under sequence parallelism (and over context parallelism)."""
    seq = seq_length // config.context_parallel_size
    if config.sequence_parallel:
        seq //= config.tensor_model_parallel_size
    return (seq, micro_batch_size, config.hidden_size)


def check_cuda_graphs(impl: str) -> None:
    """megapipe's CUDA graphs (``cuda_graph_impl="local"``) capture nodes that declare what they
    hold (``graphs.nodes.Graphable``); the adapter's Megatron-Core nodes do not, and Megatron's
    own graph settings are refused with the config (``mcore_config``)."""
    if impl != "none":
        raise NotImplementedError(
            f"cuda_graph_impl={impl!r} with Megatron-Core chunks: megapipe captures its own GPT's "
            "nodes; the adapter's nodes run Megatron's modules, whose capture (router, "
            "auxiliary-loss tracker, dispatcher preprocessing) has not been verified on a GPU "
            "here; run them eager (cuda_graph_impl='none')"
        )
