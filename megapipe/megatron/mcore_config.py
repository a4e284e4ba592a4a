"""Which ``TransformerConfig`` settings the adapter mirrors: every field is accounted for.

The adapter runs Megatron's own modules (attention, MLP, router, experts, token dispatcher,
embedding, output layer and loss) unchanged and re-creates only the code between them
(``GPTModel.forward``, ``TransformerBlock.forward``, the MoE part of ``TransformerLayer`` and
of the MTP layer). ``check_config`` therefore sorts every field of the config into:

- ``MIRRORED``: read only by Megatron's own modules, or by code the adapter mirrors; any value
  (``mcore_accepted``).
- ``SCHEDULE``: read by Megatron's pipeline schedules, which megapipe's front end replaces
  (pipeline sizes, p2p options, the schedule's own overlap); any value (``mcore_accepted``).
- ``OPTIONS_OF``: options of a feature another field switches on; any value (the feature
  itself is checked; ``mcore_feature_options``).
- ``RULES``: allowed values decided by a rule that says why others are refused (here).
- every other field must keep its release's default: refused otherwise, naming the field and,
  where ``REASONS`` gives one, why.

So a field a new Megatron release adds is refused until someone classifies it; the tests check
that every field of every supported release is either classified or at its default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from megapipe.megatron.mcore_accepted import MIRRORED, SCHEDULE
from megapipe.megatron.mcore_feature_options import OPTIONS_OF

Rule = Callable[[Any], str | None]


def _recompute(c: Any) -> str | None:
    if c.recompute_granularity is None:
        return None
    if c.recompute_granularity == "selective":
        if "moe" in (c.recompute_modules or ()):
            return (
                "recompute_modules containing 'moe' checkpoints the whole MoE layer, its "
                "all-to-alls included, across the adapter's nodes (Megatron's overlap refuses "
                "it too); recompute the other modules, or use recompute_granularity='full', "
                "which megapipe recomputes node by node without re-running the dispatch"
            )
        return None
    if c.recompute_granularity == "full":
        if c.recompute_method not in ("uniform", "block"):
            return f"recompute_method={c.recompute_method!r} must be 'uniform' or 'block'"
        if c.distribute_saved_activations:
            return (
                "distribute_saved_activations=True is not mirrored: megapipe's node "
                "recompute keeps each node's inputs whole"
            )
        if c.hidden_dropout or c.attention_dropout or c.moe_input_jitter_eps:
            return (
                "full recompute with dropout or router jitter is not mirrored: megapipe "
                "re-runs a node without restoring the random state its first run drew from"
            )
        return None
    return f"recompute_granularity={c.recompute_granularity!r} is not 'selective' or 'full'"


def _expert_tp(c: Any) -> str | None:
    etp = c.expert_tensor_parallel_size or c.tensor_model_parallel_size
    if etp > 1 and c.num_moe_experts:
        return (
            f"expert_tensor_parallel_size={etp} is not verified: the adapter would run its "
            "all-gather and reduce-scatter inside the experts' node (compute stream, its own "
            "group), but Megatron's own expert-tensor-parallel path needs uneven all-gathers "
            "that gloo cannot run, so there is no CPU reference to test it against; set "
            "expert_tensor_parallel_size=1 (expert parallelism folds into tensor x data)"
        )
    return None


RULES: dict[str, Rule] = {
    "tensor_model_parallel_size": lambda c: None,
    "sequence_parallel": lambda c: (
        "tensor parallelism with MoE layers needs sequence_parallel=True (Megatron's rule)"
        if c.tensor_model_parallel_size > 1 and c.num_moe_experts and not c.sequence_parallel
        else None
    ),
    "expert_tensor_parallel_size": _expert_tp,
    "context_parallel_size": lambda c: (
        "context parallelism is not mirrored: its attention all-gathers and the loss's "
        "context-parallel scaling are not split into nodes"
        if c.context_parallel_size > 1
        else None
    ),
    "fp16": lambda c: (
        "fp16 needs Megatron's loss scaling, which the front end does not apply; use bf16"
        if c.fp16
        else None
    ),
    "grad_scale_func": lambda c: (
        "config.grad_scale_func (Megatron's loss scaling, set by its optimizer setup) is not "
        "applied by megapipe's front end; bf16 and fp32 need none: set it to None"
        if c.grad_scale_func is not None
        else None
    ),
    "calculate_per_token_loss": lambda c: (
        "calculate_per_token_loss is not mirrored: megapipe divides every microbatch's loss by "
        "num_microbatches, Megatron's per-token mode scales by the token count in "
        "finalize_model_grads"
        if c.calculate_per_token_loss
        else None
    ),
    "recompute_granularity": _recompute,
    "recompute_method": lambda c: None,  # checked with recompute_granularity
    "recompute_num_layers": lambda c: None,
    "recompute_modules": lambda c: None,
    "distribute_saved_activations": lambda c: None,
    "mtp_num_layers": lambda c: None,  # the adapter runs MTP layers on a chunk with the head
    "moe_token_dispatcher_type": lambda c: (
        f"moe_token_dispatcher_type={c.moe_token_dispatcher_type!r}: only the alltoall "
        "dispatcher's dispatch and combine are split into comm nodes"
        if c.num_moe_experts and c.moe_token_dispatcher_type != "alltoall"
        else None
    ),
    "moe_shared_expert_overlap": lambda c: (
        "moe_shared_expert_overlap hides the shared experts inside the dispatcher; megapipe's "
        "combined step overlaps instead (Megatron's overlap refuses it too)"
        if c.moe_shared_expert_overlap
        else None
    ),
    "mlp_chunks_for_training": lambda c: (
        f"mlp_chunks_for_training={c.mlp_chunks_for_training} runs each MoE layer once per "
        "sequence chunk (separate routing and all-to-alls); the adapter's MoE nodes run it once"
        if c.mlp_chunks_for_training > 1 and c.num_moe_experts
        else None
    ),
}

_GRAPHS = (
    "Megatron's graphs capture its layers' own code, which the adapter re-creates node "
    "by node, and megapipe's node graphs (graphs.nodes) capture megapipe's GPT only: "
    "Megatron-Core chunks run eager"
)
# fields whose non-default value is refused with a reason (instead of the generic line)
REASONS = {
    "tp_comm_overlap": "TransformerEngine's userbuffer overlap of tensor-parallel communication",
    "fp8": "FP8 needs TransformerEngine, which is not verified here",
    "fp4": "FP4 needs TransformerEngine, which is not verified here",
    "cuda_graph_impl": _GRAPHS,
    "enable_cuda_graph": _GRAPHS,
    "external_cuda_graph": _GRAPHS,
    "cpu_offloading": "activation offloading is not mirrored",
    "fine_grained_activation_offloading": "activation offloading is not mirrored",
    "moe_paged_stash": "the paged stash of expert activations is not mirrored",
    "moe_layer_recompute": "it checkpoints the whole MoE layer, its all-to-alls included",
    "is_hybrid_model": "hybrid (Mamba) stacks are not adapted",
    "experimental_attention_variant": "its indexer loss needs a loss scale that Megatron's "
    "schedules set and megapipe's front end does not",
    "experimental_attention_variant_loss_scale_func": "an auxiliary loss scale that Megatron's "
    "schedules set",
    "moe_grad_scale_func": "Megatron's aux-loss scaling hook is not applied by megapipe",
    "mtp_grad_scale_func": "Megatron's MTP-loss scaling hook is not applied by megapipe",
    "enable_autocast": "Megatron's schedules wrap the forward in torch.autocast; the front end "
    "does not",
    "overlap_dispatch_backward_with_experts_wgrad": "Megatron's own wgrad stream beside the "
    "dispatch backward",
    "defer_embedding_wgrad_compute": "Megatron's schedules drain the deferred embedding "
    "gradient; the front end does not",
    "num_microbatches_with_partial_activation_checkpoints": "a Megatron schedule feature",
}


def field_defaults(config_class: type) -> dict[str, Any]:
    """Each dataclass field of ``config_class`` with its default (``dataclasses.MISSING`` for a
    required field)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config_class):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = dataclasses.MISSING
    return out


