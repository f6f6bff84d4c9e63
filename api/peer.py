"""Who sent a request, as the kernel says: each connection's peer goes into every
request's ASGI scope under PEER_SCOPE_KEY, set once per connection.

On the guests' Unix socket that is SO_PEERCRED (`api/unix_server.py`); over TCP
the uid owning the local socket at the other end (`api/tcp_peer.py`), None where
no local socket is there (another host) or the kernel could not tell.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

__all__ = ["PEER_SCOPE_KEY", "PeerCredentials", "TcpPeer", "WithPeer", "peer_bound", "peer_uid"]

PEER_SCOPE_KEY = "litegraph.peer"
ASGIApp = Callable[[MutableMapping[str, Any], Any, Any], Awaitable[None]]


@dataclass(frozen=True)
class PeerCredentials:
    """A Unix-socket caller, from SO_PEERCRED; `bound`: the standing hold whose own
    socket it came in on (a claim's, `api.hold_sockets`), None on the node's."""

    pid: int
    uid: int
    gid: int
    bound: str | None = None


@dataclass(frozen=True)
class TcpPeer:
    """A TCP caller: the uid owning its socket, None where it is not known."""

    uid: int | None


def peer_bound(scope: Mapping[str, object]) -> str | None:
    """The standing hold this request's socket was opened for; None for every other."""
    peer = scope.get(PEER_SCOPE_KEY)
    return peer.bound if isinstance(peer, PeerCredentials) else None


def peer_uid(scope: Mapping[str, object]) -> int | None:
    """The uid that sent this request; None where the kernel did not say."""
    peer = scope.get(PEER_SCOPE_KEY)
    return peer.uid if isinstance(peer, PeerCredentials | TcpPeer) else None


class WithPeer:
    """The app, with the connection's peer in every request's scope."""

    def __init__(self, app: ASGIApp, peer: PeerCredentials | TcpPeer) -> None:
        self._app = app
        self._peer = peer

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        await self._app({**scope, PEER_SCOPE_KEY: self._peer}, receive, send)
