"""A subcommand of the ``megapipe`` command, declared one way, and the checks of its arguments.

A ``Subcommand`` is a name, its ``--help`` lines, ``arguments(parser)`` (argparse's
``add_argument`` with plain types: ``int``, ``float``, ``str``), ``check(args)`` and
``run(checked)``. ``check`` takes the parsed namespace and returns what ``run`` takes (the
namespace itself, or a config made from it), or raises ``ArgsError``: one line naming the value
and the rule. A value's own rules are ``Check`` functions, ``(flag, value) -> message or None``
(``at_least``, ``above``, ``finite``, ``one_of``, ``writable_file``), applied by
``check_values``; the pretrain flags use the same checks in their declarations
(``train.config.declare``). ``cli.py`` registers every subcommand and prints an ``ArgsError``
as ``megapipe: error: ...`` with exit status 2, before anything runs. This module imports
nothing of megapipe, so every room can declare its subcommands.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Check = Callable[[str, Any], "str | None"]


class ArgsError(ValueError):
    """An argument (or a combination of arguments) that cannot run; the message is one line."""


@dataclass(frozen=True)
class Subcommand:
    """One ``megapipe`` subcommand (module docstring)."""

    name: str
    help: str
    description: str
    arguments: Callable[[argparse.ArgumentParser], None]
    check: Callable[[argparse.Namespace], Any]
    run: Callable[[Any], int]


def check_values(args: argparse.Namespace, checks: Mapping[str, tuple[Check, ...]]) -> None:
    """Each ``--flag``'s checks on its value in ``args`` (None: not given, nothing to check);
    the first refusal raises ``ArgsError``."""
    for flag, flag_checks in checks.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        for check in flag_checks if value is not None else ():
            message = check(flag, value)
            if message:
                raise ArgsError(message)


def at_least(low: float, fmt: str = "") -> Check:
    """``--x=V must be >= low`` (``fmt``: how V is written, e.g. ``g``)."""
    return lambda name, value: None if value >= low else f"{name}={value:{fmt}} must be >= {low}"


def above(low: float, fmt: str = "") -> Check:
    """``--x=V must be > low``."""
    return lambda name, value: None if value > low else f"{name}={value:{fmt}} must be > {low}"


def finite(name: str, value: float) -> str | None:
    """``--x=nan must be a finite number`` (NaN and infinities)."""
    return None if math.isfinite(value) else f"{name}={value} must be a finite number"


def one_of(*choices: str) -> Check:
    """``--x='v' must be one of a, b, c`` (two choices: ``must be a or b``)."""
    words = " or ".join(choices) if len(choices) == 2 else "one of " + ", ".join(choices)
    return lambda name, value: None if value in choices else f"{name}={value!r} must be {words}"


def writable_file(name: str, path: str) -> str | None:
    """``path`` can be created as a file: its folder exists and is writable, it is no
    directory."""
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        return f"{name} {path}: folder {folder!r} does not exist"
    if os.path.isdir(path):
        return f"{name} {path} is a directory; name a file to write"
    if not os.access(folder, os.W_OK):
        return f"{name} {path}: folder {folder!r} is not writable"
    return None
