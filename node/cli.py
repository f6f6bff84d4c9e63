"""The `litegraph-node` command: the argv boundary and the subcommands.

Bad flags, missing values and invalid values exit with status 2 and one line
naming the flag; everything else about options comes from `.cli-flags.toml`.
A daemon that cannot start exits 1; one stopped at once by a second signal
exits 128 + its number (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import pathlib
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
import msgspec
import trio

from node.address import write_address
from node.client import ClientError, find_target
from node.client_commands import CLIENT_COMMANDS, check_arguments
from node.config import Config, build_config
from node.flags import (
    FlagError,
    FlagTable,
    ParsedArgs,
    coerce,
    load_flag_table,
    parse_argv,
    render_help,
    unknown_environment,
)
from node.logs import configure_logging
from node.preflight import check_option_files
from node.run_request import build_request
from node.signals import ForcedStop, sole_error
from supervisor.wire import InvocationRequest

__all__ = ["dev_config", "main"]

PROG = "litegraph-node"
USAGE = f"usage: {PROG} [options] COMMAND [command options] [-- ARGS]"
COMMANDS = {
    "serve": "run the node daemon",
    "dev": "workstation mode: the daemon in one process on loopback",
    "snapshot": "discover once, print a NodeSnapshot as JSON, exit",
    "run": "run [options] -- CMD ...: submit a process to the local node and follow it",
    "status": "the node's readiness, drain, capacity, lanes and invocation counts",
    "ls": "list invocations (--state, --limit)",
    "cancel": "cancel ID: cancel an invocation and wait until it has released everything",
    "drain": (
        "drain [LANE]: admit no new work on a lane, or the whole node; running work goes on"
        " (uses the admin secret of the auth file)"
    ),
    "resume": (
        "resume [LANE]: admit work again on a lane, or the whole node"
        " (uses the admin secret of the auth file)"
    ),
    "logs": "logs ID [-f]: print an invocation's stdout (or --stream stderr); -f follows it",
    "contracts": "write (or --check) the JSON Schemas and OpenAPI in api/contracts/",
}
# The commands that read --sim-file; its file is checked before they start.
DISCOVERS = frozenset({"serve", "dev", "snapshot"})
# Commands that talk to a running daemon: their help shows only these global options.
CLIENT_GLOBALS = ("state_dir", "auth_file")
# Bare words each command takes: (at least, at most or None for any number).
POSITIONAL: dict[str, tuple[int, int | None]] = {
    "run": (1, None),
    "cancel": (1, 1),
    "logs": (1, 1),
    "drain": (0, 1),
    "resume": (0, 1),
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
        self.request: InvocationRequest | None = None  # what `run` submits, once checked


def _dev_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or str(pathlib.Path.home() / ".local" / "state")
    return str(pathlib.Path(base) / "litegraph-node")


def _run_daemon(config: Config, *, dev: bool) -> int:
    from node.daemon import Daemon, StartupError
    from node.heap import settle_heap

    configure_logging(config.log_level, config.log_format)
    daemon = Daemon(config, dev=dev)

    state_dir = pathlib.Path(config.state_dir)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(daemon.run)
            # Clients find the daemon from --state-dir alone (node/address.py); the
            # daemon removes the file itself, while it still holds the folder's lock.
            try:
                write_address(state_dir, url, daemon.auth_path)
            except OSError as exc:
                log.warning("cannot write the address file for clients: %s", exc)
            if dev:
                _announce_dev(url, daemon)
            settle_heap()  # what start-up built lives until exit

    try:
        trio.run(main)
    except BaseException as raised:
        if (forced := sole_error(raised, ForcedStop)) is not None:
            print(f"{PROG}: {forced}", file=sys.stderr)
            return forced.exit_status
        if (startup := sole_error(raised, StartupError)) is not None:
            print(f"{PROG}: cannot start: {startup}", file=sys.stderr)
            return 1
        raise
    return 0


def _announce_dev(url: str, daemon: Any) -> None:
    from api.auth import load_auth

    secret = load_auth(daemon.auth_path).scheduler
    print(f"\n{PROG} dev: listening on {url}", file=sys.stderr)
    print(f"  status page:  {url}/#token={secret}", file=sys.stderr)
    print(f"  token file:   {daemon.auth_path} (scheduler and admin secrets)", file=sys.stderr)
    print(f"  devices:      {_devices_line(daemon.machine.inventory)}", file=sys.stderr)
    print(f"  state folder: {daemon.config.state_dir}", file=sys.stderr)
    own_uids = daemon.guests is not None and daemon.guests.policy.uids is not None
    print(f"  guest cwd:    {_cwd_line(daemon.config, own_uids)}", file=sys.stderr)
    if daemon.guests is not None:
        print(f"  guest uids:   {daemon.guests.identity}", file=sys.stderr)
    print(f"  try:          {_client_call(daemon.config)} run -- sleep 2", file=sys.stderr)
    print("  Ctrl-C stops (a second Ctrl-C stops at once)\n", file=sys.stderr, flush=True)


def _cwd_line(config: Config, own_uids: bool = False) -> str:
    """Where a guest may start (`--guest-cwd-roots` and the writable roots), in words;
    `own_uids`: guests run as uids of their own, which a 0700 home keeps out."""
    from node.guest_keeper import closed_to_others

    writable = set(config.guest_writable_roots)
    roots = dict.fromkeys((*config.guest_cwd_roots, *config.guest_writable_roots))
    if not roots:
        return "none allowed (--guest-cwd-roots): `run --cwd none` starts in its private /tmp"
    shown = [f"{root} (writable)" if root in writable else root for root in roots]
    shown = [
        f"{text}, though a folder above it is closed to guests (their `run` starts in /tmp)"
        if own_uids and closed_to_others(pathlib.Path(root))
        else text
        for root, text in zip(roots, shown, strict=True)
    ]
    return "under " + ", ".join(shown) + "; elsewhere refused, `run --cwd none` starts in /tmp"


def _devices_line(inventory: Any) -> str:
    """What the node runs on, in words; simulated devices say so, and why."""
    from node.status_view import gpu_summary

    gpus = gpu_summary(inventory.gpus)
    if inventory.backend != "sim":
        return f"{gpus} through {inventory.backend}"
    fallback = "simulated workstation ("
    why = next((n[len(fallback) : -1] for n in inventory.notes if n.startswith(fallback)), None)
    if why is None:
        return f"SIMULATED: {gpus} that are not real hardware (--devices sim)"
    return f"SIMULATED: {gpus} that are not real hardware; NVML gave none: {why}"


def _how_to_call() -> str:
    """The command as the user can type it here (`make run` starts it from .venv/bin)."""
    invoked = sys.argv[0]
    if "/" in invoked and not invoked.endswith(".py"):
        return os.path.relpath(invoked)
    return PROG


def _client_call(config: Config) -> str:
    """How a client command reaches this daemon from another shell: the address file
    gives the URL and the auth file, so only a state folder other than dev's is named."""
    call = _how_to_call()
    state_dir = pathlib.Path(config.state_dir).absolute()
    if state_dir != pathlib.Path(_dev_state_dir()).absolute():
        call += f" --state-dir {shlex.quote(str(state_dir))}"
    return call


