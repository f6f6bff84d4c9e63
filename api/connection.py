"""One client connection: HTTP/1.1 only, and a fault in it ends it alone.

This is Hypercorn's trio `TCPServer` with two changes for a daemon that may
listen on 0.0.0.0 without TLS:

- Cleartext HTTP/2 is refused. A prior-knowledge preface (`PRI * HTTP/2.0`)
  gets SETTINGS and GOAWAY(HTTP_1_1_REQUIRED) and the connection closes;
  `Upgrade: h2c` is not taken up and the request is answered over HTTP/1.1.
  Hypercorn 0.18's HTTP/2 path raises `KeyError` on DATA for a stream it has
  already answered, and that error ended the whole server.
- Whatever a connection raises is logged and closes that connection; only
  cancellation leaves `run`, so nothing a client sends can end `serve_http`.
"""

from __future__ import annotations

import logging
import struct
from typing import Any

import h11
import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.typing import ConnectionState
from hypercorn.utils import parse_socket_addr

__all__ = ["GOAWAY_HTTP_1_1_REQUIRED", "Connection"]

log = logging.getLogger(__name__)


def _frame(kind: int, payload: bytes) -> bytes:
    """An HTTP/2 frame on stream 0 with no flags (RFC 9113 section 4.1)."""
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, 0, 0) + payload


# An empty SETTINGS (the server preface), then GOAWAY with last stream 0 and
# error HTTP_1_1_REQUIRED (0xd): the client may retry over HTTP/1.1.
GOAWAY_HTTP_1_1_REQUIRED = _frame(0x4, b"") + _frame(0x7, struct.pack(">II", 0, 0xD))


class _Http2Refused(Exception):
    """The client opened with the HTTP/2 connection preface."""


class _Http11(H11Protocol):
    async def _check_protocol(self, event: h11.Request) -> None:
        # Hypercorn's own check switches to HTTP/2 here; this one never does.
        if (event.method, event.target, event.http_version) == (b"PRI", b"*", b"2.0"):
            raise _Http2Refused


class _Http11Only:
    """Stands where Hypercorn keeps its protocol switcher, without the switch."""

    def __init__(self, protocol: _Http11, send: Any) -> None:
        self._protocol = protocol
        self._send = send

    async def initiate(self) -> None:
        await self._protocol.initiate()

    async def handle(self, event: Event) -> None:
        try:
            await self._protocol.handle(event)
        except _Http2Refused:
            await self._send(RawData(data=GOAWAY_HTTP_1_1_REQUIRED))
            await self._send(Closed())


class Connection(TCPServer):
    """One accepted plain-TCP connection (the daemon serves no TLS itself)."""

    async def run(self) -> None:
        try:
            await self._serve()
        except* Exception as faults:
            # trio.Cancelled is not an Exception: except* passes it on.
            log.error("closed an HTTP connection after an error", exc_info=faults)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.stream)

    async def _serve(self) -> None:
        socket = self.stream.socket
        try:
            client = parse_socket_addr(socket.family, socket.getpeername())
            server = parse_socket_addr(socket.family, socket.getsockname())
            async with TaskGroup() as task_group:
                self._task_group = task_group
                protocol = _Http11(
                    self.app,
                    self.config,
                    self.context,
                    task_group,
                    ConnectionState(self.state),
                    False,
                    client,
                    server,
                    self.protocol_send,
                )
                self.protocol = _Http11Only(protocol, self.protocol_send)  # type: ignore[assignment]
                await self.protocol.initiate()
                await self.idle_task.restart(self._task_group, self._idle_timeout)
                await self._read_data()
        except OSError:
            pass  # the peer went away
        finally:
            await self._close()
