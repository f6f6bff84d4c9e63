"""Room kept back on the state folder's filesystem for the journal alone.

A file of `size` bytes, preallocated (posix_fallocate: the blocks are the
file's, not just promised), as write-ahead logs preallocate their segments.
When the disk is full, giving it back (`release`, it is truncated to nothing)
frees exactly that room, at once, for the write that needs it: the end of
work already acknowledged, or the daemon's own start-up files after a restart
on a full disk. `restore` takes the room again once the filesystem has it.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from machine.journal_errors import check_safe

__all__ = ["RESERVE_BYTES", "RESERVE_SUFFIX", "DiskReserve"]

RESERVE_SUFFIX = ".reserve"
# About 20,000 invocations' endings (release, process end, outcome: ~800 bytes).
RESERVE_BYTES = 16 << 20


class DiskReserve:
    def __init__(self, path: Path, size: int = RESERVE_BYTES) -> None:
        self.path = path
        self.size = size
        self.held = False  # whether the room is the reserve's (restored since released)

    def release(self) -> bool:
        """Give the room back to the filesystem; whether there was any to give."""
        self.held = False
        try:
            # O_NONBLOCK: a FIFO planted here is refused (not regular), not waited on.
            fd = os.open(self.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            check_safe(self.path, os.fstat(fd))
            had = os.fstat(fd).st_blocks > 0
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)
        return had

    def restore(self) -> None:
        """Take the room back (creating the file 0600); raises OSError (ENOSPC: not
        there yet), leaving the file empty rather than partly allocated. A size of 0
        keeps no room: the reserve is never held."""
        if self.size <= 0:
            return
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(self.path, flags, 0o600)
        try:
            check_safe(self.path, os.fstat(fd))
            try:
                free = os.statvfs(self.path.parent)
                if free.f_bavail * free.f_frsize + os.fstat(fd).st_blocks * 512 < self.size:
                    # Not there yet: asked before allocating, which would take every
                    # free block from other writers until it failed.
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                os.posix_fallocate(fd, 0, self.size)
                os.fsync(fd)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)  # what it got is free again for the journal
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    free = os.statvfs(self.path.parent)
                    raise OSError(
                        errno.ENOSPC,
                        f"no room to preallocate the journal's reserve ({self.size >> 20} MiB; "
                        f"{free.f_bavail * free.f_frsize >> 20} MiB free)",
                        str(self.path),
                    ) from None
                raise
        finally:
            os.close(fd)
        self.held = True
