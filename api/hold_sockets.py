"""A Unix socket of its own for each standing hold (a Kubernetes claim's): its tokens
work there and nowhere else, and nothing else's does (`supervisor.lane_routing`), so
the socket, mounted only in the claim's pods, binds the tokens to them.

Each is served in the daemon's nursery (`api.unix_server`, lane work only) from
`open` until `close`; opening one again (a repeated Prepare) keeps the one served.
At most `max_sockets` at once.

A socket is bound and made 0666 in `staging`, a folder of the node's own that no pod
sees, and only then renamed into the claim's folder: the claim's pods may write in
theirs, and a chmod there could be led by a symlink they swapped in to any file of the
host. A rename follows no symlink; it replaces what was there.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from pathlib import Path

import trio
from quart_trio import QuartTrio

from api.settings import HttpSettings
from api.unix_server import bind_unix_socket, serve_unix
from supervisor.standing_holds import MAX_HOLDS

__all__ = ["HoldSockets", "HoldSocketsFull"]

MAX_SOCKETS = MAX_HOLDS  # one per claim the node may hold


class HoldSocketsFull(RuntimeError):
    """No room for another hold's socket."""


class HoldSockets:
    def __init__(
        self,
        app: QuartTrio,
        http: HttpSettings,
        nursery: trio.Nursery,
        staging: Path,
        *,
        max_sockets: int = MAX_SOCKETS,
    ) -> None:
        self._app = app
        self._staging = staging
        self._http = http
        self._nursery = nursery
        self._max = max_sockets
        self._served: dict[str, tuple[Path, trio.Event]] = {}

    def open(self, subject: str, path: Path) -> None:
        """Serve the hold's socket at `path` (OSError when it cannot be bound)."""
        served = self._served.get(subject)
        if served is not None and served[0] == path and path.is_socket():
            return
        self.close(subject)
        if len(self._served) >= self._max:
            raise HoldSocketsFull(f"{self._max} hold sockets are open")
        self._staging.mkdir(mode=0o700, parents=True, exist_ok=True)
        made = self._staging / f"{secrets.token_hex(8)}.sock"
        sock = bind_unix_socket(made)
        try:
            os.rename(made, path)
        except BaseException:
            sock.close()
            made.unlink(missing_ok=True)
            raise
        stop = trio.Event()
        self._served[subject] = (path, stop)
        self._nursery.start_soon(self._serve, subject, sock, stop)

    def close(self, subject: str) -> None:
        """Stop serving the hold's socket and remove it; nothing when there is none."""
        served = self._served.pop(subject, None)
        if served is None:
            return
        path, stop = served
        stop.set()
        with contextlib.suppress(FileNotFoundError):
            if path.is_socket():
                path.unlink()

    async def _serve(self, subject: str, sock: socket.socket, stop: trio.Event) -> None:
        try:
            await serve_unix(self._app, self._http, sock, stop, bound=subject)
        finally:
            sock.close()
