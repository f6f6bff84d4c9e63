"""The `litegraph-node` command: the argv boundary and the subcommands.

Bad flags, missing values and invalid values exit with status 2 and one line
naming the flag; everything else about options comes from `.cli-flags.toml`.
"""

from __future__ import annotations

import logging
import os
import pathlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

from node.config import Config, build_config
from node.flags import (
    FlagError,
    FlagTable,
    ParsedArgs,
    coerce,
    load_flag_table,
    parse_argv,
    render_help,
)
from node.logs import configure_logging

__all__ = ["main"]

PROG = "litegraph-node"
USAGE = f"usage: {PROG} [options] COMMAND [command options] [-- ARGS]"
COMMANDS = {
    "serve": "run the node daemon",
    "dev": "workstation mode: the daemon in one process on loopback",
    "contracts": "write (or --check) the JSON Schemas in api/contracts/",
}
log = logging.getLogger(__name__)


class Invocation:
    """What the command line asked for, with typed and validated values."""

    def __init__(self, table: FlagTable, parsed: ParsedArgs) -> None:
        self.command = parsed.command
        self.positional = parsed.positional
        typed = coerce(table.for_command(parsed.command), parsed.values)
        self.options: dict[str, Any] = {
            s.name: typed.pop(s.name) for s in table.commands.get(parsed.command or "", ())
        }
        self.explicit = frozenset(s.name for s in table.flags if s.env in parsed.explicit)
        self.config: Config = build_config(typed)


def _dev_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or str(pathlib.Path.home() / ".local" / "state")
    return str(pathlib.Path(base) / "litegraph-node")


def _cmd_serve(inv: Invocation) -> int:
    from node.daemon import Daemon

    configure_logging(inv.config.log_level, inv.config.log_format)
    trio.run(Daemon(inv.config).run)
    return 0


def _cmd_dev(inv: Invocation) -> int:
    import msgspec

    from node.daemon import Daemon

    config = inv.config
    if "state_dir" not in inv.explicit:
        config = msgspec.structs.replace(config, state_dir=_dev_state_dir())
    configure_logging(config.log_level, config.log_format)
    daemon = Daemon(config)

    async def announce_and_run() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(daemon.run)
            print(f"litegraph-node dev: listening on {url}", file=sys.stderr, flush=True)
            print(f"  state: {config.state_dir}", file=sys.stderr, flush=True)
            print("  press Ctrl-C to stop", file=sys.stderr, flush=True)

    trio.run(announce_and_run)
    return 0


def _cmd_contracts(inv: Invocation) -> int:
    from api.schemas import check_contracts, write_contracts

    if inv.options.get("check"):
        problems = check_contracts()
        for line in problems:
            print(f"{PROG} contracts: {line}", file=sys.stderr)
        return 1 if problems else 0
    for name in write_contracts():
        print(f"wrote api/contracts/{name}")
    return 0


HANDLERS: dict[str, Callable[[Invocation], int]] = {
    "serve": _cmd_serve,
    "dev": _cmd_dev,
    "contracts": _cmd_contracts,
}


def _help(table: FlagTable, command: str | None) -> str:
    commands = "\n".join(f"  {name:<10} {text}" for name, text in COMMANDS.items())
    return render_help(table, f"{USAGE}\n\nCommands:\n{commands}", command)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    try:
        table = load_flag_table()
        parsed = parse_argv(table, argv, environ, tuple(COMMANDS))
        if parsed.help:
            print(_help(table, parsed.command))
            return 0
        inv = Invocation(table, parsed)
        if inv.command is None:
            raise FlagError(f"missing command (one of: {', '.join(COMMANDS)})")
        if inv.positional and inv.command != "run":
            raise FlagError(f"unexpected argument {inv.positional[0]!r}")
    except FlagError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    try:
        return HANDLERS[inv.command](inv)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
