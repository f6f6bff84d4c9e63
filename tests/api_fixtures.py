"""Shared fixtures for the HTTP API tests: a real daemon on 127.0.0.1 port 0.

`running_daemon(tmp_path, ...)` starts a `Daemon` in the caller's trio run
(Hypercorn, supervisor, simulated devices), yields `RunningDaemon(url,
scheduler, admin, daemon)` and stops it -- bounded -- however the test ends.
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import urllib.parse
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import httpx
import msgspec
import trio

from api.auth import load_auth
from machine.snapshot import NodeSnapshot
from node.cli import COMMANDS
from node.config import Config, build_config
from node.daemon import Daemon
from node.flags import coerce, load_flag_table, parse_argv
from supervisor.wire import InvocationState, InvocationStatus
from tests.helpers import UNCONFINED_UNLESS_ROOT, guest_cwd_roots, guest_run_dir

__all__ = [
    "SSE_CONNECTED",
    "START_SECONDS",
    "STOP_SECONDS",
    "TERMINAL",
    "RunningDaemon",
    "SseStream",
    "bearer",
    "builtin_request",
    "daemon_config",
    "event_run",
    "get_snapshot",
    "running_daemon",
    "settled_snapshot",
    "sse_connect",
    "wait_for_state",
]

START_SECONDS = 20.0
STOP_SECONDS = 30.0
TERMINAL = frozenset(
    {
        InvocationState.succeeded,
        InvocationState.failed,
        InvocationState.cancelled,
        InvocationState.timed_out,
        InvocationState.rejected,
    }
)


def daemon_config(tmp_path: pathlib.Path, *argv: str, devices: str = "sim") -> Config:
    """A Config as `serve` builds it: loopback port 0, state in `tmp_path`, guests'
    cwds under the folders `guest_cwd` makes (serve allows none by default).

    Health probes run once at start and then rarely (an hour), so a snapshot
    changes only when a test changes something."""
    table = load_flag_table()
    args = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--state-dir",
        str(tmp_path / "state"),
        "--devices",
        devices,
        "--health-interval",
        "3600",
        "--shutdown-grace",
        "0",
        "--guest-run-dir",
        guest_run_dir(),
        "--guest-cwd-roots",  # where `guest_cwd` makes its folders; a test may say other
        guest_cwd_roots(),
        *argv,
    ]
    parsed = parse_argv(table, args, dict(UNCONFINED_UNLESS_ROOT), tuple(COMMANDS))
    return build_config(coerce(table.flags, parsed.values))


class RunningDaemon(NamedTuple):
    url: str
    scheduler: str
    admin: str
    daemon: Daemon


@contextlib.asynccontextmanager
async def running_daemon(
    tmp_path: pathlib.Path,
    *argv: str,
    devices: str = "sim",
    pynvml_module: Any = None,
    dev: bool = False,
    config: Config | None = None,
    prepare: Callable[[Daemon], None] = lambda _daemon: None,
) -> AsyncIterator[RunningDaemon]:
    """Start a daemon (`prepare` sees it first), yield it with its operator secrets,
    stop it on the way out."""
    daemon = Daemon(
        config or daemon_config(tmp_path, *argv, devices=devices),
        handle_signals=False,
        dev=dev,
        pynvml_module=pynvml_module,
    )
    prepare(daemon)
    async with trio.open_nursery() as nursery:
        try:
            with trio.fail_after(START_SECONDS):
                url = await nursery.start(daemon.run)
            auth = load_auth(daemon.auth_path)
            yield RunningDaemon(url, auth.scheduler, auth.admin, daemon)
        finally:
            daemon.stop.set()
            # The daemon's own shutdown is bounded; this bounds the test as well.
            nursery.cancel_scope.deadline = trio.current_time() + STOP_SECONDS


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def builtin_request(
    invocation_id: str,
    name: str = "sleep",
    args: dict[str, Any] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """The JSON body of a submission of builtin work (`sleep`, `echo`, `fail`)."""
    body: dict[str, Any] = {
        "id": invocation_id,
        "work": {"kind": "builtin", "name": name, "args": args or {}},
        "resources": {"cpu_millis": 100, "memory_bytes": 2**20},
    }
    body.update(fields)
    return body


async def get_snapshot(client: httpx.AsyncClient, secret: str) -> NodeSnapshot:
    reply = await client.get("/v1/snapshot", headers=bearer(secret))
    assert reply.status_code == 200, reply.text
    return msgspec.json.decode(reply.content, type=NodeSnapshot)


async def settled_snapshot(client: httpx.AsyncClient, secret: str) -> NodeSnapshot:
    """The snapshot once the start-up health probe has read every device
    (after that, nothing changes on its own with the hour-long probe interval)."""
    with trio.fail_after(10):
        while True:
            snapshot = await get_snapshot(client, secret)
            if all(d.temperature_c is not None for d in snapshot.devices):
                return snapshot
            await trio.sleep(0.02)


async def wait_for_state(
    client: httpx.AsyncClient,
    secret: str,
    invocation_id: str,
    states: frozenset[InvocationState] = TERMINAL,
    seconds: float = 10.0,
) -> InvocationStatus:
    with trio.fail_after(seconds):
        while True:
            reply = await client.get(f"/v1/invocations/{invocation_id}", headers=bearer(secret))
            assert reply.status_code == 200, reply.text
            status = msgspec.json.decode(reply.content, type=InvocationStatus)
            if status.state in states:
                return status
            await trio.sleep(0.02)


def event_run(node: RunningDaemon) -> str:
    """The run label of the daemon's event ids (`<run>-<sequence>`)."""
    hub = node.daemon.context.events
    assert hub is not None
    return hub.run


