"""From the command line to the typed config, refusing bad input before any process starts.

``parse_pretrain_args(argv)`` parses the declared flags (``flags``: each flag's own checks),
checks the rules between them (``checks``) and returns the ``JobConfig`` the app reads
(``job_config``). Anything that cannot run raises ``ArgsError`` with one line naming the value and
the rule; ``main`` prints it and exits with status 2 before any process group exists.
"""

from __future__ import annotations

import argparse
from typing import Mapping, Sequence

from megapipe.train.config.checks import validate
from megapipe.train.config.declare import ArgsError, parse_flags, record_of
from megapipe.train.config.flags import DESCRIPTION, PretrainFlags
from megapipe.train.config.job_config import JobConfig, job_config, world_size_of

__all__ = ["ArgsError", "args_from_namespace", "checked_config", "parse_pretrain_args"]


def parse_pretrain_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> JobConfig:
    """Parse and check; ArgsError (one line) for anything that cannot run."""
    flags = parse_flags(PretrainFlags, argv, "megapipe pretrain", DESCRIPTION)
    return checked_config(flags, env)


def args_from_namespace(ns: argparse.Namespace, env: Mapping[str, str] | None = None) -> JobConfig:
    """The checked config of a namespace ``flags.build_parser`` parsed (extra attributes are
    ignored)."""
    return checked_config(record_of(PretrainFlags, ns), env)


def checked_config(flags: PretrainFlags, env: Mapping[str, str] | None = None) -> JobConfig:
    """The rules between flags, then the typed parts, for the launcher's (or the flags') world."""
    world_size = world_size_of(flags, env)
    validate(flags, world_size)
    return job_config(flags, world_size)
