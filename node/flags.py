"""The argv boundary: reads `.cli-flags.toml` (flags-2-env format) and nothing else.

Parsing yields a flat map env-name -> string with defaults included
(precedence argv > environment > default); `coerce` then turns that map into
typed values and reports every bad key at once. Errors are `FlagError`, which
the CLI prints as one line and turns into exit status 2.

The file is read from the package (`node/cli-flags.toml`, the repository's
`.cli-flags.toml` shipped as package data), never from the working directory,
so a planted file cannot change the daemon's options.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import pathlib
import re
import tomllib
from collections.abc import Collection, Mapping, Sequence
from typing import Any

__all__ = [
    "FlagError",
    "FlagSpec",
    "FlagTable",
    "ParsedArgs",
    "coerce",
    "default_flag_file",
    "load_flag_table",
    "parse_argv",
    "render_help",
    "unknown_environment",
]

TYPES = frozenset({"string", "integer", "number", "bool", "array", "map"})
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
_LONG_NAME = re.compile(r"^[a-z][a-z0-9-]*$")
_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


class FlagError(Exception):
    """A bad command line, environment value or flag file; exit status 2."""


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    name: str
    env: str
    aliases: tuple[str, ...]
    short: str | None
    type: str
    default: str | None
    help: str
    argv: bool = True
    # An array flag given once per item on argv (`--env A=1 --env B=2`).
    repeat: bool = False


@dataclasses.dataclass(frozen=True)
class FlagTable:
    """Global flags and the flags of each subcommand, as the file declares them."""

    service: str
    flags: tuple[FlagSpec, ...]
    commands: Mapping[str, tuple[FlagSpec, ...]]

    def for_command(self, command: str | None) -> tuple[FlagSpec, ...]:
        return self.flags + tuple(self.commands.get(command or "", ()))


@dataclasses.dataclass(frozen=True)
class ParsedArgs:
    command: str | None
    values: dict[str, str]  # env name -> raw string, defaults included
    positional: list[str]
    help: bool
    explicit: frozenset[str]  # env names set on argv or in the environment
    version: bool = False


def default_flag_file() -> pathlib.Path:
    return pathlib.Path(__file__).resolve().with_name("cli-flags.toml")


def _spec(name: str, raw: Mapping[str, Any]) -> FlagSpec:
    where = f"flag {name!r}"
    env = raw.get("env")
    if not isinstance(env, str) or not _ENV_NAME.match(env):
        raise FlagError(f"{where}: env must be a valid environment variable name")
    kind = raw.get("type", "string")
    if kind not in TYPES:
        raise FlagError(f"{where}: unknown type {kind!r}")
    aliases = tuple(raw.get("aliases", ()))
    if not all(isinstance(a, str) and _LONG_NAME.match(a) for a in aliases):
        raise FlagError(f"{where}: aliases must be lower-case long names")
    short = raw.get("short")
    if short is not None and (not isinstance(short, str) or len(short) != 1):
        raise FlagError(f"{where}: short must be one character")
    default = raw.get("default")
    if default is not None and not isinstance(default, str):
        raise FlagError(f"{where}: default must be a string")
    repeat = raw.get("repeat", False)
    if repeat and kind != "array":
        raise FlagError(f"{where}: only an array flag can repeat")
    return FlagSpec(
        name=name,
        env=env,
        aliases=aliases,
        short=short,
        type=kind,
        default=default,
        help=str(raw.get("help", "")),
        argv=bool(raw.get("argv", True)),
        repeat=bool(repeat),
    )


def load_flag_table(path: pathlib.Path | None = None) -> FlagTable:
    path = path or default_flag_file()
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise FlagError(f"cannot read the flag file {path}: {exc}") from exc
    flags = tuple(_spec(n, r) for n, r in doc.get("flags", {}).items())
    commands = {
        cmd: tuple(_spec(n, r) for n, r in body.get("flags", {}).items())
        for cmd, body in doc.get("commands", {}).items()
    }
    return FlagTable(
        service=str(doc.get("identity", {}).get("service", "")), flags=flags, commands=commands
    )


def _looks_like_option(word: str) -> bool:
    # "-5" and "-0.5" are values; "-x", "--x" and "--" are options.
    return word.startswith("-") and len(word) > 1 and not re.match(r"^-\d", word)


def _set_bool(values: dict[str, str], spec: FlagSpec, raw: str, shown: str) -> None:
    lowered = raw.lower()
    if lowered not in _TRUE | _FALSE:
        raise FlagError(f"{shown}: expected true or false, got {raw!r}")
    values[spec.env] = "true" if lowered in _TRUE else "false"


def parse_argv(
    table: FlagTable,
    argv: Sequence[str],
    environ: Mapping[str, str],
    commands: Sequence[str],
) -> ParsedArgs:
    """Parse `argv` against `table`; the first bare word naming a command selects it."""
    command: str | None = None
    from_argv: dict[str, str] = {}
    repeated: dict[str, list[str]] = {}
    positional: list[str] = []
    want_help = want_version = False
    i = 0
    while i < len(argv):
        word = argv[i]
        i += 1
        specs = table.for_command(command)
        longs = {a: s for s in specs if s.argv for a in s.aliases}
        shorts = {s.short: s for s in specs if s.argv and s.short}
        if word == "--":
            positional.extend(argv[i:])
            break
        if word in ("--help", "-h"):
            want_help = True
        elif word == "--version":
            want_version = True
        elif word.startswith("--"):
            name, eq, value = word[2:].partition("=")
            spec = longs.get(name)
            if spec is None and name.startswith("no-"):
                negated = longs.get(name[3:])
                if negated is not None and negated.type == "bool" and not eq:
                    from_argv[negated.env] = "false"
                    continue
            if spec is None:
                raise FlagError(f"unknown flag --{name}")
            if spec.type == "bool":
                _set_bool(from_argv, spec, value if eq else "true", f"--{name}")
                continue
            if not eq:
                if i >= len(argv) or _looks_like_option(argv[i]):
                    raise FlagError(f"--{name}: missing value")
                value = argv[i]
                i += 1
            if spec.repeat:
                repeated.setdefault(spec.env, []).append(value)
                from_argv[spec.env] = json.dumps(repeated[spec.env])
            else:
                from_argv[spec.env] = value
        elif _looks_like_option(word):
            bundle = word[1:]
            for j, char in enumerate(bundle):
                spec = shorts.get(char)
                if spec is None:
                    raise FlagError(f"unknown flag -{char}")
                if spec.type == "bool":
                    from_argv[spec.env] = "true"
                    continue
                rest = bundle[j + 1 :]
                if rest:
                    from_argv[spec.env] = rest
                elif i < len(argv) and not _looks_like_option(argv[i]):
                    from_argv[spec.env] = argv[i]
                    i += 1
                else:
                    raise FlagError(f"-{char}: missing value")
                break
        elif command is None and word in commands:
            command = word
        else:
            positional.append(word)
    values: dict[str, str] = {}
    explicit: set[str] = set()
    for spec in table.for_command(command):
        if spec.env in from_argv or spec.env in environ:
            explicit.add(spec.env)
        if spec.env in from_argv:
            values[spec.env] = from_argv[spec.env]
        elif spec.env in environ:
            values[spec.env] = environ[spec.env]
        elif spec.default is not None:
            values[spec.env] = spec.default
    return ParsedArgs(
        command=command,
        values=values,
        positional=positional,
        help=want_help,
        explicit=frozenset(explicit),
        version=want_version,
    )


def unknown_environment(table: FlagTable, environ: Mapping[str, str]) -> list[str]:
    """One warning per variable that looks like ours (the prefix every flag's env
    name shares) but names no flag, with the nearest valid name when one is close."""
    known = sorted(
        {s.env for s in table.for_command(None)}
        | {s.env for specs in table.commands.values() for s in specs}
    )
    prefix = f"{table.service.upper().replace('-', '_')}_"
    warnings = []
    for name in sorted(environ):
        if not name.startswith(prefix) or name in known:
            continue
        # Compare what follows the shared prefix, or every name looks alike.
        close = difflib.get_close_matches(
            name.removeprefix(prefix), [k.removeprefix(prefix) for k in known], n=1
        )
        hint = f"; did you mean {prefix}{close[0]}?" if close else " (see --help)"
        warnings.append(f"{name} is not an option and is ignored{hint}")
    return warnings


def _coerce_one(spec: FlagSpec, raw: str) -> Any:
    if spec.type == "string":
        return raw
    if spec.type == "bool":
        lowered = raw.lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ValueError("expected true or false")
    if spec.type == "integer":
        if not re.fullmatch(r"[+-]?\d{1,19}", raw.strip()):
            raise ValueError("expected an integer")
        return int(raw)
    if spec.type == "number":
        try:
            number = float(raw)
        except ValueError:
            raise ValueError("expected a number") from None
        if not math.isfinite(number):
            raise ValueError("expected a finite number")
        return number
    try:
        decoded = json.loads(raw)
    except json.JSONDecodeError:
        raise ValueError(f"expected a JSON {spec.type}") from None
    expected = list if spec.type == "array" else dict
    if not isinstance(decoded, expected):
        raise ValueError(f"expected a JSON {spec.type}")
    return decoded


def coerce(specs: Sequence[FlagSpec], values: Mapping[str, str]) -> dict[str, Any]:
    """Typed values by flag name; every bad value is reported in one FlagError."""
    typed: dict[str, Any] = {}
    problems: list[str] = []
    for spec in specs:
        if spec.env not in values:
            continue
        try:
            typed[spec.name] = _coerce_one(spec, values[spec.env])
        except ValueError as exc:
            shown = spec.aliases[0] if spec.aliases else spec.name
            problems.append(f"--{shown} ({spec.env}): {exc}, got {values[spec.env]!r}")
    if problems:
        raise FlagError("; ".join(problems))
    return typed


def _flag_lines(spec: FlagSpec) -> list[str]:
    names = ", ".join(([f"-{spec.short}"] if spec.short else []) + [f"--{a}" for a in spec.aliases])
    if spec.type == "bool" and spec.aliases:
        names += f" / --no-{spec.aliases[0]}"
    if spec.repeat:
        names += " (repeatable)"
    default = "(none)" if spec.default is None else repr(spec.default)
    return [
        f"  {names or '(env only)'}  [{spec.type}, default {default}]",
        f"      env {spec.env}: {spec.help}",
    ]


def render_help(
    table: FlagTable,
    usage: str,
    command: str | None,
    shown_globals: Collection[str] | None = None,
) -> str:
    """Every option without a command; with one, its own options first, then the
    global options in `shown_globals` (None: all of them)."""
    groups: list[tuple[str, Sequence[FlagSpec]]]
    if command is None:
        groups = [("Options", table.flags)]
        groups += [(f"Options of '{c}'", s) for c, s in table.commands.items()]
    else:
        shown = [s for s in table.flags if shown_globals is None or s.name in shown_globals]
        groups = [(f"Options of '{command}'", table.commands.get(command, ()))]
        groups += [("Node options", shown)]
    lines = [usage]
    for title, specs in groups:
        if specs:
            lines += ["", f"{title} (argv > environment > default):"]
            for spec in specs:
                lines += _flag_lines(spec)
    lines += ["", "  -h, --help  show this help and exit"]
    return "\n".join(lines)
