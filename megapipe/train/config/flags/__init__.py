"""Every pretrain flag, declared once (``declare.flag``): Megatron's names, the demo's defaults.

The flags are declared by group, as Megatron groups its arguments, one record per ``--help``
group, in the modules named for what they hold: ``model``, ``data``, ``training``,
``parallelism``, ``inputs_outputs``, ``performance``. ``PretrainFlags`` gathers the groups into
the one parsed record. Each flag's own checks live in its declaration (those longer than a
range: ``flag_checks``), the rules between flags in ``checks``, and ``build.job_config`` turns
the record into the typed parts the app reads, checking each as it builds it. Adding a flag:
docs/pretraining.md.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from megapipe.train.config.declare import build_parser as parser_of
from megapipe.train.config.flags.data import DataFlags
from megapipe.train.config.flags.inputs_outputs import FailureFlags, InputOutputFlags
from megapipe.train.config.flags.model import ArchitectureFlags, ModelFlags
from megapipe.train.config.flags.parallelism import DataParallelFlags, ParallelFlags
from megapipe.train.config.flags.performance import GraphFlags, ProfilingFlags
from megapipe.train.config.flags.training import PrecisionFlags, RecomputeFlags, TrainingFlags

DESCRIPTION = (
    "Pretrain an MoE GPT with pipeline x expert x data parallelism. With no flags: a "
    "small model on CPU, pp=2 vpp=2 ep=2, overlap on, 4 processes."
)


# A dataclass takes its bases' fields from the last base to the first: the groups are listed
# in reverse, so that the model's flags come first, in the record and in --help.
@dataclass(frozen=True)
class PretrainFlags(
    ProfilingFlags,
    GraphFlags,
    FailureFlags,
    InputOutputFlags,
    RecomputeFlags,
    DataParallelFlags,
    ParallelFlags,
    TrainingFlags,
    PrecisionFlags,
    DataFlags,
    ArchitectureFlags,
    ModelFlags,
):
    """Every ``megapipe pretrain`` flag, parsed and checked one by one (module docstring)."""

    RENAMED: ClassVar[dict[str, str]] = {"--moe-a2a-chunks": "--moe-a2a-waves"}


def build_parser(prog: str = "megapipe pretrain", add_help: bool = True) -> argparse.ArgumentParser:
    """The argparse parser of ``PretrainFlags`` (``add_help=False``: a parent parser for
    ``megapipe pretrain``'s subcommand)."""
    return parser_of(PretrainFlags, prog, DESCRIPTION, add_help)
