"""Command-line flags generated from config dataclasses, whose fields declare their own flag."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

GiB = 1 << 30
MiB = 1 << 20

FLAG = "flag"  # field metadata key: the field's Flag
GROUP = "flag_group"  # field metadata key on a nested config: its help section's title


@dataclass(frozen=True)
class Unit:
    """A flag given in a friendlier unit than its field (GiB for bytes, ms for seconds)."""

    to_field: Callable[[float], Any]
    from_field: Callable[[Any], float]


GIB = Unit(lambda gb: int(gb * GiB), lambda size: size / GiB)
MIB = Unit(lambda mb: int(mb * MiB), lambda size: size / MiB)
MS = Unit(lambda ms: ms / 1e3, lambda seconds: seconds * 1e3)


@dataclass(frozen=True)
class Flag:
    name: str  # "--kv-cache-gb"; a bool field defaulting to True takes "--no-..."
    help: str | None = None
    unit: Unit | None = None
    group: str | None = None  # its own help section instead of the enclosing config's

    @property
    def dest(self) -> str:
        # A "--no-x" flag stores x (False when given), as argparse users expect.
        return self.name.removeprefix("--").removeprefix("no-").replace("-", "_")

    def to_field(self, value: Any) -> Any:
        return value if value is None or self.unit is None else self.unit.to_field(value)

    def from_field(self, value: Any) -> Any:
        return value if value is None or self.unit is None else self.unit.from_field(value)


def flag(
    default: Any, name: str, help: str | None = None, *, unit: Unit | None = None,
    group: str | None = None,
) -> Any:  # fmt: skip
    """A config field with its command-line flag: `seed: int = flag(0, "--engine-seed", ...)`."""
    return dataclasses.field(default=default, metadata={FLAG: Flag(name, help, unit, group)})


def section(title: str, config: type) -> Any:
    """A nested config field whose flags form one help section titled `title`."""
    return dataclasses.field(default_factory=config, metadata={GROUP: title})


def add_config_args(
    parser: argparse.ArgumentParser, config: type, choices: dict[str, list[str]] | None = None
) -> None:
    """Add a flag for every field of `config` (and its nested configs) that declares one;
    `choices` lists, by dest, the values of string flags whose names are registered outside
    shared/ (e.g. the scheduling policies), where a config cannot import them."""
    sections: dict[str, argparse._ArgumentGroup] = {}
    choices = choices or {}

    def visit(cls: type, title: str | None) -> None:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            hint = hints[field.name]
            if dataclasses.is_dataclass(hint):
                visit(hint, field.metadata.get(GROUP, title))
            elif FLAG in field.metadata:
                spec: Flag = field.metadata[FLAG]
                where = spec.group or title
                if where is None:
                    target = parser
                else:
                    if where not in sections:
                        sections[where] = parser.add_argument_group(where)
                    target = sections[where]
                options = _argparse_options(spec, hint, field.default)
                if spec.dest in choices:
                    options["choices"] = list(choices[spec.dest])
                target.add_argument(spec.name, **options)

    visit(config, None)


def config_from_args(config: type, args: argparse.Namespace) -> Any:
    """`config` built from the flags in `args`; fields without a flag keep their defaults."""
    hints = typing.get_type_hints(config)
    values = {}
    for field in dataclasses.fields(config):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            values[field.name] = config_from_args(hint, args)
        elif FLAG in field.metadata:
            spec: Flag = field.metadata[FLAG]
            values[field.name] = spec.to_field(getattr(args, spec.dest))
    return config(**values)


def config_argv(config: type, args: argparse.Namespace, **overrides: Any) -> list[str]:
    """The flags of `config` in `args` as a command line that parses back to the same values;
    `overrides` replace values by dest (e.g. model=...); flags at their None default are left
    out."""
    argv: list[str] = []
    for spec, _hint, _default in _flags(config):
        value = overrides.get(spec.dest, getattr(args, spec.dest))
        if isinstance(value, bool):
            if value != spec.name.startswith("--no-"):
                argv.append(spec.name)
        elif value is not None:
            argv += [spec.name, str(value)]
    return argv


def parsed_argv(
    parser: argparse.ArgumentParser, args: argparse.Namespace, skip: frozenset[str] = frozenset()
) -> list[str]:
    """The flags `parser` defines, at their values in `args`, as a command line that parses back
    to them (for flags declared straight on a parser; dests in `skip` are left out)."""
    argv: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in skip or action.dest == "help":
            continue
        value = getattr(args, action.dest)
        name = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            if value != action.default:
                argv.append(name)
        elif value is not None:
            argv += [name, str(value)]
    return argv


def config_from_dict(config: type, values: dict) -> Any:
    """`config` from the plain dict that dataclasses.asdict made of it (e.g. after JSON); nested
    configs missing from `values` keep their defaults."""
    hints = typing.get_type_hints(config)
    kwargs = dict(values)
    for field in dataclasses.fields(config):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint) and isinstance(kwargs.get(field.name), dict):
            kwargs[field.name] = config_from_dict(hint, kwargs[field.name])
    return config(**kwargs)


def _flags(config: type) -> list[tuple[Flag, Any, Any]]:
    """(flag, type hint, default) of every flagged field, nested configs included."""
    found = []
    hints = typing.get_type_hints(config)
    for field in dataclasses.fields(config):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            found += _flags(hint)
        elif FLAG in field.metadata:
            found.append((field.metadata[FLAG], hint, field.default))
    return found


def _argparse_options(spec: Flag, hint: Any, default: Any) -> dict:
    options: dict[str, Any] = {"help": spec.help, "dest": spec.dest}
    if hint is bool:
        negated = spec.name.startswith("--no-")
        if default is not negated:
            raise TypeError(
                f"{spec.name}: a bool flag turns on a False field or '--no-' a True one"
            )
        options["action"] = "store_false" if negated else "store_true"
        return options
    options["default"] = spec.from_field(default)
    base = _without_none(hint)
    if typing.get_origin(base) is Literal:
        options["choices"] = list(typing.get_args(base))
    elif spec.unit is not None:
        options["type"] = float
    elif base in (int, float):
        options["type"] = base
    return options


def _without_none(hint: Any) -> Any:
    """`int` for `int | None`; other hints unchanged."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint
