"""The node API on a Unix socket, for guests: every request carries its caller's uid.

Guests reach the node through this socket (a `sandbox` guest has no other
way: its network namespace holds only loopback). On accept the kernel's
SO_PEERCRED gives the connecting process's pid, uid and gid; they go into
each request's ASGI scope (`api/peer.py`), so the lane-work route can bind a
capability token to the uid of the invocation it was minted for. The
connection itself is served by Hypercorn's own connection handler, as on TCP.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import stat
import struct
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any, cast

import hypercorn.app_wrappers
import hypercorn.trio.worker_context
import hypercorn.typing
import trio
from quart_trio import QuartTrio

from api.asgi_close import ShieldFinalSend
from api.connection import Connection
from api.peer import PeerCredentials, WithPeer
from api.server import hypercorn_config
from api.settings import HttpSettings

__all__ = ["bind_unix_socket", "serve_unix"]

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
ASGIApp = Callable[[MutableMapping[str, Any], Any, Any], Awaitable[None]]


def _credentials(sock: trio.socket.SocketType, bound: str | None) -> PeerCredentials:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCredentials(pid, uid, gid, bound)


# What a hold's socket serves: a lane's work, its buffers and its token's refresh.
_LANE_WORK = re.compile(r"/v1/lanes/[^/]+/(work|token|buffers/[^/]+)")


class LaneWorkOnly:
    """A hold's socket serves lane work alone (`_LANE_WORK`, an allow-list: a route
    added later is not served there unless named): the rest of the node's API is not
    its holder's to reach."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            return  # no websocket, nothing but HTTP requests
        if _LANE_WORK.fullmatch(str(scope.get("path", ""))):
            await self._app(scope, receive, send)
            return
        body = b'{"error":{"code":"not_found","message":"this socket serves lane work only"}}'
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 404, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def bind_unix_socket(path: Path) -> socket.socket:
    """Listen at `path` (replacing a stale socket, never another kind of file), mode 0666:
    any local uid may connect; what it may do is decided by its token and its uid."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.fspath(path))
        os.chmod(path, 0o666)  # noqa: S103 - who connects is decided by token and uid
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_unix(
    app: QuartTrio,
    http: HttpSettings,
    sock: socket.socket,
    shutdown: trio.Event,
    bound: str | None = None,
) -> None:
    """Serve `app` on the listening Unix socket until `shutdown` is set. `bound`: the
    standing hold the socket is for, which its requests carry (api/peer.py); such a
    socket serves lane work alone."""
    config = hypercorn_config(http)
    context = hypercorn.trio.worker_context.WorkerContext(None)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))

    async def connection(stream: trio.SocketStream) -> None:
        try:
            peer = _credentials(stream.socket, bound)
        except OSError:
            await trio.aclose_forcefully(stream)
            return
        served = cast(ASGIApp, ShieldFinalSend(app))
        with_peer = WithPeer(served if bound is None else LaneWorkOnly(served), peer)
        wrapped = hypercorn.app_wrappers.ASGIWrapper(with_peer)  # type: ignore[arg-type]
        state = hypercorn.typing.ConnectionState({})
        server = Connection(wrapped, config, context, state, stream)  # type: ignore[arg-type]
        # HTTP/1.1 only; a connection's fault ends that connection alone (api.connection).
        await server.run()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, connection, [listener])
        await shutdown.wait()
        nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        nursery.cancel_scope.cancel()
