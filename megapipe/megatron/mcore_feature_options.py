"""The options of a ``TransformerConfig`` feature that another field switches on.

``OPTIONS_OF`` maps each option to the field that switches its feature on; an option may take
any value, because ``mcore_config`` checks the feature itself (refused, or allowed by a rule).
"""

# option -> the field that switches its feature on (each such feature is refused or checked)
OPTIONS_OF = {
    **{
        name: "tp_comm_overlap"
        for name in (
            "tp_comm_bulk_wgrad",
            "tp_comm_bulk_dgrad",
            "tp_comm_overlap_ag",
            "tp_comm_overlap_rs",
            "tp_comm_overlap_rs_dgrad",
            "tp_comm_split_ag",
            "tp_comm_atomic_ag",
            "tp_comm_split_rs",
            "tp_comm_atomic_rs",
            "tp_comm_overlap_disable_qkv",
            "tp_comm_overlap_disable_fc1",
            "tp_comm_bootstrap_backend",
        )
    },
    **{
        name: "fp8"
        for name in (
            "fp8_recipe",
            "fp8_margin",
            "fp8_interval",
            "fp8_amax_history_len",
            "fp8_amax_compute_algo",
            "fp8_wgrad",
            "fp8_dot_product_attention",
            "fp8_multi_head_attention",
            "tp_only_amax_red",
            "first_last_layers_bf16",
            "num_layers_at_start_in_bf16",
            "num_layers_at_end_in_bf16",
            "activation_func_fp8_input_store",
            "moe_router_padding_for_fp8",
            "fp8_output_proj",
        )
    },
    **{name: "fp4" for name in ("fp4_recipe", "moe_router_padding_for_quantization")},
    **{
        name: "cpu_offloading"
        for name in (
            "cpu_offloading_num_layers",
            "_cpu_offloading_context",
            "cpu_offloading_activations",
            "cpu_offloading_weights",
            "cpu_offloading_double_buffering",
            "cpu_offloading_retain_pinned_cpu_buffers",
        )
    },
    **{
        name: "fine_grained_activation_offloading"
        for name in (
            "offload_modules",
            "min_offloaded_tensor_size",
            "delay_offload_until_cuda_graph",
            "delta_offload_bytes_across_pp_ranks",
            "activation_offload_fraction",
            "fine_grained_offloading_max_inflight_offloads",
        )
    },
    **{
        name: "cuda_graph_impl"
        for name in (
            "cuda_graph_use_single_mempool",
            "cuda_graph_retain_backward_graph",
            "cuda_graph_warmup_steps",
            "cuda_graph_scope",
            "cuda_graph_modules",
            "moe_pad_experts_for_cuda_graph_inference",
            "inference_cuda_graph_scope",
        )
    },
    **{
        name: "moe_paged_stash"
        for name in (
            "moe_paged_stash_page_size",
            "moe_paged_stash_buffer_size_factor_cuda",
            "moe_paged_stash_buffer_size_factor_cpu",
        )
    },
    **{
        name: "moe_token_dispatcher_type"
        for name in (
            "moe_enable_deepep",
            "moe_flex_dispatcher_backend",
            "moe_deepep_num_sms",
            "moe_hybridep_num_sms",
            "moe_permute_fusion_into_hybridep",
            "moe_hybridep_num_blocks_permute",
            "moe_hybridep_num_blocks_unpermute",
            "moe_hybridep_num_sms_preprocessing",
            "moe_hybridep_pad_uneven_dispatch_inputs",
            "moe_flex_dispatcher_num_sms",
            "moe_ncclep_static_shape",
            "moe_ncclep_zero_copy",
        )
    },
    **{
        name: "is_hybrid_model"
        for name in (
            "mamba_state_dim",
            "mamba_head_dim",
            "mamba_num_groups",
            "mamba_num_heads",
            "use_mamba_mem_eff_path",
            "mamba_training_ssm_states_dtype",
        )
    },
    **{
        name: "linear_attention_freq"
        for name in (
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
        )
    },
    **{
        name: "experimental_attention_variant"
        for name in (
            "dsa_indexer_n_heads",
            "dsa_indexer_head_dim",
            "dsa_indexer_topk",
            "dsa_indexer_loss_coeff",
            "dsa_indexer_use_sparse_loss",
            "dsa_indexer_topk_freq",
            "dsa_indexer_skip_topk_offset",
            "dsa_kernel_backend",
            "dsa_indexer_rope_interleaved",
            "dsa_indexer_rotate_activation",
            "dsa_indexer_scoring_relu",
            "dsa_indexer_k_norm_epsilon",
            "dsa_indexer_k_norm_fp32",
        )
    },
    **{
        name: "use_mup"
        for name in (
            "mup_width_mult",
            "mup_base_hidden_size",
            "mup_embedding_mult",
            "mup_output_mult",
            "mup_base_head_dim",
            "mup_attn_scale_power",
        )
    },
    **{
        name: "context_parallel_size"
        for name in ("cp_comm_type", "hierarchical_context_parallel_sizes")
    },
    **{name: "enable_autocast" for name in ("autocast_dtype",)},
    **{name: "use_kitchen_attention" for name in ("kitchen_attention_backend",)},
    **{name: "defer_embedding_wgrad_compute" for name in ("wgrad_deferral_limit",)},
    # inference only: the adapter runs training forwards (inference arguments are refused)
    **{
        name: "inference"
        for name in (
            "flash_decode",
            "inference_rng_tracker",
            "inference_sampling_seed",
            "symmetric_ar_type",
            "use_inference_optimized_layers",
            "inference_fuse_tp_communication",
            "mlp_chunks_for_prefill",
            "nccl_all_reduce_for_prefill",
            "inference_disable_triton_nvls_kernels",
            "inference_grouped_gemm_backend",
            "inference_moe_disable_fused_quant_kernels",
            "inference_moe_token_dispatcher_type",
        )
    },
}
