"""Config dataclasses to argparse flags: the one flag generator of every command line.

A field declares its flag with `option(...)` (help text, group, choices); the
flag's type and its shown default come from the field itself, so `--help`
cannot drift from the config. Imports neither torch nor ray: `preprocess` uses it too.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.metadata
import json
import logging
import os
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import MISSING, fields
from typing import Any, NoReturn, Union, get_args, get_origin, get_type_hints

from shards.errors import ShardpipeError, UsageError
from shards.redact import redact_url
from shards.units import SIZE_RULE, ByteSize, ByteSizeError


def about(
    text: str,
    choices: Sequence[str] | None = None,
    *,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    bare: Any = None,
    spellings: Mapping[str, Callable[[Any], Any]] | None = None,
) -> dict[str, Any]:
    """The flag metadata of one field: help text, allowed values, a parser for the text.

    Args:
        bare: the value of the flag given without one (a choice that replaced an on/off
            switch of the same name keeps the switch's bare form working).
        spellings: older flags that still work, hidden from `--help`:
            `{"--no-old-switch": update}`, where `update(value so far)` is the value after it.
    """
    return {
        "help": text,
        "choices": tuple(choices) if choices else None,
        "parse": parse,
        "metavar": metavar,
        "bare": bare,
        "spellings": spellings,
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
    flag: str | None = None,
    cli: bool = True,
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
        flag: the flag's name when it is not the field's (with its group's prefix).
        cli: False for a setting given only in Python (a callable, a credentials dict).
    """
    meta = about(text, choices, parse=parse, metavar=metavar)
    meta.update(
        group=group, positional=positional, exclusive=exclusive, nested=nested, flag=flag, cli=cli
    )
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def settings_group(
    factory: Callable[[], Any],
    text: str,
    *,
    prefix: str | None = None,
    only: Sequence[str] | None = None,
) -> Any:
    """A field holding a settings group (a frozen dataclass whose fields are `option`s).

    The flag generator walks it: each of its fields gets a flag, listed under the
    field's own `--help` section, named `PREFIX` + the field name (`shuffle_buffer`
    for `Shuffle.buffer` under the prefix `shuffle_`) unless it names its own flag.

    Args:
        factory: the group's class (or a function making its default).
        prefix: put before each sub-field's name; default: this field's name and `_`.
        only: the sub-fields that get flags here; the others keep the default's values.
    """
    meta = {"help": text, "group": "", "walk": True, "prefix": prefix, "only": only}
    return dataclasses.field(default_factory=factory, metadata=meta)


class SettingError(UsageError):
    """A setting outside what it allows, naming the setting, what it allows and the value.

    Raised by a settings group's `__post_init__` with the field's own name; whoever
    knows how the user spelled it (a flag, an older keyword) tells it that way
    (`spelled`), so the message names what the user wrote.
    """

    def __init__(self, owner: str, name: str, detail: str) -> None:
        self.owner, self.name, self.detail = owner, name, detail
        super().__init__(f"{owner}.{name}{detail}" if owner else f"{name}{detail}")

    def spelled(self, name: str) -> SettingError:
        """The same refusal naming the setting as `name` (`--batch-size`, `batch_size`)."""
        return SettingError("", name, self.detail)


class OldSpellingWarning(FutureWarning):
    """A setting given in a spelling kept for one release (`LoaderConfig(batch_size=...)`);
    the message names the spelling that replaces it. A FutureWarning, so scripts and
    notebooks show it (Python hides a DeprecationWarning raised outside `__main__`)."""


def refuse(group: object, name: str, detail: str) -> SettingError:
    """The error for `group.name`: `detail` says what it allows and what it got."""
    return SettingError(type(group).__name__, name, detail)


def check_at_least(group: object, name: str, minimum: float, integer: bool = False) -> None:
    """A number (an integer with `integer`) of at least `minimum`."""
    value = getattr(group, name)
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise refuse(group, name, f" must be {kind} of at least {minimum}, got {value!r}")
    if value < minimum:
        raise refuse(group, name, f" must be at least {minimum}, got {value!r}")


def check_int_at_least(group: object, name: str, minimum: int) -> None:
    check_at_least(group, name, minimum, integer=True)


def check_fraction(group: object, name: str, low_open: bool = False) -> None:
    """`value` in [0, 1] (in (0, 1] with `low_open`)."""
    value = getattr(group, name)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not (0 < value <= 1 if low_open else 0 <= value <= 1):
        allowed = "in (0, 1]" if low_open else "in [0, 1]"
        raise refuse(group, name, f" must be a number {allowed}, got {value!r}")


def check_bytes(group: object, name: str, minimum: int = 0, optional: bool = False) -> None:
    """A byte size of at least `minimum` (None too with `optional`): an int or a text such
    as `512MB`, `512MiB` or `0.5G` (`shards.units`), stored as the `ByteSize` it names."""
    value = getattr(group, name)
    if optional and value is None:
        return
    try:
        size = ByteSize(value)
    except ByteSizeError as error:
        raise refuse(group, name, f": {error}") from error
    if size < minimum:
        raise refuse(group, name, f" must be at least {minimum} bytes, got {value!r}")
    object.__setattr__(group, name, size)  # frozen groups: the one normalization they make


def check_flag(group: object, name: str, optional: bool = False) -> None:
    """True or False (or None, meaning the default rule, with `optional`)."""
    value = getattr(group, name)
    if not (isinstance(value, bool) or (optional and value is None)):
        allowed = "True, False or None (the default rule)" if optional else "True or False"
        raise refuse(group, name, f" must be {allowed}, got {value!r}")


def check_choice(group: object, name: str, choices: Sequence[str], optional: bool = False) -> None:
    value = getattr(group, name)
    if not (value in choices or (optional and value is None)):
        extra = " (or None, the default)" if optional else ""
        raise refuse(group, name, f" {value!r} is not one of {', '.join(choices)}{extra}")


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


def parse_float_pair(text: str) -> tuple[float, float]:
    """`"0.08,1"` -> `(0.08, 1.0)`."""
    parts = [part for part in text.split(",") if part.strip()]
    try:
        if len(parts) == 2:
            return float(parts[0]), float(parts[1])
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected two comma-separated numbers, got {text!r}")


# The parsers of the field types that are not their own parser (`int`, `str`, `float`).
PARSERS: dict[Any, Callable[[str], Any]] = {
    tuple[int, ...]: parse_int_list,
    tuple[str, ...]: parse_str_list,
    tuple[float, float]: parse_float_pair,
}


class FlagType:
    """argparse `type=` of one flag: `parse(text)`, `none` (any case) meaning None for
    `X | None` fields (`optional`); a parser's `UsageError` is the flag's one-line
    refusal (`argument --cache-limit: 'lots' is not a byte size; write e.g. ...`)."""

    def __init__(self, base: Callable[[str], Any], optional: bool = False) -> None:
        self.base = base
        self.optional = optional
        self.__name__ = getattr(base, "__name__", "value")

    def __call__(self, text: str) -> Any:
        if self.optional and text.lower() in ("none", ""):
            return None
        try:
            return self.base(text)
        except UsageError as error:
            raise argparse.ArgumentTypeError(str(error)) from error


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


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """One flag: its dest (the flag's name with `_`), the field path it sets, type and help."""

    dest: str
    path: tuple[str, ...]  # field names from the config down to the field the flag sets
    kind: Any
    meta: dict[str, Any]
    section: str  # the `--help` section


def is_walked(f: dataclasses.Field) -> bool:
    """A field holding a settings group (`settings_group`) or a `nested=` selection."""
    return bool(f.metadata.get("walk")) or f.metadata.get("nested") is not None


def flag_specs(cls: type, prefix: str = "", path: tuple[str, ...] = ()) -> Iterator[FlagSpec]:
    """Every flag of `cls`, groups walked depth first (fields with `cli=False` have none)."""
    hints = get_type_hints(cls)
    for f in fields(cls):
        if "help" not in f.metadata:
            raise TypeError(
                f"{cls.__name__}.{f.name} has no option(...) metadata: no flag, no help"
            )
        here = (*path, f.name)
        nested = f.metadata.get("nested")
        if nested is not None:
            sub_hints = get_type_hints(hints[f.name])
            for name, meta in nested.items():
                meta = {**meta, "positional": False}
                yield FlagSpec(name, (*here, name), sub_hints[name], meta, f.metadata["group"])
        elif f.metadata.get("walk"):
            inner = f.metadata["prefix"]
            inner = f"{f.name}_" if inner is None else inner
            only = f.metadata["only"]
            for spec in flag_specs(hints[f.name], prefix + inner, here):
                if only is None or spec.path[len(here)] in only:
                    yield spec
        elif f.metadata.get("cli", True):
            dest = f.metadata.get("flag") or prefix + f.name
            yield FlagSpec(dest, here, hints[f.name], dict(f.metadata), f.metadata["group"])


def add_config_flags(
    parser: argparse.ArgumentParser, cls: type, defaults: Mapping[str, Any] | None = None
) -> None:
    """One flag per field of the config dataclass `cls`, grouped as its metadata says.

    Args:
        defaults: `{field or flag dest: value}` shown and used as defaults (default: the
            dataclass's); a group's flags take theirs from the group's default object.
    """
    values = flat_defaults(cls, default_values(cls) if defaults is None else defaults)
    groups: dict[str, Any] = {}
    exclusive: dict[str, Any] = {}
    seen: set[str] = set()
    for spec in flag_specs(cls):
        if spec.dest in seen:
            raise TypeError(f"{cls.__name__}: two flags named --{flag_name(spec.dest)}")
        seen.add(spec.dest)
        if spec.section not in groups:
            groups[spec.section] = parser.add_argument_group(f"{spec.section} options")
        target = groups[spec.section]
        if spec.meta.get("exclusive"):
            name = spec.meta["exclusive"]
            if name not in exclusive:
                exclusive[name] = target.add_mutually_exclusive_group()
            target = exclusive[name]
        add_flag(target, spec.dest, spec.kind, spec.meta, values)


def add_flag(
    container: Any, dest: str, kind: Any, meta: dict[str, Any], values: Mapping[str, Any]
) -> None:
    """One `add_argument` call: type, choices, default and help from the field."""
    base, optional = unwrap_optional(kind)
    text = meta["help"]
    if base is ByteSize:  # every size flag states the one rule of sizes
        text = f"{text}; SIZE is {SIZE_RULE}"
    kwargs: dict[str, Any] = {"help": flag_help(dest, text, values.get(dest, MISSING))}
    if base is ByteSize:
        kwargs["metavar"] = "SIZE"
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        parse = meta.get("parse")
        if parse is None:
            parse = PARSERS.get(base, base)
        kwargs["type"] = FlagType(parse, optional)
    if meta.get("choices"):
        kwargs["choices"] = meta["choices"]
    if meta.get("metavar"):
        kwargs["metavar"] = meta["metavar"]
    if meta.get("positional"):
        if dest in values:
            kwargs.update(nargs="?", default=values[dest])
        container.add_argument(dest, **kwargs)
        return
    if meta.get("bare") is not None:
        kwargs.update(nargs="?", const=meta["bare"])
    if dest in values:
        kwargs["default"] = values[dest]
    else:
        kwargs["required"] = True
    container.add_argument(f"--{flag_name(dest)}", dest=dest, **kwargs)
    for spelling, update in (meta.get("spellings") or {}).items():
        container.add_argument(
            spelling, dest=dest, action=OldSpelling, const=update, help=argparse.SUPPRESS
        )


class OldSpelling(argparse.Action):
    """An older flag of a setting: sets `const(value so far)` (see `about(spellings=...)`)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, self.const(getattr(namespace, self.dest)))


def flat_defaults(cls: type, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults keyed by flag dest: each group's default object spread into its flags.

    A dest given in `defaults` (a config file's `workers = 2`) wins over its group's.
    """
    # A group's own name may also be a flag's (`workers` holds `--workers`, `model` holds
    # `--model`): the group's default object is spread, never taken for the flag's value,
    # and a value that is no group object is the flag's (defaults already keyed by flag).
    walked = {f.name for f in fields(cls) if is_walked(f)}
    out = {
        name: value
        for name, value in defaults.items()
        if name not in walked or not dataclasses.is_dataclass(value)
    }
    for spec in flag_specs(cls):
        group = defaults.get(spec.path[0])
        if spec.dest in out or not dataclasses.is_dataclass(group):
            continue
        value = defaults[spec.path[0]]
        for name in spec.path[1:]:
            value = getattr(value, name)
        out[spec.dest] = value
    return out


def config_from_args(cls: type, namespace: argparse.Namespace) -> Any:
    """The config `cls` from parsed flags (its groups built from their own flags).

    Raises:
        UsageError: from the config's own checks (`__post_init__`); a group's refusal
            names the flag (`--batch-size must be at least 1, got 0`).
    """
    dests = {spec.path: spec.dest for spec in flag_specs(cls)}
    return build_from_flags(cls, vars(namespace), dests, (), None)


def build_from_flags(
    cls: type, values: Mapping[str, Any], dests: Mapping[tuple[str, ...], str], path: tuple, base
) -> Any:
    """`cls` at `path` from flag values; a field without a flag keeps `base`'s value."""
    hints = get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        here = (*path, f.name)
        if here in dests:
            kwargs[f.name] = values[dests[here]]
        elif is_walked(f):
            inner = getattr(base, f.name) if base is not None else field_default(f)
            kwargs[f.name] = build_from_flags(hints[f.name], values, dests, here, inner)
        elif base is not None:
            kwargs[f.name] = getattr(base, f.name)
    try:
        return cls(**kwargs)
    except SettingError as error:
        dest = dests.get((*path, error.name))
        if dest is None:
            raise
        raise error.spelled(f"--{flag_name(dest)}") from error


def changed_flags(cls: type, config: Any) -> dict[str, list[str]]:
    """`{--help section: ["--epochs 3", "--no-progress", ...]}`: the flags whose value in
    `config` (a `cls`) is not the default, as a user would type them.

    What a log needs to say how one run differs from a plain one; every value is in
    the run's stored config. Text values are redacted (a URL may carry a credential).
    """
    defaults = flat_defaults(cls, default_values(cls))
    out: dict[str, list[str]] = {}
    for spec in flag_specs(cls):
        value = config
        for name in spec.path:
            value = getattr(value, name)
        if spec.dest not in defaults or value != defaults[spec.dest]:
            out.setdefault(spec.section, []).append(flag_text(spec.dest, value))
    return out


def flag_text(dest: str, value: Any, width: int = 80) -> str:
    """`--epochs 3`, `--channels-last`, `--no-progress`, `--warmup-steps none`; a value
    longer than `width` characters keeps its start and end."""
    name = flag_name(dest)
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no-{name}"
    if value is None:
        text = "none"
    elif isinstance(value, tuple):
        text = ",".join(str(item) for item in value)
    elif isinstance(value, dict):  # as a JSON flag takes it (`--ray-resources`)
        text = json.dumps(value)
    else:
        text = redact_url(value) if isinstance(value, str) else str(value)
    if len(text) > width:
        text = f"{text[: width // 2 - 2]}...{text[-(width // 2 - 1) :]}"
    return f"--{name} {text}"


def field_default(f: dataclasses.Field) -> Any:
    """A field's default value (None when it has none)."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


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
    """An ArgumentParser whose usage errors are one line (exit 2); the full usage is long.

    Flags are never abbreviated (argparse's `allow_abbrev` would read `--epoch 1` as
    `--epochs 1`, and a new flag could silently change what an old command line
    means); an unknown flag's error suggests the closest real one, and so does an
    unknown command's when the parser has `commands` (the words its first argument
    may be).
    """

    def __init__(self, *args: Any, commands: Sequence[str] = (), **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.commands = tuple(commands)

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        words = sys.argv[1:] if args is None else list(args)
        check_command_word(self, words, self.commands)
        namespace, extras = self.parse_known_args(words, namespace)
        if extras:
            # The subcommand's parser knows the flags a misspelling was meant for.
            parser = getattr(namespace, "parser", self)
            parser.error(unrecognized_message(parser, extras))
        return namespace

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def unrecognized_message(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """`unrecognized arguments: --epoch 1 (did you mean --epochs?)`."""
    message = f"unrecognized arguments: {' '.join(extras)}"
    known = [flag for action in parser._actions for flag in action.option_strings]
    for extra in extras:
        if extra.startswith("--"):
            close = difflib.get_close_matches(extra.split("=", 1)[0], known, n=1, cutoff=0.6)
            if close:
                return f"{message} (did you mean {close[0]}?)"
    return message


def check_command_word(
    parser: argparse.ArgumentParser, words: Sequence[str], commands: Sequence[str]
) -> None:
    """Refuse a first argument that is neither a flag nor one of `commands` (exit 2).

    argparse's own refusal lists the choices but names no near one, and a CLI whose
    command is optional (`train`) would call a mistyped one an unrecognized argument.
    """
    if commands and words and not words[0].startswith("-") and words[0] not in commands:
        parser.error(unknown_command_message(words[0], commands))


def unknown_command_message(word: str, commands: Sequence[str]) -> str:
    """`unknown command 'verfy' (did you mean verify?); the commands are ...`."""
    close = difflib.get_close_matches(word, commands, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown command {word!r}{hint}; the commands are {', '.join(commands)}"


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
    names = [command.name for command in commands]
    parser = CommandParser(prog=prog, description=description, epilog=epilog, commands=names)
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


class StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record comes, not the one it was made with.

    A command's `main` may run more than once in a process (tests, notebooks), each time
    under another `sys.stderr` (pytest's capture, tqdm's wrapper); a handler holding the
    first one would write later lines to a closed stream ('--- Logging error ---').
    """

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass  # always the current sys.stderr


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
    """A CLI's `main`: parse, run the command, and end the ways a command ends without a bug.

    A refused command line exits 2 (`parse_command`). Our own errors (`ShardpipeError`:
    bad data, a request that cannot be honoured) print `PROG COMMAND: error: ...` and
    exit 1; any other exception is a bug and keeps its traceback. Ctrl-C prints
    `interrupted` and exits 130; a closed pipe (`CMD | head`) exits quietly.
    """
    command, options, args = parse_command(parser, argv)
    if setup is not None:
        setup()
    try:
        return command.run(options, args)
    except ShardpipeError as error:
        print(f"{parser.prog} {command.name}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130
    except BrokenPipeError:
        return exit_quietly_on_closed_pipe()


def parse_command(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> tuple[Command, Any, argparse.Namespace]:
    """`(command, options, args)`; a value the options refuse is a usage error (exit 2).

    Only the options' own checks run here (their `__post_init__`), which refuse with a
    `UsageError` (`SettingError` names the flag); any other exception from them is a
    bug and keeps its traceback.
    """
    args = parser.parse_args(argv)
    try:
        options = config_from_args(args.command.options, args)
    except UsageError as error:
        args.parser.error(str(error))
    return args.command, options, args
