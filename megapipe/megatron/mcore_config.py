"""Which ``TransformerConfig`` settings the adapter mirrors: every field is accounted for.

The adapter runs Megatron's own modules (attention, MLP, router, experts, token dispatcher,
embedding, output layer and loss) unchanged and re-creates only the code between them
(``GPTModel.forward``, ``TransformerBlock.forward``, the MoE part of ``TransformerLayer`` and
of the MTP layer). ``check_config`` therefore sorts every field of the config into:

- ``MIRRORED``: read only by Megatron's own modules, or by code the adapter mirrors; any value.
- ``SCHEDULE``: read by Megatron's pipeline schedules, which megapipe's front end replaces
  (pipeline sizes, p2p options, the schedule's own overlap); any value.
- ``OPTIONS_OF``: options of a feature another field switches on; any value (the feature
  itself is checked).
- ``RULES``: allowed values decided by a rule that says why others are refused.
- every other field must keep its release's default: refused otherwise, naming the field.

So a field a new Megatron release adds is refused until someone classifies it here; the tests
check that every field of every supported release is either classified or at its default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

MIRRORED = frozenset({
    # model shape and initialisation
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
    "num_query_groups", "params_dtype", "bf16", "perform_initialization",
    "use_cpu_initialization", "init_model_with_meta_device", "init_method",
    "output_layer_init_method", "init_method_std", "embedding_init_method",
    "embedding_init_method_std", "moe_layer_freq", "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage", "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
    # inside attention and the norms
    "attention_backend", "softmax_scale", "softmax_type", "hidden_dropout", "attention_dropout",
    "layernorm_epsilon", "layernorm_zero_centered_gamma", "add_bias_linear", "add_qkv_bias",
    "gated_linear_unit", "activation_func", "glu_linear_offset", "activation_func_clamp_value",
    "use_te_activation_func", "rotary_interleaved", "window_size", "window_attn_skip_freq",
    "normalization", "qk_layernorm", "qk_l2_norm", "qk_clip", "qk_clip_alpha",
    "qk_clip_threshold", "log_max_attention_logit", "attention_output_gate",
    "multi_latent_attention", "no_rope_freq", "mrope_section", "apply_query_key_layer_scaling",
    "attention_softmax_in_fp32", "disable_bf16_reduced_precision_matmul",
    "bias_activation_fusion", "masked_softmax_fusion", "persist_layer_norm",
    "memory_efficient_layer_norm", "bias_dropout_fusion", "apply_rope_fusion",
    "use_fused_weighted_squared_relu", "fused_single_qkv_rope", "flash_attention_version",
    "use_transformer_engine_op_fuser", "deterministic_mode", "batch_invariant_mode",
    "disable_parameter_transpose_cache", "clone_scatter_output_in_embedding",
    "apply_residual_connection_post_layernorm",  # read nowhere in the model code
    # multi-latent attention (MLATransformerConfig)
    "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "rope_type", "rotary_base", "rotary_percent", "rotary_scaling_factor",
    "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
    "cache_mla_latents", "mla_down_proj_fusion",
    # inside the router, the experts and the dispatcher's permutation
    "num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate", "moe_router_load_balancing_type", "moe_router_topk",
    "moe_router_topk_limited_devices", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_score_function",
    "moe_router_dtype", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
    "moe_router_force_load_balancing", "moe_router_force_biased", "moe_aux_loss_coeff",
    "moe_z_loss_coeff", "moe_input_jitter_eps", "moe_token_dropping",
    "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "moe_token_drop_policy",
    "moe_expert_rank_capacity_factor", "moe_grouped_gemm", "moe_use_legacy_grouped_gemm",
    "moe_permute_fusion", "moe_router_fusion", "moe_apply_probs_on_input",
    "moe_per_layer_logging", "moe_latent_size", "moe_mlp_glu_interleave_size",
    "moe_single_grouped_weight", "moe_single_grouped_bias", "use_grouped_gemm_for_dense_mlp",
    "use_grouped_gemm_for_shared_expert", "moe_shared_expert_glu_interleave_size",
    "moe_router_quantile_balancing_ema",
    # the head: GPTModel._postprocess, which the adapter calls
    "mtp_loss_scaling_factor", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl",
    "use_mup", "config_logger_dir",
    # mirrored by the adapter itself (mcore_layers, mcore_wgrad, mcore_release)
    "fp32_residual_connection", "fused_residual_rmsnorm", "delay_wgrad_compute",
    "gradient_accumulation_fusion",
    "async_tensor_model_parallel_allreduce", "use_te_rng_tracker", "transformer_impl",
    "expert_model_parallel_size", "hetereogenous_dist_checkpoint",
})

SCHEDULE = frozenset({
    "pipeline_model_parallel_comm_backend", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "timers", "finalize_model_grads_func",
    "pipeline_dtype", "variable_seq_lengths", "overlap_p2p_comm", "batch_p2p_comm",
    "batch_p2p_sync", "use_ring_exchange_p2p", "deallocate_pipeline_outputs",
    "overlap_p2p_comm_warmup_flush", "microbatch_group_size_per_vp_stage",
    "barrier_with_L1_time", "overlap_moe_expert_parallel_comm",
    # Megatron DDP's hooks: the front end calls them where Megatron's schedules do (ddp_hooks)
    "no_sync_func", "grad_sync_func", "param_sync_func",
    "ep_overlap_early_attn_memory_release", "high_priority_a2a_comm_stream",
})

# option -> the field that switches its feature on (each such feature is refused or checked)
OPTIONS_OF = {
    **{name: "tp_comm_overlap" for name in (
        "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
        "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_atomic_ag", "tp_comm_split_rs",
        "tp_comm_atomic_rs", "tp_comm_overlap_disable_qkv", "tp_comm_overlap_disable_fc1",
        "tp_comm_bootstrap_backend")},
    **{name: "fp8" for name in (
        "fp8_recipe", "fp8_margin", "fp8_interval", "fp8_amax_history_len",
        "fp8_amax_compute_algo", "fp8_wgrad", "fp8_dot_product_attention",
        "fp8_multi_head_attention", "tp_only_amax_red", "first_last_layers_bf16",
        "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
        "activation_func_fp8_input_store", "moe_router_padding_for_fp8", "fp8_output_proj")},
    **{name: "fp4" for name in ("fp4_recipe", "moe_router_padding_for_quantization")},
    **{name: "cpu_offloading" for name in (
        "cpu_offloading_num_layers", "_cpu_offloading_context", "cpu_offloading_activations",
        "cpu_offloading_weights", "cpu_offloading_double_buffering",
        "cpu_offloading_retain_pinned_cpu_buffers")},
    **{name: "fine_grained_activation_offloading" for name in (
        "offload_modules", "min_offloaded_tensor_size", "delay_offload_until_cuda_graph",
        "delta_offload_bytes_across_pp_ranks", "activation_offload_fraction",
        "fine_grained_offloading_max_inflight_offloads")},
    **{name: "cuda_graph_impl" for name in (
        "cuda_graph_use_single_mempool", "cuda_graph_retain_backward_graph",
        "cuda_graph_warmup_steps", "cuda_graph_scope", "cuda_graph_modules",
        "moe_pad_experts_for_cuda_graph_inference", "inference_cuda_graph_scope")},
    **{name: "moe_paged_stash" for name in (
        "moe_paged_stash_page_size", "moe_paged_stash_buffer_size_factor_cuda",
        "moe_paged_stash_buffer_size_factor_cpu")},
    **{name: "moe_token_dispatcher_type" for name in (
        "moe_enable_deepep", "moe_flex_dispatcher_backend", "moe_deepep_num_sms",
        "moe_hybridep_num_sms", "moe_permute_fusion_into_hybridep",
        "moe_hybridep_num_blocks_permute", "moe_hybridep_num_blocks_unpermute",
        "moe_hybridep_num_sms_preprocessing", "moe_hybridep_pad_uneven_dispatch_inputs",
        "moe_flex_dispatcher_num_sms", "moe_ncclep_static_shape", "moe_ncclep_zero_copy")},
    **{name: "is_hybrid_model" for name in (
        "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
        "use_mamba_mem_eff_path", "mamba_training_ssm_states_dtype")},
    **{name: "linear_attention_freq" for name in (
        "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
        "linear_num_key_heads", "linear_num_value_heads")},
    **{name: "experimental_attention_variant" for name in (
        "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk",
        "dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss", "dsa_indexer_topk_freq",
        "dsa_indexer_skip_topk_offset", "dsa_kernel_backend", "dsa_indexer_rope_interleaved",
        "dsa_indexer_rotate_activation", "dsa_indexer_scoring_relu",
        "dsa_indexer_k_norm_epsilon", "dsa_indexer_k_norm_fp32")},
    **{name: "use_mup" for name in (
        "mup_width_mult", "mup_base_hidden_size", "mup_embedding_mult", "mup_output_mult",
        "mup_base_head_dim", "mup_attn_scale_power")},
    **{name: "context_parallel_size" for name in (
        "cp_comm_type", "hierarchical_context_parallel_sizes")},
    **{name: "enable_autocast" for name in ("autocast_dtype",)},
    **{name: "use_kitchen_attention" for name in ("kitchen_attention_backend",)},
    **{name: "defer_embedding_wgrad_compute" for name in ("wgrad_deferral_limit",)},
    # inference only: the adapter runs training forwards (inference arguments are refused)
    **{name: "inference" for name in (
        "flash_decode", "inference_rng_tracker", "inference_sampling_seed", "symmetric_ar_type",
        "use_inference_optimized_layers", "inference_fuse_tp_communication",
        "mlp_chunks_for_prefill", "nccl_all_reduce_for_prefill",
        "inference_disable_triton_nvls_kernels", "inference_grouped_gemm_backend",
        "inference_moe_disable_fused_quant_kernels", "inference_moe_token_dispatcher_type")},
}

Rule = Callable[[Any], str | None]


def _recompute(c: Any) -> str | None:
    if c.recompute_granularity is None:
        return None
    if c.recompute_granularity == "selective":
        if "moe" in (c.recompute_modules or ()):
            return ("recompute_modules containing 'moe' checkpoints the whole MoE layer, its "
                    "all-to-alls included, across the adapter's nodes (Megatron's overlap refuses "
                    "it too); recompute the other modules, or use recompute_granularity='full', "
                    "which megapipe recomputes node by node without re-running the dispatch")
        return None
    if c.recompute_granularity == "full":
        if c.recompute_method not in ("uniform", "block"):
            return f"recompute_method={c.recompute_method!r} must be 'uniform' or 'block'"
        if c.distribute_saved_activations:
            return ("distribute_saved_activations=True is not mirrored: megapipe's node "
                    "recompute keeps each node's inputs whole")
        if c.hidden_dropout or c.attention_dropout or c.moe_input_jitter_eps:
            return ("full recompute with dropout or router jitter is not mirrored: megapipe "
                    "re-runs a node without restoring the random state its first run drew from")
        return None
    return f"recompute_granularity={c.recompute_granularity!r} is not 'selective' or 'full'"


def _expert_tp(c: Any) -> str | None:
    etp = c.expert_tensor_parallel_size or c.tensor_model_parallel_size
    if etp > 1 and c.num_moe_experts:
        return (f"expert_tensor_parallel_size={etp} is not verified: the adapter would run its "
                "all-gather and reduce-scatter inside the experts' node (compute stream, its own "
                "group), but Megatron's own expert-tensor-parallel path needs uneven all-gathers "
                "that gloo cannot run, so there is no CPU reference to test it against; set "
                "expert_tensor_parallel_size=1 (expert parallelism folds into tensor x data)")
    return None


RULES: dict[str, Rule] = {
    "tensor_model_parallel_size": lambda c: None,
    "sequence_parallel": lambda c: (
        "tensor parallelism with MoE layers needs sequence_parallel=True (Megatron's rule)"
        if c.tensor_model_parallel_size > 1 and c.num_moe_experts and not c.sequence_parallel
        else None),
    "expert_tensor_parallel_size": _expert_tp,
    "context_parallel_size": lambda c: (
        "context parallelism is not mirrored: its attention all-gathers and the loss's "
        "context-parallel scaling are not split into nodes" if c.context_parallel_size > 1
        else None),
    "fp16": lambda c: (
        "fp16 needs Megatron's loss scaling, which the front end does not apply; use bf16"
        if c.fp16 else None),
    "grad_scale_func": lambda c: (
        "config.grad_scale_func (Megatron's loss scaling, set by its optimizer setup) is not "
        "applied by megapipe's front end; bf16 and fp32 need none: set it to None"
        if c.grad_scale_func is not None else None),
    "calculate_per_token_loss": lambda c: (
        "calculate_per_token_loss is not mirrored: megapipe divides every microbatch's loss by "
        "num_microbatches, Megatron's per-token mode scales by the token count in "
        "finalize_model_grads" if c.calculate_per_token_loss else None),
    "recompute_granularity": _recompute,
    "recompute_method": lambda c: None,  # checked with recompute_granularity
    "recompute_num_layers": lambda c: None,
    "recompute_modules": lambda c: None,
    "distribute_saved_activations": lambda c: None,
    "mtp_num_layers": lambda c: None,  # the adapter runs MTP layers on a chunk with the head
    "moe_token_dispatcher_type": lambda c: (
        f"moe_token_dispatcher_type={c.moe_token_dispatcher_type!r}: only the alltoall "
        "dispatcher's dispatch and combine are split into comm nodes"
        if c.num_moe_experts and c.moe_token_dispatcher_type != "alltoall" else None),
    "moe_shared_expert_overlap": lambda c: (
        "moe_shared_expert_overlap hides the shared experts inside the dispatcher; megapipe's "
        "combined step overlaps instead (Megatron's overlap refuses it too)"
        if c.moe_shared_expert_overlap else None),
    "mlp_chunks_for_training": lambda c: (
        f"mlp_chunks_for_training={c.mlp_chunks_for_training} runs each MoE layer once per "
        "sequence chunk (separate routing and all-to-alls); the adapter's MoE nodes run it once"
        if c.mlp_chunks_for_training > 1 and c.num_moe_experts else None),
}

_GRAPHS = ("Megatron's graphs capture its layers' own code, which the adapter re-creates node "
           "by node, and megapipe's node graphs (graphs.nodes) capture megapipe's GPT only: "
           "Megatron-Core chunks run eager")
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
            why = REASONS.get(name, "megapipe has not verified that its node split gives "
                                    "Megatron's numbers with it")
            return (f"TransformerConfig.{name}={value!r} is not mirrored by megapipe's "
                    f"Megatron-Core adapter (the release's default is {default!r}): {why}")
    return None


def check_config(config: Any) -> None:
    """Refuse, in one line naming the field, a config the adapter does not mirror."""
    problem = config_problem(config)
    if problem is not None:
        raise NotImplementedError(problem)
