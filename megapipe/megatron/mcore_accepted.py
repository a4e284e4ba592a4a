"""The ``TransformerConfig`` fields megapipe's Megatron-Core adapter accepts with any value.

``MIRRORED``: read only by Megatron's own modules (which the adapter runs unchanged) or by code
the adapter mirrors. ``SCHEDULE``: read only by Megatron's pipeline schedules, which megapipe's
front end replaces (pipeline sizes, p2p options, the schedule's own overlap). ``mcore_config``
checks every other field.
"""

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
