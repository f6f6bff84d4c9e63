"""Serving the app with Hypercorn inside the daemon's nursery.

Hypercorn's `serve` is not used: it builds each connection with its own
`TCPServer`, which speaks cleartext HTTP/2 and lets a connection's error end
the server. This loop is Hypercorn's trio worker for plain-TCP binds, with
`api.connection.Connection` for every connection. Each connection's peer, the
uid owning the local socket at its other end where there is one
(`api/tcp_peer.py`), is asked once at accept and goes into every request's scope.
"""

from __future__ import annotations

import functools
import logging
import math

import hypercorn.config
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState, LifespanState
from hypercorn.utils import repr_socket_addr
from quart_trio import QuartTrio

from api.asgi_close import ShieldFinalSend
from api.connection import Connection
from api.peer import TcpPeer, WithPeer
from api.settings import HttpSettings
from api.tcp_peer import tcp_peer_uid

__all__ = ["hypercorn_config", "serve_http"]


def hypercorn_config(http: HttpSettings) -> hypercorn.config.Config:
    config = hypercorn.config.Config()
    config.bind = [http.listen]
    config.accesslog = None
    # Hypercorn's messages go through the daemon's own log handlers and format.
    config.errorlog = logging.getLogger("hypercorn.error")
    # A slow or idle client cannot hold a connection forever.
    config.read_timeout = math.ceil(http.read_timeout)
    config.keep_alive_timeout = http.keep_alive
    config.graceful_timeout = 3
    config.h11_max_incomplete_size = 16 * 1024
    config.startup_timeout = 10
    config.shutdown_timeout = 10
    return config


async def serve_http(
    app: QuartTrio,
    http: HttpSettings,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until `shutdown` is set; `task_status` gets the bound addresses."""
    config = hypercorn_config(http)
    asgi = ASGIWrapper(ShieldFinalSend(app))  # type: ignore[arg-type]
    state: LifespanState = {}
    lifespan = Lifespan(asgi, config, state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as connections:
            sockets = config.create_sockets().insecure_sockets
            listeners = []
            for sock in sockets:
                sock.listen(config.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
            task_status.started(
                [f"http://{repr_socket_addr(s.family, s.getsockname())}" for s in sockets]
            )
            shared = ConnectionState(state.copy())

            async def handler(stream: trio.SocketStream) -> None:
                # Whose socket is at the other end, asked once, before a byte is read.
                peer = TcpPeer(await tcp_peer_uid(stream.socket))
                with_peer = ASGIWrapper(WithPeer(ShieldFinalSend(app), peer))  # type: ignore[arg-type]
                server = Connection(with_peer, config, context, shared, stream)  # type: ignore[arg-type]
                await server.run()

            try:
                async with trio.open_nursery() as accepting:
                    accepting.start_soon(
                        functools.partial(
                            trio.serve_listeners, handler, listeners, handler_nursery=connections
                        )
                    )
                    await shutdown.wait()
                    accepting.cancel_scope.cancel()
            finally:
                with trio.CancelScope(shield=True):
                    for listener in listeners:
                        await listener.aclose()
                # Idle connections close now; busy ones get the graceful timeout.
                await context.terminated.set()
                connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
