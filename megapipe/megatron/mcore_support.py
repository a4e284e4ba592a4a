"""What the Megatron-Core adapter supports, checked before anything runs.

The installed megatron-core version (the adapter relies on Megatron internals, so versions are
pinned: ``SUPPORTED_MCORE_VERSIONS``, the ``megapipe[megatron]`` extra), the config features the
node split covers (each refused feature is named with the reason), Megatron's DDP (supported
when it does the reduction), and the process groups the two streams drive. Also how to find
the ``GPTModel`` inside a chunk a script wrapped (``Float16Module``, ``DistributedDataParallel``).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

SUPPORTED_MCORE_VERSIONS = ("0.16.1",)


def chain_of(chunk: nn.Module) -> list[nn.Module]:
    """``chunk`` and the modules it wraps through ``.module`` (DDP, Float16Module, ...)."""
    chain = [chunk]
    while isinstance(getattr(chain[-1], "module", None), nn.Module) and len(chain) < 8:
        chain.append(chain[-1].module)
    return chain


def find_gpt_model(chunk: nn.Module) -> nn.Module | None:
    """The Megatron-Core ``GPTModel`` in ``chunk`` (itself or wrapped), else None. Imports
    Megatron only when the chunk comes from it."""
    chain = chain_of(chunk)
    if not any(type(m).__module__.startswith("megatron.") for m in chain):
        return None
    from megatron.core.models.gpt.gpt_model import GPTModel

    return next((m for m in chain if isinstance(m, GPTModel)), None)


def megatron_ddp(chunk: nn.Module) -> nn.Module | None:
    """Megatron's DistributedDataParallel around ``chunk``, if any (its gradients live in
    ``main_grad`` buffers that its ``finalize_model_grads`` reduces)."""
    return next(
        (m for m in chain_of(chunk)
         if type(m).__module__.startswith("megatron.") and hasattr(m, "finish_grad_sync")),
        None,
    )


def check_ddp(chunk: nn.Module, reduce_grads: bool) -> None:
    """Megatron's DDP is supported when it does the reduction (``reduce_grads=False``)."""
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


def check_mcore_version() -> str:
    """The installed megatron-core version; one clear error when it is not supported."""
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    if version not in SUPPORTED_MCORE_VERSIONS:
        raise RuntimeError(
            f"megatron-core {version} is not supported by megapipe's adapter (it relies on "
            f"Megatron internals); supported: {', '.join(SUPPORTED_MCORE_VERSIONS)} "
            "(pip install 'megapipe[megatron]')"
        )
    return version


# (what the adapter cannot run, how to tell from the config, why)
_UNSUPPORTED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("tensor parallelism", lambda c: c.tensor_model_parallel_size > 1,
     "its collectives inside attention and MLP are not split into nodes"),
    ("sequence parallelism", lambda c: c.sequence_parallel, "needs tensor parallelism"),
    ("context parallelism", lambda c: c.context_parallel_size > 1,
     "its attention all-gathers are not split into nodes"),
    ("expert tensor parallelism", lambda c: (c.expert_tensor_parallel_size or 1) > 1,
     "its all-gathers beside the all-to-all are not split into nodes"),
    ("multi-token prediction (MTP)", lambda c: c.mtp_num_layers, "MTP layers are not adapted"),
    ("FP8/FP4", lambda c: c.fp8 or c.fp4, "needs TransformerEngine"),
    ("calculate_per_token_loss", lambda c: c.calculate_per_token_loss,
     "megapipe's executor divides every microbatch's loss by num_microbatches, Megatron's "
     "per-token mode does not (it scales by the token count in finalize_model_grads)"),
    ("fp16", lambda c: c.fp16,
     "the front end does not apply Megatron's loss scaling (config.grad_scale_func); use bf16"),
    ("CUDA graphs", lambda c: c.cuda_graph_impl != "none",
     "a graph replays whole layers, not the nodes the combined step interleaves"),
    ("activation recomputation (recompute_granularity)",
     lambda c: c.recompute_granularity is not None,
     "Megatron's checkpointed regions span a whole layer, across the adapter's nodes, and "
     "re-run its dispatch; node-level recompute is built for megapipe's GPT only (set "
     "recompute_granularity=None)"),
    ("activation offloading", lambda c: c.cpu_offloading or c.fine_grained_activation_offloading,
     "not adapted"),
    ("moe_shared_expert_overlap", lambda c: c.moe_shared_expert_overlap,
     "it hides the shared experts inside the dispatcher; the combined step overlaps instead"),
    ("a token dispatcher other than alltoall (allgather, flex/DeepEP/HybridEP)",
     lambda c: c.num_moe_experts is not None and c.moe_token_dispatcher_type != "alltoall",
     "only the alltoall dispatcher's dispatch and combine are split into comm nodes"),
)


def check_supported(config: Any) -> None:
    """Refuse, naming the feature and why, what the node split does not cover."""
    for name, used, why in _UNSUPPORTED:
        if used(config):
            raise NotImplementedError(
                f"megapipe's Megatron-Core adapter does not support {name}: {why}"
            )


def check_groups(gpt: nn.Module) -> None:
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
