"""The client commands that read or steer the running daemon: `status`, `ls`,
`cancel ID`, `drain [LANE]` and `resume [LANE]`.

Each gets the daemon (`node.client.Target`), its own options and its bare words,
and returns the exit status: 0 done, 1 the daemon refused or is unreachable
(`ClientError`). Bad arguments are found first and raise `FlagError` (exit 2).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TextIO

import msgspec

from api.auth import Role
from api.wire import NodeStatus
from machine.snapshot import NodeSnapshot
from node.client import Target, request
from node.flags import FlagError
from node.status_view import invocation_table, status_text
from supervisor.listing import MAX_LIST_LIMIT
from supervisor.wire import (
    INVOCATION_ID,
    LANE_ID,
    InvocationList,
    InvocationState,
    InvocationStatus,
)

__all__ = ["CLIENT_COMMANDS", "check_arguments"]

Handler = Callable[[Target, Mapping[str, Any], list[str], TextIO], int]
MAX_LIMIT = 10_000


def _states(text: str) -> list[InvocationState]:
    states = []
    for word in filter(None, (w.strip() for w in text.split(","))):
        try:
            states.append(InvocationState(word))
        except ValueError:
            known = ", ".join(s.value for s in InvocationState)
            raise FlagError(f"--state: {word!r} is not one of {known}") from None
    return states


def check_arguments(command: str, options: Mapping[str, Any], positional: list[str]) -> None:
    """Refuse bad arguments before the daemon is looked up (exit 2)."""
    if command == "cancel" and not INVOCATION_ID.fullmatch(positional[0]):
        raise FlagError(f"cancel: {positional[0]!r} is not an invocation id")
    if command in ("drain", "resume") and positional and not LANE_ID.fullmatch(positional[0]):
        raise FlagError(f"{command}: {positional[0]!r} is not a lane id (lane_ and 16 hex)")
    if command == "ls":
        _states(options["state"])
        if not 1 <= options["limit"] <= MAX_LIMIT:
            raise FlagError(f"--limit: must be from 1 to {MAX_LIMIT} (got {options['limit']})")


def _print_json(value: Any, out: TextIO) -> None:
    out.write(msgspec.json.format(msgspec.json.encode(value)).decode() + "\n")


def cmd_status(target: Target, options: Mapping[str, Any], _: list[str], out: TextIO) -> int:
    node = msgspec.convert(request(target, "GET", "/v1/node"), NodeStatus)
    snapshot = msgspec.convert(request(target, "GET", "/v1/snapshot"), NodeSnapshot)
    if options["json"]:
        _print_json({"node": node, "snapshot": snapshot}, out)
    else:
        out.write(status_text(node, snapshot))
    return 0


def cmd_ls(target: Target, options: Mapping[str, Any], _: list[str], out: TextIO) -> int:
    """Newest first, as the daemon pages them: pages of at most MAX_LIST_LIMIT
    until --limit invocations are shown or there are no more."""
    states = [("state", s.value) for s in _states(options["state"])]
    limit: int = options["limit"]
    shown: list[InvocationStatus] = []
    cursor: str | None = None
    while True:
        page = min(limit - len(shown), MAX_LIST_LIMIT)
        params = [*states, ("limit", str(page)), *([("cursor", cursor)] if cursor else [])]
        answer = request(target, "GET", "/v1/invocations", params=params)
        listed = msgspec.convert(answer, InvocationList)
        shown += listed.invocations[:page]
        cursor = listed.next_cursor
        if cursor is None or len(shown) >= limit:
            break
    if options["json"]:
        _print_json(InvocationList(invocations=shown, next_cursor=cursor), out)
    else:
        out.write(invocation_table(shown))
    return 0


def cmd_cancel(target: Target, _: Mapping[str, Any], positional: list[str], out: TextIO) -> int:
    (invocation_id,) = positional
    ended = msgspec.convert(
        request(target, "DELETE", f"/v1/invocations/{invocation_id}"), InvocationStatus
    )
    reason = f" ({ended.reason})" if ended.reason else ""
    out.write(f"{ended.id}: {ended.state.value}{reason}\n")
    return 0


def _set_drained(drained: bool) -> Handler:
    action = "drain" if drained else "resume"

    def handler(target: Target, _: Mapping[str, Any], positional: list[str], out: TextIO) -> int:
        if positional:
            (lane_id,) = positional
            request(target, "POST", f"/v1/lanes/{lane_id}/{action}", role=Role.admin)
            out.write(f"lane {lane_id}: {'drained' if drained else 'resumed'}\n")
            return 0
        answer = request(target, "POST", f"/v1/node/{action}", role=Role.admin)
        node = msgspec.convert(answer, NodeStatus)
        running = node.invocations.get("running", 0) + node.invocations.get("queued", 0)
        if drained:
            out.write(
                f"node {node.node_id}: drained; no new work is admitted,"
                f" {running} running or queued go on\n"
            )
        else:
            out.write(f"node {node.node_id}: resumed; admitting work\n")
        return 0

    return handler


CLIENT_COMMANDS: dict[str, Handler] = {
    "status": cmd_status,
    "ls": cmd_ls,
    "cancel": cmd_cancel,
    "drain": _set_drained(True),
    "resume": _set_drained(False),
}
