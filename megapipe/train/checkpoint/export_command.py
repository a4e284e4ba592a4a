"""The ``megapipe export-hf`` subcommand (``EXPORT_HF``): its flags, their checks, and the call
into ``export_hf`` (imported when it runs, so building the CLI's parser stays torch-free)."""

from __future__ import annotations

import argparse

from megapipe.subcommand import Subcommand, at_least, check_values

FAMILIES = "Qwen3-MoE, Mixtral or OLMoE"  # hf.architectures' families, without importing torch
DEFAULT_SHARD_MB = 5120


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--load",
        required=True,
        metavar="CKPT",
        help="a --save folder (its newest complete checkpoint) or one iter_NNNNNNN",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) directory")
    p.add_argument(
        "--tokenizer-model",
        default=None,
        metavar="PATH",
        help="a Hugging Face tokenizer.json (or its directory) instead of the one "
        "the checkpoint names",
    )
    p.add_argument(
        "--max-shard-size-mb",
        type=int,
        default=DEFAULT_SHARD_MB,
        metavar="MB",
        help=f"largest safetensors file in MiB (default {DEFAULT_SHARD_MB})",
    )


def _check(args: argparse.Namespace) -> argparse.Namespace:
    check_values(args, {"--max-shard-size-mb": (at_least(1),)})
    return args


def run_export_command(args: argparse.Namespace) -> int:
    """``megapipe export-hf``: ``export_hf.export_hf``, its lines printed."""
    from megapipe.train.checkpoint.export_hf import export_hf

    for line in export_hf(
        args.load, args.out, args.tokenizer_model, args.max_shard_size_mb * 2**20
    ):
        print(line)
    return 0


EXPORT_HF = Subcommand(
    "export-hf",
    f"write a checkpoint as a Hugging Face model ({FAMILIES})",
    f"Write a megapipe checkpoint (any pp, vpp, ep, dp) as a Hugging Face {FAMILIES} directory "
    "(the family with the model's attention and router): config.json, safetensors, tokenizer "
    "files.",
    _arguments,
    _check,
    run_export_command,
)
