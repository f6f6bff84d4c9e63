"""One client connection: HTTP/1.1 only, a fault in it ends it alone, and its
read timer runs only while a request is awaited.

This is Hypercorn's trio `TCPServer` with three changes for a daemon that may
listen on 0.0.0.0 without TLS:

- Cleartext HTTP/2 is refused. A prior-knowledge preface (`PRI * HTTP/2.0`)
  gets SETTINGS and GOAWAY(HTTP_1_1_REQUIRED) and the connection closes;
  `Upgrade: h2c` is not taken up and the request is answered over HTTP/1.1.
  Hypercorn 0.18's HTTP/2 path raises `KeyError` on DATA for a stream it has
  already answered, and that error ended the whole server.
- Whatever a connection raises is logged and closes that connection; only
  cancellation leaves `run`, so nothing a client sends can end `serve_http`.
- An answer that starts before the request's body has all arrived (a refusal
  that reads no body) says `Connection: close`. Hypercorn closes such a
  connection once the answer is sent but did not say so, and a client that
  reused it found it closed with no answer ("Server disconnected").
- The read timeout guards reading a request, not handling one. Hypercorn
  arms it around every read, so a handler that ran longer (a long kernel) or
  an event stream was cut off with no answer. Here it is off from the moment
  a request's head has arrived until its response is done; the app's body
  timeout bounds the body, the keep-alive timer an idle connection. The same
  timeout bounds each write, so a peer that stops reading cannot hold a
  stream open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import struct
from typing import Any

import h11
import trio
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.events import Response
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.typing import ConnectionState
from hypercorn.utils import parse_socket_addr

__all__ = ["GOAWAY_HTTP_1_1_REQUIRED", "Connection"]

log = logging.getLogger(__name__)
# Closing: how long, and how much, what the peer still sends is read and dropped.
LINGER_SECONDS = 1.0
LINGER_BYTES = 16 << 20


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

    async def stream_send(self, event: StreamEvent) -> None:
        if (
            isinstance(event, Response)
            and event.status_code >= 200
            and isinstance(self.connection, h11.Connection)
            and self.connection.their_state is not h11.DONE
        ):
            # The rest of the body will not be read: this connection ends with this answer.
            event = dataclasses.replace(event, headers=[*event.headers, (b"connection", b"close")])
        await super().stream_send(event)


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

    _handling = False  # between a request's head and the end of its response
    _read_scope: trio.CancelScope | None = None
    _closing = False  # once set, the reader drops what arrives (`_close`)
    _reader_done: trio.Event | None = None  # set while the reader runs

    async def _close(self) -> None:
        """Close after a lingering moment: what the peer still sends is read and
        dropped. A socket closed with unread bytes makes the kernel reset the
        connection, and the reset can discard our answer (a 413 sent before the
        oversized body arrived) before the client has read it. The connection's reader,
        where it still runs, does the dropping (a stream has one reader at a time)."""
        self._closing = True
        try:
            with trio.move_on_after(LINGER_SECONDS):
                with contextlib.suppress(
                    trio.BrokenResourceError, trio.BusyResourceError, trio.ClosedResourceError
                ):
                    await self.stream.send_eof()
                    if self._reader_done is not None:
                        await self._reader_done.wait()
                    else:
                        await self._drop_incoming()
        finally:
            await self.stream.aclose()

    async def _drop_incoming(self) -> None:
        """Read and drop until the peer's end of file or LINGER_BYTES in all."""
        dropped = 0
        while dropped < LINGER_BYTES:
            data = await self.stream.receive_some(MAX_RECV)
            if not data:
                return
            dropped += len(data)

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

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, RawData):
            await self._write(event.data)
            return
        if isinstance(event, Updated):
            self._handling = not event.idle
            self._arm_read_timer()
        await super().protocol_send(event)

    async def _write(self, data: bytes) -> None:
        async with self.send_lock:
            # Shielded, so the app's cancellation never cuts a frame in half, and
            # bounded: a peer that takes no bytes for a read timeout has gone.
            timeout = self.config.read_timeout or math.inf
            with trio.move_on_after(timeout, shield=True) as scope:
                try:
                    await self.stream.send_all(data)
                    return
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            if scope.cancelled_caught:
                await trio.aclose_forcefully(self.stream)
            await self.protocol.handle(Closed())

    def _arm_read_timer(self) -> None:
        timeout = self.config.read_timeout
        if self._read_scope is not None:
            if self._handling or timeout is None:
                self._read_scope.deadline = math.inf
            else:
                self._read_scope.deadline = trio.current_time() + timeout

    async def _read_data(self) -> None:
        self._reader_done = done = trio.Event()
        try:
            await self._read_until_closed()
        finally:
            self._reader_done = None
            done.set()
        await self.protocol.handle(Closed())

    async def _read_until_closed(self) -> None:
        dropped = 0
        while True:
            with trio.CancelScope() as scope:
                self._read_scope = scope
                self._arm_read_timer()
                try:
                    data = await self.stream.receive_some(MAX_RECV)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    return
                finally:
                    self._read_scope = None
            if scope.cancelled_caught:
                return  # nothing arrived while a request was awaited
            if data == b"":
                await self.protocol.handle(RawData(b""))
                return
            if self._closing:  # our answer is out and the connection closing: dropped
                dropped += len(data)
                if dropped >= LINGER_BYTES:
                    return
                continue
            await self.protocol.handle(RawData(bytes(data)))
