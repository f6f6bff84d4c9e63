"""systemd readiness notification (Type=notify): READY=1 / STOPPING=1 to NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket

__all__ = ["notify"]


def notify(state: str, environ: dict[str, str] | None = None) -> bool:
    """Send `state` to $NOTIFY_SOCKET; False when not under systemd. Never blocks."""
    env = os.environ if environ is None else environ
    address = env.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):  # abstract socket namespace
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        try:
            sock.sendto(state.encode(), address)
        except OSError:
            return False
    return True
