"""From the command line to the typed config, refusing bad input before any process starts.

``parse_pretrain_args(argv)`` parses the declared flags (``flags``: each flag's own checks),
takes the model flags not given from ``--load-hf``'s ``config.json`` (``from_hf``), then checks
and builds, in one pass, the ``JobConfig`` the app reads (``build``).
Anything that cannot run raises ``ArgsError`` with one line naming the value and the rule;
``main`` prints it and exits with status 2 before any process group exists.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from megapipe.train.config.build import job_config, world_size_of
from megapipe.train.config.declare import ArgsError, given_flags, parse_namespace, record_of
from megapipe.train.config.flags import DESCRIPTION, PretrainFlags
from megapipe.train.config.from_hf import flags_from_hf
from megapipe.train.config.job_config import JobConfig

__all__ = ["ArgsError", "args_from_namespace", "checked_config", "parse_pretrain_args"]


def parse_pretrain_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> JobConfig:
    """Parse and check; ArgsError (one line) for anything that cannot run."""
    ns = parse_namespace(PretrainFlags, argv, "megapipe pretrain", DESCRIPTION)
    return args_from_namespace(ns, env)


def args_from_namespace(ns: argparse.Namespace, env: Mapping[str, str] | None = None) -> JobConfig:
    """The checked config of a namespace ``flags.build_parser`` parsed (extra attributes are
    ignored)."""
    return checked_config(record_of(PretrainFlags, ns), env, given_flags(ns))


def checked_config(
    flags: PretrainFlags, env: Mapping[str, str] | None = None, given: frozenset[str] | None = None
) -> JobConfig:
    """The checked typed parts, for the launcher's (or the flags') world. With ``--load-hf``,
    the model flags not ``given`` (None: all were) and the vocabulary are its model's."""
    vocab_size = None
    if flags.load_hf is not None:
        flags, hf_model = flags_from_hf(flags, given)
        vocab_size = hf_model.vocab_size
    return job_config(flags, world_size_of(flags, env), vocab_size)
