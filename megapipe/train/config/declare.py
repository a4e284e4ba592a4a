"""A flag declared once: one field of a frozen dataclass, the flag record.

``num_layers: int = flag(6, "transformer layers", at_least(1), group="model")`` declares
``--num-layers`` (the field's name in Megatron's spelling), its type (the annotation: ``int``,
``float``, ``str``, ``bool``, ``X | None``, ``tuple[X, ...]``), default, help, own checks, and
where needed argparse's ``choices``, ``nargs`` (a tuple's; default ``*``) and ``metavar``. A
``bool`` is a switch (with ``--no-...`` when it defaults to on). ``build_parser`` makes the
argparse parser of a record class, whose namespace also notes the flags the command line gave
(``given_flags``); ``parse_flags`` / ``record_of`` the record, after each flag's checks (a
check: ``(flag, value) -> message or None``, never given None; the vocabulary is
``megapipe.subcommand``'s, shared by every subcommand): the first refusal raises ``ArgsError``,
one line. Rules between flags live elsewhere (``checks``). A
record's ``RENAMED`` ({old flag: new flag}) refuses an old name, naming the new one.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any, NoReturn, TypeVar

from megapipe.subcommand import ArgsError, Check, above, at_least, finite, one_of

__all__ = [
    "COUNT",
    "POSITIVE",
    "ArgsError",
    "Check",
    "above",
    "add_flags",
    "at_least",
    "build_parser",
    "finite",
    "flag",
    "given_flags",
    "one_of",
    "parse_flags",
    "record_of",
]

R = TypeVar("R")
POSITIVE, COUNT = at_least(1), at_least(0)  # the two ranges most flags have


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """What ``flag`` keeps beside a field's default (module docstring)."""

    help: str
    checks: tuple[Check, ...]
    group: str | None
    choices: Sequence[str] | None
    nargs: str | None
    metavar: str | None


def flag(
    default: Any,
    help: str,
    *checks: Check,
    group: str | None = None,
    choices: Sequence[str] | None = None,
    nargs: str | None = None,
    metavar: str | None = None,
) -> Any:
    """Declare the flag of the field this is assigned to (module docstring)."""
    spec = FlagSpec(help, checks, group, choices, nargs, metavar)
    return dataclasses.field(default=default, metadata={"flag": spec})


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _base_type(hint: Any) -> tuple[type, bool]:
    """(the argparse type, whether the flag takes a list) of a field's annotation."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    return hint, False


def _specs(record: type) -> list[tuple[dataclasses.Field, FlagSpec, Any]]:
    hints = typing.get_type_hints(record)
    out = []
    for f in dataclasses.fields(record):
        if "flag" not in f.metadata:
            raise TypeError(f"{record.__name__}.{f.name} is not declared with flag(...)")
        out.append((f, f.metadata["flag"], hints[f.name]))
    return out


GIVEN = "_given_flags"  # the namespace attribute ``given_flags`` reads


def _note(namespace: argparse.Namespace, dest: str) -> None:
    setattr(namespace, GIVEN, getattr(namespace, GIVEN, frozenset()) | {dest})


class _Store(argparse.Action):
    """argparse's ``store``, noting the flag as given."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        setattr(namespace, self.dest, values)
        _note(namespace, self.dest)


class _Switch(argparse.Action):
    """argparse's ``store_true``, noting the flag as given."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        setattr(namespace, self.dest, True)
        _note(namespace, self.dest)


class _Boolean(argparse.BooleanOptionalAction):
    """``--x`` / ``--no-x``, noting the flag as given."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        super().__call__(parser, namespace, values, option_string)
        _note(namespace, self.dest)


def given_flags(ns: argparse.Namespace) -> frozenset[str]:
    """The fields whose flags the command line gave (a ``build_parser`` parser's namespace)."""
    return getattr(ns, GIVEN, frozenset())


def build_parser(
    record: type, prog: str, description: str, add_help: bool = True
) -> argparse.ArgumentParser:
    """The argparse parser of every flag ``record`` declares, in ``--help`` groups."""
    parser = argparse.ArgumentParser(prog=prog, add_help=add_help, description=description)
    add_flags(parser, record)
    return parser


def add_flags(parser: argparse.ArgumentParser, record: type) -> None:
    """Add every flag ``record`` declares to ``parser``, in ``--help`` groups."""
    groups: dict[str | None, Any] = {None: parser}
    for f, spec, hint in _specs(record):
        if spec.group not in groups:
            groups[spec.group] = parser.add_argument_group(spec.group)
        base, many = _base_type(hint)
        kwargs: dict[str, Any] = {"default": f.default, "help": spec.help}
        if base is bool:
            kwargs["action"] = _Boolean if f.default else _Switch
        else:
            kwargs.update(action=_Store, type=base, nargs=(spec.nargs or "*") if many else None)
        kwargs.update(
            {
                key: value
                for key, value in (("choices", spec.choices), ("metavar", spec.metavar))
                if value
            }
        )
        groups[spec.group].add_argument(flag_name(f.name), **kwargs)
    for old, new in getattr(record, "RENAMED", {}).items():
        parser.add_argument(old, action=_Renamed, nargs="*", help=argparse.SUPPRESS, new=new)


class _Renamed(argparse.Action):
    """An old flag name: refused, naming the new one (argparse's error, one line)."""

    def __init__(self, *args: Any, new: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None) -> NoReturn:  # noqa: ANN001
        raise argparse.ArgumentError(self, f"renamed: use {self.new}")


def record_of(record: type[R], ns: argparse.Namespace) -> R:
    """The checked record of a parsed namespace (extra attributes are ignored)."""
    values = {}
    for f, spec, _ in _specs(record):
        value = getattr(ns, f.name)
        values[f.name] = tuple(value) if isinstance(value, list) else value
        for check in spec.checks if value is not None else ():
            message = check(flag_name(f.name), values[f.name])
            if message:
                raise ArgsError(message)
    return record(**values)


def parse_namespace(
    record: type, argv: Sequence[str] | None, prog: str, description: str = ""
) -> argparse.Namespace:
    """Parse ``argv`` with ``build_parser``'s parser; ArgsError (one line) for a bad flag."""
    parser = build_parser(record, prog, description)

    def fail(message: str) -> NoReturn:  # argparse's usage block becomes one line
        raise ArgsError(message)

    parser.error = fail  # type: ignore[method-assign]  # one instance's error hook, on purpose
    return parser.parse_args(argv)


def parse_flags(record: type[R], argv: Sequence[str] | None, prog: str, description: str = "") -> R:
    """Parse ``argv`` into a checked record; ArgsError (one line) for a bad flag."""
    return record_of(record, parse_namespace(record, argv, prog, description))