def _local_config(inv: Invocation) -> Config:
    """`dev` and `run` share a state folder under the user's home unless told otherwise."""
    if "state_dir" in inv.explicit:
        return inv.config
    return msgspec.structs.replace(inv.config, state_dir=_dev_state_dir())


def _cmd_serve(inv: Invocation) -> int:
    return _run_daemon(inv.config, dev=False)


def dev_config(inv: Invocation) -> Config:
    """`dev`'s config: unless told otherwise, a guest may start in the folder it was
    started in (or below) and write there (`run` in one's project works there, as its
    user would), and a guest that asks for it (`run --network host`) gets the host's
    network: trust decisions, said at start-up."""
    config = _local_config(inv)
    if "guest_host_network" not in inv.explicit:
        config = msgspec.structs.replace(config, guest_host_network=True)
    here = (os.getcwd(),)
    for name in ("guest_cwd_roots", "guest_writable_roots"):
        if name not in inv.explicit:
            config = msgspec.structs.replace(config, **{name: here})
    return config


def _cmd_dev(inv: Invocation) -> int:
    return _run_daemon(dev_config(inv), dev=True)


def _cmd_snapshot(inv: Invocation) -> int:
    from machine import snapshot_once
    from machine.discovery import DiscoveryError

    config = inv.config
    configure_logging(config.log_level, config.log_format)
    try:
        snapshot = trio.run(
            functools.partial(
                snapshot_once,
                node_id=config.node_id,
                devices=config.devices.value,
                sim_file=pathlib.Path(config.sim_file) if config.sim_file else None,
                reserved_cpu_millis=config.reserved_cpu,
                reserved_memory_bytes=config.reserved_memory,
                vram_headroom_bytes=config.vram_headroom,
                fatal_xids=frozenset(config.fatal_xids),
            )
        )
    except DiscoveryError as exc:
        print(f"{PROG} snapshot: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(snapshot)).decode() + "\n")
    return 0


def _node_target(inv: Invocation) -> tuple[str, str] | None:
    """(URL, scheduler secret) of the local node; None after saying why there is none."""
    try:
        target = find_target(_local_config(inv), inv.options.get("url", ""))
        return target.url, target.secret()
    except ClientError as exc:
        print(f"{PROG} {inv.command}: {exc}", file=sys.stderr)
        return None


def _run_client(inv: Invocation, url: str, job: Callable[[], Any]) -> int:
    from api.run_client import BROKEN_PIPE_EXIT

    try:
        code: int = trio.run(job)
    except BaseException as raised:  # the client's tasks wrap what they raise in groups
        if sole_error(raised, KeyboardInterrupt) is not None:
            return 130
        if (unreachable := sole_error(raised, httpx.HTTPError)) is not None:
            print(f"{PROG} {inv.command}: cannot reach {url}: {unreachable}", file=sys.stderr)
            return 1
        raise
    if code == BROKEN_PIPE_EXIT:
        # Whoever read our stdout is gone: nothing more may be flushed to it at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code


def _cmd_run(inv: Invocation) -> int:
    from api.run_client import follow_command

    target = _node_target(inv)
    if target is None:
        return 1
    url, secret = target
    assert inv.request is not None  # built (or refused) before any command runs
    return _run_client(
        inv,
        url,
        functools.partial(
            follow_command,
            url,
            secret,
            inv.request,
            # The current folder went as the cwd because none was named: if the guest
            # may not start there, it starts in its private /tmp instead, saying so.
            cwd_fallback=not inv.options["cwd"],
        ),
    )


def _cmd_logs(inv: Invocation) -> int:
    from api.logs_client import print_logs

    stream = inv.options["stream"]
    if stream not in ("stdout", "stderr"):  # the id count is checked with POSITIONAL
        print(f"{PROG}: error: --stream: stdout or stderr (got {stream!r})", file=sys.stderr)
        return 2
    target = _node_target(inv)
    if target is None:
        return 1
    url, secret = target
    job = functools.partial(
        print_logs,
        url,
        secret,
        inv.positional[0],
        stream,
        follow=inv.options["follow"],
    )
    return _run_client(inv, url, job)


def _cmd_contracts(inv: Invocation) -> int:
    from node.contracts import check_contracts, write_contracts

    if inv.options.get("check"):
        problems = check_contracts()
        for line in problems:
            print(f"{PROG} contracts: {line}", file=sys.stderr)
        if not problems:
            print(f"{PROG} contracts: api/contracts/ matches the types")
        return 1 if problems else 0
    for name in write_contracts():
        print(f"wrote api/contracts/{name}")
    return 0


def _client_command(inv: Invocation) -> int:
    assert inv.command is not None
    try:
        target = find_target(_local_config(inv))
        return CLIENT_COMMANDS[inv.command](target, inv.options, inv.positional, sys.stdout)
    except ClientError as exc:
        print(f"{PROG} {inv.command}: {exc}", file=sys.stderr)
        return 1


HANDLERS: dict[str, Callable[[Invocation], int]] = {
    **dict.fromkeys(CLIENT_COMMANDS, _client_command),
    "serve": _cmd_serve,
    "dev": _cmd_dev,
    "snapshot": _cmd_snapshot,
    "run": _cmd_run,
    "logs": _cmd_logs,
    "contracts": _cmd_contracts,
}


def _help(table: FlagTable, command: str | None) -> str:
    if command is None:
        commands = "\n".join(f"  {name:<10} {text}" for name, text in COMMANDS.items())
        return render_help(table, f"{USAGE}\n\nCommands:\n{commands}", None)
    usage = f"usage: {PROG} {command} [options]\n\n{command}: {COMMANDS[command]}"
    shown = None if command in DISCOVERS else CLIENT_GLOBALS
    return render_help(table, usage, command, shown)


def _check_positional(inv: Invocation) -> None:
    assert inv.command is not None
    least, most = POSITIONAL.get(inv.command, (0, 0))
    given = len(inv.positional)
    if most is not None and given > most:
        raise FlagError(f"unexpected argument {inv.positional[most]!r}")
    if given < least:
        if inv.command == "run":
            raise FlagError("run: give the command after --, e.g. run -- sleep 2")
        raise FlagError(f"{inv.command}: missing argument (see {inv.command} --help)")


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    try:
        table = load_flag_table()
        for warning in unknown_environment(table, environ):
            print(f"{PROG}: warning: {warning}", file=sys.stderr)
        parsed = parse_argv(table, argv, environ, tuple(COMMANDS))
        if parsed.help:
            print(_help(table, parsed.command))
            return 0
        if parsed.version:
            print(f"{PROG} {importlib.metadata.version(PROG)}")
            return 0
        inv = Invocation(table, parsed)
        if inv.command is None:
            known = ", ".join(COMMANDS)
            if inv.positional:  # a word that names no command: say which
                raise FlagError(f"unknown command {inv.positional[0]!r} (one of: {known})")
            raise FlagError(f"missing command (one of: {known})")
        _check_positional(inv)
        if inv.command in DISCOVERS:
            check_option_files(inv.config)
        if inv.command == "run":  # bad resources exit 2 before anything is sent
            inv.request = build_request(inv.options, inv.positional, os.getcwd())
        if inv.command in CLIENT_COMMANDS:
            check_arguments(inv.command, inv.options, inv.positional)
    except FlagError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    try:
        return HANDLERS[inv.command](inv)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
