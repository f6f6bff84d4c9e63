"""Writing all of a buffer to a non-blocking pipe without blocking the event loop."""

from __future__ import annotations

import os

import trio

__all__ = ["write_all"]


async def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write it all to `fd` (non-blocking); a pipe with room takes it in one write, no wait."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(fd)
