"""The pretrain script's flags (Megatron's names) and their validation before any process starts.

``parse_pretrain_args(argv)`` returns a validated ``PretrainArgs``; every bad combination raises
``ArgsError`` with one line naming the value and the rule, and ``main`` entry points print that
line and exit with status 2 before any process group exists. The defaults are the built-in
demo: a small MoE GPT on CPU with pp = 2, vpp = 2, ep = 2 and the overlap on, in 4 processes.
The rules themselves are in ``arg_checks``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, NoReturn, Sequence

from megapipe.train.flags import build_parser

if TYPE_CHECKING:  # the model and process-group modules import torch; the CLI stays light
    from megapipe.models.config import GPTConfig
    from megapipe.moe.link import EmulatedLink
    from megapipe.parallel.config import ParallelConfig
    from megapipe.schedule import Schedule


class ArgsError(ValueError):
    """A flag (or combination of flags) that cannot run; the message is one line."""


@dataclass(frozen=True)
class PretrainArgs:
    """Every pretrain flag, validated; ``world_size``, ``dp`` and ``num_microbatches`` derived."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    train_iters: int
    lr: float
    min_lr: float
    lr_warmup_iters: int
    lr_decay_iters: int | None
    lr_decay_style: str
    weight_decay: float
    clip_grad: float
    seed: int
    num_experts: int
    moe_router_topk: int
    moe_ffn_hidden_size: int
    moe_shared_expert_intermediate_size: int | None
    moe_layer_freq: str
    moe_aux_loss_coeff: float
    moe_router_dtype: str | None
    moe_expert_capacity_factor: float | None
    moe_pad_expert_input_to_capacity: bool
    bf16: bool
    fp16: bool
    deterministic_mode: bool
    high_priority_stream_groups: tuple[str, ...]
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None
    expert_model_parallel_size: int
    overlap_moe_expert_parallel_comm: bool
    overlap_max_extra_in_flight: int | None
    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int | None
    recompute_modules: tuple[str, ...] | None
    delay_wgrad_compute: bool
    moe_a2a_chunks: int
    overlap_grad_reduce: bool
    use_distributed_optimizer: bool
    overlap_param_gather: bool
    ddp_bucket_size: int | None
    dp_emulated_link_gbps: float | None
    pipeline_schedule: str | None
    save: str | None
    load: str | None
    save_interval: int | None
    eval_interval: int
    eval_iters: int
    log_interval: int
    data_path: tuple[str, ...]
    tensorboard_dir: str | None
    log_activation_memory: bool
    nproc: int | None
    moe_emulated_link_gbps: float | None
    moe_emulated_link_latency_us: float
    keep_last: int | None
    exit_signal_handler: bool
    exit_interval: int | None
    exit_duration_in_mins: float | None
    distributed_timeout_minutes: float
    profile_trace: str | None
    profile_step_start: int
    profile_step_end: int | None
    use_pytorch_profiler: bool
    world_size: int

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def vpp(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def dp(self) -> int:
        return self.world_size // self.pp

    @property
    def flat_grad_buffers(self) -> bool:
        """Whether gradients live in bucketed flat buffers (``train.grad_buffers``)."""
        return self.overlap_grad_reduce or self.use_distributed_optimizer

    @property
    def bucket_size(self) -> int | None:
        """Elements per gradient bucket: the flag, else Megatron's max(40M, 1M x dp); None (one
        bucket per stage) without ``--overlap-grad-reduce``."""
        if not self.overlap_grad_reduce:
            return None
        return self.ddp_bucket_size or max(40_000_000, 1_000_000 * self.dp)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def schedule_name(self) -> str:
        """The schedule to run: the flag, or interleaved-1f1b (vpp > 1) / 1f1b (otherwise)."""
        if self.pipeline_schedule:
            return self.pipeline_schedule
        return "interleaved-1f1b" if self.vpp > 1 else "1f1b"

    @property
    def parallel(self) -> "ParallelConfig":
        from megapipe.parallel.config import ParallelConfig

        return ParallelConfig(pp=self.pp, dp=self.dp, ep=self.ep)

    def gpt_config(self) -> "GPTConfig":
        from megapipe.models.config import GPTConfig

        first_dense, freq = parse_moe_layer_freq(self.moe_layer_freq, self.num_layers)
        full = self.recompute_granularity == "full"
        return GPTConfig(
            vocab_size=256,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_attention_heads,
            seq_length=self.seq_length,
            ffn_hidden_size=self.ffn_hidden_size,
            num_experts=self.num_experts,
            moe_top_k=self.moe_router_topk,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            first_k_dense_layers=first_dense,
            moe_layer_freq=freq,
            moe_aux_loss_coeff=self.moe_aux_loss_coeff,
            moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size,
            moe_link=self.emulated_link(),
            moe_capacity_factor=self.moe_expert_capacity_factor,
            moe_router_dtype=self.moe_router_dtype,
            recompute_modules=self.selective_recompute_modules,
            recompute_method=self.recompute_method if full else None,
            recompute_num_layers=(self.recompute_num_layers or 1) if full else 1,
            seed=self.seed,
        )

    @property
    def selective_recompute_modules(self) -> tuple[str, ...]:
        """The modules that recompute (selective granularity; Megatron's default core_attn)."""
        if self.recompute_granularity != "selective":
            return ()
        return ("core_attn",) if self.recompute_modules is None else self.recompute_modules

    def build_schedule(self) -> "Schedule":
        """The pipeline schedule these flags ask for (``config.ScheduleConfig``)."""
        from megapipe.train.config import job_config

        return job_config(self).schedule.build()

    def emulated_link(self) -> "EmulatedLink | None":
        """The emulated all-to-all interconnect (CPU overlap studies), or None when off."""
        if self.moe_emulated_link_gbps is None:
            return None
        from megapipe.moe.link import EmulatedLink

        return EmulatedLink(self.moe_emulated_link_gbps * 1e9,
                            self.moe_emulated_link_latency_us * 1e-6)

    def dp_link(self) -> "EmulatedLink | None":
        """The emulated data-parallel interconnect (CPU overlap studies), or None when off."""
        if self.dp_emulated_link_gbps is None:
            return None
        from megapipe.moe.link import EmulatedLink

        return EmulatedLink(self.dp_emulated_link_gbps * 1e9)

    def replace(self, **changes: object) -> "PretrainArgs":
        return dataclasses.replace(self, **changes)


def parse_moe_layer_freq(value: str, num_layers: int) -> tuple[int, int]:
    """Megatron's --moe-layer-freq as (first_k_dense_layers, moe_layer_freq).

    An int N means layers 0, N, 2N, ... are MoE. A pattern ``[0,1,1,1]`` (one entry per layer,
    or ``([0]*1+[1]*3)``) must be dense layers first, then MoE every N layers.
    """
    text = value.strip()
    if re.fullmatch(r"\d+", text):
        freq = int(text)
        if freq < 1:
            raise ArgsError(f"--moe-layer-freq={value} must be >= 1")
        return 0, freq
    pattern = _expand_pattern(text)
    if pattern is None or len(pattern) != num_layers:
        raise ArgsError(
            f"--moe-layer-freq={value!r} must be an int or a 0/1 list with one entry per layer "
            f"(num_layers={num_layers})"
        )
    first = pattern.index(1) if 1 in pattern else num_layers
    moe = [i - first for i, v in enumerate(pattern) if v == 1]
    freq = moe[1] - moe[0] if len(moe) > 1 else 1
    rebuilt = [1 if i >= first and (i - first) % freq == 0 else 0 for i in range(num_layers)]
    if rebuilt != pattern:
        raise ArgsError(
            f"--moe-layer-freq={value!r}: only 'dense layers first, then MoE every N layers' "
            "patterns are supported"
        )
    return first, freq


def _expand_pattern(text: str) -> list[int] | None:
    """'[0,1,1]' or '([0]*1+[1]*3)' -> list of 0/1; None if it is neither form."""
    text = text.replace(" ", "")
    if re.fullmatch(r"\[[01](,[01])*\]", text):
        return [int(v) for v in text[1:-1].split(",")]
    inner = text[1:-1] if text.startswith("(") and text.endswith(")") else text
    terms = inner.split("+")
    out: list[int] = []
    for term in terms:
        match = re.fullmatch(r"\[([01])\]\*(\d+)", term)
        if match is None:
            return None
        out.extend([int(match.group(1))] * int(match.group(2)))
    return out


def parse_pretrain_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> PretrainArgs:
    """Parse and validate; raises ArgsError (one line) for anything that cannot run."""
    parser = build_parser()

    def fail(message: str) -> NoReturn:  # argparse's usage block becomes one line
        raise ArgsError(message)

    parser.error = fail  # type: ignore[method-assign]
    return args_from_namespace(parser.parse_args(argv), env)


def args_from_namespace(
    ns: argparse.Namespace, env: Mapping[str, str] | None = None
) -> PretrainArgs:
    """Validated PretrainArgs from a parsed namespace (extra attributes are ignored)."""
    names = {f.name for f in dataclasses.fields(PretrainArgs)} - {"world_size"}
    values = {k: v for k, v in vars(ns).items() if k in names}
    values["data_path"] = tuple(values["data_path"])
    values["high_priority_stream_groups"] = tuple(values["high_priority_stream_groups"])
    if values["recompute_modules"] is not None:
        values["recompute_modules"] = tuple(values["recompute_modules"])
    from megapipe.parallel.launch import launched_world_size  # torch: only when flags are run

    launched = launched_world_size(env)
    pp, ep = values["pipeline_model_parallel_size"], values["expert_model_parallel_size"]
    if launched is not None:
        world = launched
    elif values["nproc"] is not None:
        world = values["nproc"]
    else:
        world = max(pp, 1) * max(ep, 1)
    args = PretrainArgs(**values, world_size=world)
    from megapipe.train.arg_checks import validate  # the rules need PretrainArgs defined first

    validate(args)
    return args
