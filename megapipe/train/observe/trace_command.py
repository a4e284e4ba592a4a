"""The ``megapipe trace`` subcommand (``TRACE``): ``trace summarize FILE`` prints the figures of
a profile trace that ``pretrain --profile-trace`` wrote (``trace_summary``, imported when it
runs, so building the CLI's parser stays torch-free)."""

from __future__ import annotations

import argparse
import os

from megapipe.subcommand import ArgsError, Subcommand


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=("summarize",),
        help="summarize: per rank, exposed all-to-all, largest bubbles; measured vs simulated",
    )
    p.add_argument("file", help="the trace (JSON) --profile-trace wrote")


def _check(args: argparse.Namespace) -> argparse.Namespace:
    if not os.path.isfile(args.file):
        raise ArgsError(f"trace {args.action} {args.file}: no such file")
    return args


def run_trace_summarize(args: argparse.Namespace) -> int:
    """``megapipe trace summarize FILE``: print the trace's figures
    (``train.observe.trace_summary``)."""
    from megapipe.train.observe.trace_summary import summarize_file

    print(summarize_file(args.file))
    return 0


TRACE = Subcommand(
    "trace",
    "read a profile trace of a run (megapipe pretrain --profile-trace)",
    "Read a profile trace written by megapipe pretrain --profile-trace.",
    _arguments,
    _check,
    run_trace_summarize,
)