def classified(name: str) -> bool:
    """Whether ``name`` may take any value without a per-field check."""
    return name in MIRRORED or name in SCHEDULE


def _differs(value: Any, default: Any) -> bool:
    if default is dataclasses.MISSING:
        return False
    try:
        return bool(value != default)
    except Exception:  # values that do not compare (tensors): treat as changed
        return value is not default


def config_problem(config: Any) -> str | None:
    """The first setting of ``config`` the adapter does not mirror, as one line; None if all
    are mirrored."""
    defaults = field_defaults(type(config))
    for name, rule in RULES.items():
        reason = rule(config) if name in defaults else None
        if reason:
            return f"TransformerConfig.{name}: {reason}"
    for name, default in defaults.items():
        if classified(name) or name in RULES:
            continue
        value = getattr(config, name)
        feature = OPTIONS_OF.get(name)
        if feature is not None:
            continue  # the feature's own field is checked
        if _differs(value, default):
            why = REASONS.get(
                name,
                "megapipe has not verified that its node split gives Megatron's numbers with it",
            )
            return (
                f"TransformerConfig.{name}={value!r} is not mirrored by megapipe's "
                f"Megatron-Core adapter (the release's default is {default!r}): {why}"
            )
    return None


def check_config(config: Any) -> None:
    """Refuse, in one line naming the field, a config the adapter does not mirror."""
    problem = config_problem(config)
    if problem is not None:
        raise NotImplementedError(problem)
