"""Reading one log stream from a byte offset, and following it until its last byte.

A follower ends once the logs are closed (the invocation's output is complete) and
it has read to the end of the file; without `follow` it ends at the current end.
Each read is one worker-thread call of at most READ_CHUNK_BYTES, under a deadline.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncGenerator

import trio

from supervisor.logstore import InvocationLogs

__all__ = ["READ_CHUNK_BYTES", "read_log"]

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 64 * 1024
READ_SECONDS = 10.0
# A follower looks again at least this often, even if it missed nothing.
RECHECK_SECONDS = 5.0


def _open(logs: InvocationLogs, stream: str) -> int | None:
    try:
        return os.open(logs.path(stream), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None


async def read_log(
    logs: InvocationLogs, stream: str, offset: int, *, follow: bool
) -> AsyncGenerator[bytes, None]:
    """The bytes of `stream` from `offset` on; ends at the end (with `follow`: once the
    logs are closed and every byte was read). A failing disk ends it early."""
    fd: int | None = None
    try:
        while True:
            # Taken before reading: a write or a close after this point sets `changed`,
            # and a close before it means the read below sees every byte.
            closed, changed = logs.closed, logs.changed
            data = b""
            with trio.fail_after(READ_SECONDS):
                if fd is None and logs.on_disk(stream):
                    fd = await trio.to_thread.run_sync(_open, logs, stream)
                    if fd is None:
                        return  # removed (evicted, or past its retention)
                if fd is not None:
                    data = await trio.to_thread.run_sync(os.pread, fd, READ_CHUNK_BYTES, offset)
            if data:
                offset += len(data)
                yield data
                continue
            if closed or not follow:
                return
            with trio.move_on_after(RECHECK_SECONDS):
                await changed.wait()
    except (OSError, trio.TooSlowError) as exc:
        log.warning("reading the %s log of %s stopped: %r", stream, logs.id, exc)
    finally:
        if fd is not None:
            os.close(fd)