# The first block of every event stream: the reconnect delay and a comment.
SSE_CONNECTED = {"retry": "2000", "": "connected"}


class SseStream:
    """A server-sent events stream read over a raw HTTP/1.0 connection (no chunking,
    no client library generators to leak when a test stops reading early)."""

    def __init__(self, stream: trio.SocketStream, status: int, head: str, rest: bytes) -> None:
        self._stream = stream
        self.status = status
        self.head = head
        self._buffer = rest

    async def _fill(self) -> None:
        data = await self._stream.receive_some(65536)
        if not data:
            raise EOFError("the server closed the event stream")
        self._buffer += data

    async def next_block(self) -> dict[str, str]:
        """The next event block as {field: value}; a comment block gives {"": text}."""
        while b"\n\n" not in self._buffer:
            await self._fill()
        block, self._buffer = self._buffer.split(b"\n\n", 1)
        fields: dict[str, str] = {}
        for line in block.decode().splitlines():
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")
        return fields

    async def body(self) -> bytes:
        """The Content-Length body of a refusal (which is not a stream)."""
        match = re.search(r"(?im)^content-length:\s*(\d+)", self.head)
        assert match is not None, self.head
        while len(self._buffer) < int(match.group(1)):
            await self._fill()
        return self._buffer


@contextlib.asynccontextmanager
async def sse_connect(
    url: str, secret: str, path: str = "/v1/events", last_event_id: str | None = None
) -> AsyncIterator[SseStream]:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    async with stream:
        resume = "" if last_event_id is None else f"Last-Event-ID: {last_event_id}\r\n"
        request = (
            f"GET {path} HTTP/1.0\r\nHost: {parts.netloc}\r\n{resume}"
            f"Authorization: Bearer {secret}\r\nAccept: text/event-stream\r\n\r\n"
        )
        await stream.send_all(request.encode())
        buffer = b""
        with trio.fail_after(10):
            while b"\r\n\r\n" not in buffer:
                data = await stream.receive_some(65536)
                if not data:
                    break
                buffer += data
        head, _, rest = buffer.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        yield SseStream(stream, status, head.decode(errors="replace"), rest)
