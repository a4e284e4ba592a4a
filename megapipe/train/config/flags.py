"""Every pretrain flag, declared once (``declare.flag``): Megatron's names, the demo's defaults.

``PretrainFlags`` is both the declaration and the parsed record; its flags' own checks live in
their declarations (those longer than a range: ``flag_checks``), the rules between flags in
``checks``, and ``build.job_config`` turns the record into the typed parts the app reads, checking
each as it builds it. Adding a flag: docs/pretraining.md.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from megapipe.data.tokenizer import TOKENIZER_TYPES
from megapipe.schedule import SCHEDULES
from megapipe.train.config.declare import (
    above,
    at_least,
    build_parser as parser_of,
    finite,
    flag,
    one_of,
)
from megapipe.train.config.flag_checks import (
    GRAPH_IMPLS,
    GRAPH_MODULES,
    HIGH_PRIORITY_GROUPS,
    graph_impl,
    graph_modules,
    indexed_or_text,
    known_groups,
    known_schedule,
    megapipe_model,
    no_fp16,
)

DESCRIPTION = ("Pretrain an MoE GPT with pipeline x expert x data parallelism. With no flags: a "
               "small model on CPU, pp=2 vpp=2 ep=2, overlap on, 4 processes.")
LR_DECAY_STYLES = ("cosine", "linear", "constant")
POSITIVE, COUNT = at_least(1), at_least(0)
MODEL, PRECISION, TRAINING, PARALLEL, DP, RECOMPUTE, IO, FAILURES, PROFILING = (  # --help groups
    "model", "precision", "training", "parallelism", "data parallelism", "activation recompute",
    "data, checkpoints, logging", "failures and preemption", "profiling")
GRAPHS = "CUDA graphs"
ARCHITECTURE, DATA = "model architecture", "data and tokenizer"
POSITION_EMBEDDING_TYPES = ("rope", "learned_absolute")  # models.config's, without torch
QK_LAYERNORM_SCOPES = ("head", "all")  # models.config's, without torch


@dataclass(frozen=True)
class PretrainFlags:
    """Every ``megapipe pretrain`` flag, parsed and checked one by one (module docstring)."""

    RENAMED: ClassVar[dict[str, str]] = {"--moe-a2a-chunks": "--moe-a2a-waves"}

    num_layers: int = flag(6, "transformer layers", POSITIVE, group=MODEL)
    hidden_size: int = flag(96, "model width", POSITIVE, group=MODEL)
    num_attention_heads: int = flag(4, "attention heads", POSITIVE, group=MODEL)
    ffn_hidden_size: int = flag(192, "dense SwiGLU width", POSITIVE, group=MODEL)
    seq_length: int = flag(64, "tokens (bytes) per sample", POSITIVE, group=MODEL)
    num_experts: int = flag(4, "routed experts (0: dense)", COUNT, group=MODEL)
    moe_router_topk: int = flag(2, "experts per token", POSITIVE, group=MODEL)
    moe_ffn_hidden_size: int = flag(96, "width of each expert", POSITIVE, group=MODEL)
    moe_shared_expert_intermediate_size: int | None = flag(
        None, "a shared expert of this width", group=MODEL)
    moe_layer_freq: str = flag(
        "1", "N: every Nth layer is MoE; or a 0/1 pattern per layer like '[0,1,1,1]' (dense "
        "layers first, then a period)", group=MODEL)
    moe_aux_loss_coeff: float = flag(1e-2, "load-balancing loss weight", finite, group=MODEL)
    moe_router_dtype: str | None = flag(
        None, "fp32 or fp64: compute the router's logits in that precision (default: the "
        "activations' dtype; softmax, top-k and the auxiliary losses are always at least fp32)",
        one_of("fp32", "fp64"), group=MODEL)
    moe_router_pre_softmax: bool = flag(
        True, "the top-k softmax probabilities weigh the experts as they are (default on here; "
        "Megatron's default is off: --no-moe-router-pre-softmax divides them by their sum, as "
        "Mixtral and Qwen3-MoE's norm_topk_prob)",
        group=MODEL)
    moe_expert_capacity_factor: float | None = flag(
        None, "drop routing choices over capacity factor x tokens x top-k / experts per expert, "
        "padding every expert to that capacity (default: dropless)", above(0), group=MODEL)
    moe_expert_rank_capacity_factor: float | None = flag(
        None, "dropless MoE without host reads: each EP rank's dispatch and expert buffers hold "
        "F x its routed rows, counts stay on the device, and a step in which any rank's rows do "
        "not fit runs again without the capacity (same losses; the log counts the steps run "
        "again)", finite, above(0), group=MODEL, metavar="F")
    moe_pad_expert_input_to_capacity: bool = flag(
        False, "accepted for Megatron scripts: megapipe always pads to the capacity (needs "
        "--moe-expert-capacity-factor)", group=MODEL)

    # issue 31: the modern model's flags (Megatron's names; megapipe's defaults said in --help)
    position_embedding_type: str = flag(
        "rope", "rope (rotary, the default here; Megatron's default is learned_absolute) or "
        "learned_absolute", one_of(*POSITION_EMBEDDING_TYPES), group=ARCHITECTURE)
    rotary_base: float = flag(10000.0, "rope's base (theta)", finite, above(0, "g"),
                              group=ARCHITECTURE)
    group_query_attention: bool = flag(
        True, "grouped-query attention with --num-query-groups key/value heads (default on "
        "here; Megatron's default is off: --no-group-query-attention, one per query head)",
        group=ARCHITECTURE)
    num_query_groups: int | None = flag(
        2, "key/value heads with --group-query-attention, dividing the attention heads "
        "(default 2 here; Megatron's 1)", POSITIVE, group=ARCHITECTURE)
    qk_layernorm: bool = flag(
        True, "RMSNorm of each head's query and key (default on here, as Qwen3; Megatron's "
        "default is off: --no-qk-layernorm)", group=ARCHITECTURE)
    qk_layernorm_scope: str = flag(
        "head", "with --qk-layernorm: head (an RMSNorm over each head, as Megatron and Qwen3) "
        "or all (one over all the queries and one over all the keys, as OLMoE)",
        one_of(*QK_LAYERNORM_SCOPES), group=ARCHITECTURE)
    kv_channels: int | None = flag(None, "the head dim (default: hidden / heads)", POSITIVE,
                                   group=ARCHITECTURE)
    norm_epsilon: float = flag(1e-5, "the RMSNorms' epsilon", finite, above(0, "g"),
                               group=ARCHITECTURE)
    untie_embeddings_and_output_weights: bool = flag(
        True, "the output layer has its own weight (default on here; Megatron ties without "
        "this flag: --no-untie-embeddings-and-output-weights ties them)", group=ARCHITECTURE)
    normalization: str = flag(
        "RMSNorm", "RMSNorm (megapipe's only normalization; Megatron's default LayerNorm is "
        "refused)", megapipe_model("normalizes with RMSNorm", "LayerNorm (Megatron's default)"),
        group=ARCHITECTURE)
    swiglu: bool = flag(
        True, "SwiGLU MLPs and experts (always on here: --no-swiglu, Megatron's GeLU without "
        "--swiglu, is refused)", megapipe_model("has SwiGLU MLPs and experts",
                         "GeLU (Megatron's default without --swiglu)"),
        group=ARCHITECTURE)
    disable_bias_linear: bool = flag(
        True, "no biases in the linear layers (always on here: --no-disable-bias-linear, "
        "Megatron's default with biases, is refused)",
        megapipe_model("has no linear biases",
                        "adding biases (Megatron's default without --disable-bias-linear)"),
        group=ARCHITECTURE)
    make_vocab_size_divisible_by: int = flag(
        128, "pad the tokenizer's vocabulary to a multiple of this, as Megatron does",
        POSITIVE, group=ARCHITECTURE)

    tokenizer_type: str | None = flag(
        None, "HuggingFaceTokenizer (--tokenizer-model) or ByteTokenizer (256 byte ids; the "
        "default for raw text; indexed data needs the type preprocess-data used)",
        one_of(*TOKENIZER_TYPES), group=DATA)
    tokenizer_model: str | None = flag(
        None, "a Hugging Face tokenizer.json or its directory (megapipe train-tokenizer's "
        "output)", group=DATA, metavar="PATH")
    split: str | None = flag(
        None, "with indexed data: train,validation,test shares of each dataset (default "
        "Megatron's 969,30,1)", group=DATA)
    data_cache_path: str | None = flag(
        None, "with indexed data: where Megatron's index caches go (default PREFIX's folder's "
        "cache/)", group=DATA, metavar="DIR")

    bf16: bool = flag(False, "bf16 parameters and activations; fp32 main weights, AdamW moments "
                      "and gradient accumulation/reduction", group=PRECISION)
    fp16: bool = flag(False, "not supported (one clear error): use --bf16", no_fp16,
                      group=PRECISION)
    deterministic_mode: bool = flag(
        False, "deterministic kernels only (torch's deterministic algorithms, deterministic "
        "fused-attention backward, cuBLAS workspace setting), so a GPU run repeats bit for bit "
        "and a resume equals the uninterrupted run; an operation without a deterministic kernel "
        "is an error", group=PRECISION)

    micro_batch_size: int = flag(4, "samples per microbatch", POSITIVE, group=TRAINING)
    global_batch_size: int = flag(32, "samples per iteration (microbatches per step = global / "
                                  "(micro x dp))", POSITIVE, group=TRAINING)
    train_iters: int = flag(100, "optimizer steps", POSITIVE, group=TRAINING)
    lr: float = flag(3e-3, "peak learning rate", finite, group=TRAINING)
    min_lr: float = flag(3e-4, "final learning rate", finite, group=TRAINING)
    lr_warmup_iters: int = flag(10, "linear warm-up from 0", COUNT, group=TRAINING)
    lr_decay_iters: int | None = flag(None, "iteration at which the decay reaches --min-lr "
                                      "(default: train-iters)", POSITIVE, group=TRAINING)
    lr_decay_style: str = flag("cosine", f"one of {', '.join(LR_DECAY_STYLES)}",
                               one_of(*LR_DECAY_STYLES), group=TRAINING)
    weight_decay: float = flag(0.01, "AdamW weight decay", finite, group=TRAINING)
    clip_grad: float = flag(1.0, "0 disables clipping", finite, group=TRAINING)
    seed: int = flag(1234, "model initialisation and data sampling", group=TRAINING)
    manual_gc: bool = flag(
        False, "turn Python's automatic garbage collection off for the run and collect at the "
        "same point of the loop on every rank instead (--manual-gc-interval, evaluations)",
        group=TRAINING)
    manual_gc_interval: int = flag(
        0, "with --manual-gc: collect after every N-th iteration (0: never between iterations)",
        COUNT, group=TRAINING, metavar="N")
    manual_gc_eval: bool = flag(
        True, "with --manual-gc: collect before and after each evaluation "
        "(--no-manual-gc-eval: not there)", group=TRAINING)
    heap_trim_interval: int = flag(
        100, "hand the C heap's free pages back to the system (glibc malloc_trim) after every "
        "N-th iteration, on every rank (0: never; megapipe's, not Megatron's)",
        COUNT, group=TRAINING, metavar="N")

    pipeline_model_parallel_size: int = flag(2, "pp", POSITIVE, group=PARALLEL)
    virtual_pipeline_model_parallel_size: int | None = flag(
        2, "vpp: stages per rank (needs pp > 1)", POSITIVE, group=PARALLEL)
    expert_model_parallel_size: int = flag(2, "ep (divides dp = world / pp and the experts)",
                                           POSITIVE, group=PARALLEL)
    overlap_moe_expert_parallel_comm: bool = flag(
        True, "co-schedule one microbatch's forward with another's backward to hide the "
        "all-to-all (default on; --no-overlap-moe-expert-parallel-comm turns it off)",
        group=PARALLEL)
    overlap_moe_expert_parallel_comm_auto: bool = flag(
        False, "time plain and combined steps over the first iterations and keep the faster "
        "(every rank agrees; same losses either way), checking again every "
        "--overlap-auto-interval iterations; each decision is logged as 'overlap auto:'",
        group=PARALLEL)
    overlap_auto_interval: int = flag(
        500, "with --overlap-moe-expert-parallel-comm-auto: iterations from one timing trial's "
        "start to the next (0: time once; else at least the trial's 6)", COUNT, group=PARALLEL,
        metavar="N")
    overlap_max_extra_in_flight: int | None = flag(
        None, "with the overlap: at most K more microbatch-stages in flight on any rank than the "
        "plain schedule (activation memory; default: no budget)", COUNT, group=PARALLEL,
        metavar="K")
    delay_wgrad_compute: bool = flag(
        False, "defer expert weight gradients to fill the backward all-to-all", group=PARALLEL)
    moe_a2a_waves: int = flag(
        1, "send each MoE layer's all-to-alls in this many waves, one expert group each, so a "
        "forward or backward with no partner overlaps its own waves (needs the overlap; at most "
        "the experts per EP rank; default 1: off)", POSITIVE, group=PARALLEL)
    pipeline_schedule: str | None = flag(
        None, f"one of {', '.join(SCHEDULES)} (default: interleaved-1f1b when vpp > 1, else "
        "1f1b)", known_schedule, group=PARALLEL)
    nproc: int | None = flag(None, "processes to start when not launched by torchrun or srun "
                             "(default: pp x ep)", POSITIVE, group=PARALLEL)
    high_priority_stream_groups: tuple[str, ...] = flag(
        (), "process groups whose NCCL communicator runs on a high-priority CUDA stream, any of "
        f"{', '.join(HIGH_PRIORITY_GROUPS)} (e.g. ep for the token all-to-all; ignored on gloo)",
        known_groups, group=PARALLEL)
    moe_emulated_link_gbps: float | None = flag(
        None, "emulate an all-to-all link of this many GB/s (CPU overlap studies; off by "
        "default, the log says when it is on)", finite, above(0, "g"), group=PARALLEL)
    moe_emulated_link_latency_us: float = flag(
        0.0, "latency per all-to-all of the emulated link, microseconds", finite,
        at_least(0, "g"), group=PARALLEL)

    overlap_grad_reduce: bool = flag(
        False, "reduce each bucket of gradients over data parallelism as soon as the step's "
        "backward has finished it, on a communication stream, instead of all gradients after "
        "the step", group=DP)
    use_distributed_optimizer: bool = flag(
        False, "shard the fp32 main weights and AdamW moments over the data-parallel group "
        "(experts over expert-DP): reduce-scatter the gradients, all-gather the updated weights",
        group=DP)
    overlap_param_gather: bool = flag(
        False, "with --use-distributed-optimizer and --overlap-grad-reduce: all-gather the "
        "updated weights behind the next step's first forwards (each module waits for its own "
        "buckets)", group=DP)
    ddp_bucket_size: int | None = flag(
        None, "with --overlap-grad-reduce: parameters (elements) per bucket (default Megatron's "
        "max(40M, 1M x dp))", group=DP, metavar="N")
    dp_emulated_link_gbps: float | None = flag(
        None, "emulate a data-parallel link of this many GB/s for the bucketed reductions and "
        "gathers (CPU overlap studies; off by default, the log says when it is on)", finite,
        above(0, "g"), group=DP)

    recompute_granularity: str | None = flag(
        None, "selective: recompute --recompute-modules inside their node's backward; full: "
        "whole layers, every compute node keeping only its inputs and running again in its own "
        "backward (the all-to-alls never run again)", group=RECOMPUTE,
        choices=("full", "selective"))
    recompute_method: str | None = flag(
        None, "with --recompute-granularity full: uniform recomputes every layer of each "
        "pipeline chunk, in groups of --recompute-num-layers (a group keeps no layer output "
        "inside it); block recomputes the first --recompute-num-layers layers of each chunk",
        group=RECOMPUTE, choices=("uniform", "block"))
    recompute_num_layers: int | None = flag(
        None, "with --recompute-granularity full: layers per uniform group, or layers "
        "recomputed per chunk with block (default 1)", POSITIVE, group=RECOMPUTE, metavar="N")
    recompute_modules: tuple[str, ...] | None = flag(
        None, "with selective granularity: any of core_attn, moe_act (default: core_attn, as "
        "Megatron)", group=RECOMPUTE)

    data_path: tuple[str, ...] = flag(
        (), "text files or directories (read byte level; default: the Python standard "
        "library's sources), or Megatron's indexed dataset prefixes, optionally weighted "
        "(0.7 A 0.3 B)", indexed_or_text, group=IO, nargs="+")
    save: str | None = flag(None, "checkpoint directory", group=IO)
    load: str | None = flag(None, "resume directory", group=IO)
    load_hf: str | None = flag(
        None, "start from the weights of a Hugging Face Qwen3-MoE, Mixtral or OLMoE directory "
        "(as transformers or export-hf writes it): the model flags not given are its "
        "config.json's, those given must agree, the vocabulary is its; once --load holds a "
        "checkpoint, that is resumed instead", group=IO, metavar="DIR")
    save_interval: int | None = flag(
        None, "iterations between saves (a final save always happens with --save)", POSITIVE,
        group=IO)
    eval_interval: int = flag(50, "validation every N iterations (0: never)", COUNT, group=IO)
    eval_iters: int = flag(2, "validation batches", COUNT, group=IO)
    log_interval: int = flag(10, "iterations per log line", POSITIVE, group=IO)
    tensorboard_dir: str | None = flag(None, "also write scalars for TensorBoard", group=IO)
    log_activation_memory: bool = flag(
        False, "measure the bytes saved for backward or held by the pipeline each step (act mem "
        "column; changes no bit, costs host time per saved tensor)", group=IO)

    keep_last: int | None = flag(None, "keep only the N newest complete checkpoints in --save "
                                 "(default: all)", POSITIVE, group=FAILURES)
    exit_signal_handler: bool = flag(
        False, "on SIGTERM finish the current step, save a checkpoint, exit 0", group=FAILURES)
    exit_interval: int | None = flag(None, "save and exit 0 after every N-th iteration",
                                     POSITIVE, group=FAILURES)
    exit_duration_in_mins: float | None = flag(
        None, "save and exit 0 after the first iteration ending past this many minutes",
        above(0), finite, group=FAILURES)
    distributed_timeout_minutes: float = flag(
        10.0, "how long any rank waits for another (pipeline receive, all-to-all, gradient "
        "reduction) before it stops naming what it waited on", above(0), finite, group=FAILURES)

    cuda_graph_impl: str = flag(
        "none", "local: replay the static nodes that --cuda-graph-modules names as CUDA graphs "
        "(Megatron's local implementation, in megapipe's node split; without CUDA the run says "
        "so and runs eager); none: eager; transformer_engine: refused (TransformerEngine is "
        "not used)", graph_impl, group=GRAPHS,
        choices=GRAPH_IMPLS)
    cuda_graph_modules: tuple[str, ...] = flag(
        (), f"with --cuda-graph-impl local: any of {', '.join(GRAPH_MODULES)} (Megatron's "
        "names; megapipe captures whole nodes: a MoE layer's attention node holds attn, "
        "moe_router and moe_preprocess, a dense layer's node attn and mlp; moe: also the MoE "
        "layer's experts and finish nodes, with --moe-expert-rank-capacity-factor)",
        graph_modules,
        group=GRAPHS)
    cuda_graph_scope: tuple[str, ...] = flag(
        (), "Megatron 0.16-0.17's name of --cuda-graph-modules", graph_modules, group=GRAPHS)

    profile_trace: str | None = flag(
        None, "write one Perfetto/Chrome trace of every rank's steps --profile-step-start.."
        "--profile-step-end to FILE (read it with `megapipe trace summarize FILE`)",
        group=PROFILING, metavar="FILE")
    profile_step_start: int = flag(2, "first iteration traced (1-based, included; default 2)",
                                   group=PROFILING)
    profile_step_end: int | None = flag(
        None, "last iteration traced (included; default: the start)", group=PROFILING)
    use_pytorch_profiler: bool = flag(
        False, "also run torch.profiler over the traced steps, writing one trace per rank next "
        "to --profile-trace, with megapipe's node names as ranges", group=PROFILING)


def build_parser(prog: str = "megapipe pretrain", add_help: bool = True) -> argparse.ArgumentParser:
    """The argparse parser of ``PretrainFlags`` (``add_help=False``: a parent parser for
    ``megapipe pretrain``'s subcommand)."""
    return parser_of(PretrainFlags, prog, DESCRIPTION, add_help)
