"""Config dataclasses to argparse flags: the one flag generator of every command line.

A field declares its flag with `option(...)` (help text, group, choices); the
flag's type and its shown default come from the field itself, so `--help`
cannot drift from the config. Imports neither torch nor ray: `preprocess` uses it too.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import MISSING, fields
from typing import Any, NoReturn, Union, get_args, get_origin, get_type_hints


def about(
    text: str,
    choices: Sequence[str] | None = None,
    *,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
) -> dict[str, Any]:
    """The flag metadata of one field: help text, allowed values, a parser for the text."""
    return {
        "help": text,
        "choices": tuple(choices) if choices else None,
        "parse": parse,
        "metavar": metavar,
    }


def option(
    default: Any = MISSING,
    text: str = "",
    group: str = "options",
    choices: Sequence[str] | None = None,
    *,
    default_factory: Any = MISSING,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    positional: bool = False,
    exclusive: str | None = None,
    nested: Mapping[str, dict[str, Any]] | None = None,
) -> Any:
    """A dataclass field with the metadata the flag generator reads.

    Args:
        default: the field's default; none makes the flag required.
        text: what the flag does (a field without help text is refused).
        group: the `--help` section it is listed under.
        choices: the values allowed.
        parse: turns the command-line text into the value (default: the field's type).
        positional: an argument without `--`.
        exclusive: flags sharing this name cannot be given together.
        nested: for a field that holds a dataclass, `{sub-field: about(...)}`: the
            sub-fields that get flags of their own (named without a prefix).
    """
    meta = about(text, choices, parse=parse, metavar=metavar)
    meta.update(group=group, positional=positional, exclusive=exclusive, nested=nested)
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def flag_name(name: str) -> str:
    """`shard_size` -> `shard-size`."""
    return name.replace("_", "-")


def unwrap_optional(kind: Any) -> tuple[Any, bool]:
    """`int | None` -> `(int, True)`; other types -> `(type, False)`."""
    if get_origin(kind) in (Union, types.UnionType):
        args = [a for a in get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return kind, False


def parse_int_list(text: str) -> tuple[int, ...]:
    """`"8,16,32"` -> `(8, 16, 32)`."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from exc


def parse_str_list(text: str) -> tuple[str, ...]:
    """`"tar, parquet"` -> `("tar", "parquet")`."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


class OptionalType:
    """argparse `type=` for `X | None` fields: `none` (any case) means None."""

    def __init__(self, base: Callable[[str], Any]) -> None:
        self.base = base
        self.__name__ = getattr(base, "__name__", "value")

    def __call__(self, text: str) -> Any:
        return None if text.lower() in ("none", "") else self.base(text)


def default_values(cls: type) -> dict[str, Any]:
    """`{field: default}` of a config dataclass (fields without a default left out)."""
    out = {}
    for f in fields(cls):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


def show_default(value: Any) -> str:
    """A default as a user would type it (`tar,parquet`, not `('tar', 'parquet')`)."""
    if isinstance(value, tuple):
        value = ",".join(str(item) for item in value)
    return str(value).replace("%", "%%")  # argparse %-formats help strings


def flag_help(name: str, text: str, default: Any = MISSING) -> str:
    """The help of one flag, ending in its default (a field without help text is a bug)."""
    if not text.strip():
        raise TypeError(f"{name} has no help text: every flag must say what it does")
    text = text.replace("%", "%%")  # argparse %-formats help strings: "2% larger" stays so
    if "default:" in text or default is MISSING:
        return text  # says in words what the default is (None would tell nothing)
    return f"{text} (default: {show_default(default)})"


def flag_specs(cls: type) -> Iterator[tuple[str, Any, dict[str, Any], str]]:
    """`(dest, type, metadata, group)` of every flag of `cls`, nested fields expanded."""
    hints = get_type_hints(cls)
    for f in fields(cls):
        if "help" not in f.metadata:
            raise TypeError(
                f"{cls.__name__}.{f.name} has no option(...) metadata: no flag, no help"
            )
        nested = f.metadata["nested"]
        if nested is None:
            yield f.name, hints[f.name], dict(f.metadata), f.metadata["group"]
            continue
        sub_hints = get_type_hints(hints[f.name])
        for name, meta in nested.items():
            yield name, sub_hints[name], {**meta, "positional": False}, f.metadata["group"]


def add_config_flags(
    parser: argparse.ArgumentParser, cls: type, defaults: Mapping[str, Any] | None = None
) -> None:
    """One flag per field of the config dataclass `cls`, grouped as its metadata says.

    Args:
        defaults: `{field: value}` shown and used as defaults (default: the dataclass's);
            a nested field's flags take theirs from the nested default.
    """
    values = flat_defaults(cls, default_values(cls) if defaults is None else defaults)
    groups: dict[str, Any] = {}
    exclusive: dict[str, Any] = {}
    seen: set[str] = set()
    for dest, kind, meta, group in flag_specs(cls):
        if dest in seen:
            raise TypeError(f"{cls.__name__}: two flags named --{flag_name(dest)}")
        seen.add(dest)
        if group not in groups:
            groups[group] = parser.add_argument_group(f"{group} options")
        target = groups[group]
        if meta.get("exclusive"):
            name = meta["exclusive"]
            if name not in exclusive:
                exclusive[name] = target.add_mutually_exclusive_group()
            target = exclusive[name]
        add_flag(target, dest, kind, meta, values)


def add_flag(
    container: Any, dest: str, kind: Any, meta: dict[str, Any], values: Mapping[str, Any]
) -> None:
    """One `add_argument` call: type, choices, default and help from the field."""
    base, optional = unwrap_optional(kind)
    kwargs: dict[str, Any] = {"help": flag_help(dest, meta["help"], values.get(dest, MISSING))}
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        parse = meta.get("parse")
        if parse is None:
            parse = {tuple[int, ...]: parse_int_list, tuple[str, ...]: parse_str_list}.get(
                base, base
            )
        kwargs["type"] = OptionalType(parse) if optional else parse
    if meta.get("choices"):
        kwargs["choices"] = meta["choices"]
    if meta.get("metavar"):
        kwargs["metavar"] = meta["metavar"]
    if meta.get("positional"):
        if dest in values:
            kwargs.update(nargs="?", default=values[dest])
        container.add_argument(dest, **kwargs)
        return
    if dest in values:
        kwargs["default"] = values[dest]
    else:
        kwargs["required"] = True
    container.add_argument(f"--{flag_name(dest)}", dest=dest, **kwargs)


def flat_defaults(cls: type, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults keyed by flag dest: a nested field's default object spread into its sub-fields."""
    out = dict(defaults)
    for f in fields(cls):
        nested = f.metadata.get("nested")
        if nested is not None and f.name in defaults:
            inner = defaults[f.name]
            for name in nested:
                out.setdefault(name, getattr(inner, name))
    return out


def config_from_args(cls: type, namespace: argparse.Namespace) -> Any:
    """The config `cls` from parsed flags (nested dataclasses built from their own flags).

    Raises:
        ValueError: from the config's own checks (`__post_init__`).
    """
    hints = get_type_hints(cls)
    values = {}
    for f in fields(cls):
        nested = f.metadata["nested"]
        if nested is None:
            values[f.name] = getattr(namespace, f.name)
        else:
            values[f.name] = hints[f.name](**{name: getattr(namespace, name) for name in nested})
    return cls(**values)


def package_version() -> str:
    """The installed shardpipe version, for `--version`."""
    try:
        return importlib.metadata.version("shardpipe")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """`--version`: prints `shardpipe X.Y.Z` and exits 0."""
    parser.add_argument(
        "--version",
        action="version",
        version=f"shardpipe {package_version()}",
        help="print the shardpipe version and exit",
    )


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter with room for subcommand and flag names before their help."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30)


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (exit 2); the full usage is long."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: its options dataclass (flags made by `add_config_flags`) and its runner.

    Attributes:
        run: `run(options, args) -> exit code`; `args` is read only for `switches`.
        switches: extra `(flag, help)` on/off flags that are not options of the config.
    """

    name: str
    summary: str
    options: type
    run: Callable[[Any, argparse.Namespace], int]
    switches: tuple[tuple[str, str], ...] = ()


def build_command_parser(
    prog: str, description: str, epilog: str, commands: Sequence[Command]
) -> CommandParser:
    """A `PROG COMMAND [flags]` parser with `--version`, one subparser per command."""
    parser = CommandParser(prog=prog, description=description, epilog=epilog)
    add_version_flag(parser)
    # dest: what a missing command is called in the one-line error.
    subparsers = parser.add_subparsers(required=True, title="commands", dest="COMMAND")
    for command in commands:
        sub = subparsers.add_parser(command.name, help=command.summary, description=command.summary)
        add_config_flags(sub, command.options)
        for flag, text in command.switches:
            sub.add_argument(flag, action="store_true", help=text)
        sub.set_defaults(command=command, parser=sub)
    return parser


def exit_quietly_on_closed_pipe() -> int:
    """For `except BrokenPipeError`: `CMD | head` closed our stdout; exit as a pipe's writer does.

    stdout is pointed at /dev/null so the interpreter's final flush does not fail again.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by the pipe


def run_command(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    interrupted: str = "interrupted",
    setup: Callable[[], None] | None = None,
) -> int:
    """A CLI's `main`: parse, run the command, and end the two ways a user ends one.

    Ctrl-C prints `interrupted` and exits 130; a closed pipe (`CMD | head`) exits quietly.
    """
    command, options, args = parse_command(parser, argv)
    if setup is not None:
        setup()
    try:
        return command.run(options, args)
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130
    except BrokenPipeError:
        return exit_quietly_on_closed_pipe()


def parse_command(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> tuple[Command, Any, argparse.Namespace]:
    """`(command, options, args)`; a value the options refuse is a usage error (exit 2)."""
    args = parser.parse_args(argv)
    try:
        options = config_from_args(args.command.options, args)
    except ValueError as error:
        args.parser.error(str(error))
    return args.command, options, args
