"""A floor under the free space of the state folder's filesystem (`--state-min-free`).

The journal shares its disk with everything else the node writes there (the
invocation logs above all). Those other writers ask this module first whether n
more bytes may go to the disk: yes while free space minus n stays at or above
the floor, so the journal always finds room.

Free space is `f_bavail * f_frsize` of `os.statvfs` (what an unprivileged writer
may use: root's reserved blocks never count), read at most every `max_age`
seconds of a monotonic clock, so asking costs no system call per chunk. Bytes
granted since the reading are counted against it, and so are bytes granted
before it whose writes had not yet ended when it was taken (they may not be in
it): a burst between two readings cannot pass the floor. What other writers
(the journal, other processes) use is seen at the next reading only.

`allows(n)` is the whole answer for a caller that may block (a worker thread).
On the event loop: `stale()`, then `read()` in a thread when it is, then
`room()` and `reserve(n)`, which never block. Either way `done(n)` once the
granted bytes are written (or failed). Thread-safe. A floor of 0 grants
everything and never reads.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

__all__ = ["READING_SECONDS", "DiskFloor", "FreeSpace"]

# How long one statvfs reading is trusted.
READING_SECONDS = 1.0


class FreeSpace(Protocol):
    """What is read of `os.statvfs_result`."""

    @property
    def f_bavail(self) -> int: ...

    @property
    def f_frsize(self) -> int: ...


class DiskFloor:
    """Whether more bytes may be written to the filesystem of `path` and still leave
    `floor` bytes free."""

    def __init__(
        self,
        path: Path,
        floor: int,
        *,
        statvfs: Callable[[Path], FreeSpace] = os.statvfs,
        clock: Callable[[], float] = time.monotonic,
        max_age: float = READING_SECONDS,
    ) -> None:
        self.path = path
        self.floor = floor
        self._statvfs = statvfs
        self._clock = clock
        self._max_age = max_age
        self._lock = threading.Lock()
        self._free: int | None = None  # bytes free at the last reading
        self._block = 1  # the filesystem's allocation unit (f_frsize)
        self._read_at = 0.0
        self._spent = 0  # granted and possibly not in the reading
        self._pending = 0  # granted, not yet written
        self._granted = 0  # every byte ever granted (a reading's baseline)

    @property
    def enabled(self) -> bool:
        return self.floor > 0

    @property
    def block(self) -> int:
        """Bytes of one allocation unit (1 until the first reading)."""
        return self._block

    def stale(self) -> bool:
        """A reading is due (none yet, or older than `max_age`)."""
        if not self.enabled:
            return False
        with self._lock:
            return self._free is None or self._clock() - self._read_at >= self._max_age

    def read(self) -> None:
        """Take a reading now (a system call that a stuck disk can stall: off the event
        loop). OSError propagates and the previous reading stays."""
        with self._lock:
            pending, granted = self._pending, self._granted
        info = self._statvfs(self.path)
        at = self._clock()
        with self._lock:
            self._free = info.f_bavail * info.f_frsize
            self._block = max(1, info.f_frsize)
            self._read_at = at
            # Bytes still being written when it was taken, and those granted since.
            self._spent = pending + self._granted - granted

    def room(self) -> int:
        """Bytes that may still be granted (0 before the first reading)."""
        if not self.enabled:
            return sys.maxsize
        with self._lock:
            return self._room()

    def _room(self) -> int:
        if self._free is None:
            return 0
        return max(0, self._free - self.floor - self._spent)

    def reserve(self, n: int) -> bool:
        """Grant `n` bytes (True) if they fit above the floor, else grant nothing."""
        if not self.enabled:
            return True
        with self._lock:
            if n > self._room():
                return False
            self._spent += n
            self._pending += n
            self._granted += n
            return True

    def allows(self, n: int) -> bool:
        """May `n` more bytes be written? Reads first when the reading is stale (so it
        may block); granted bytes count until `done(n)`."""
        if self.stale():
            self.read()
        return self.reserve(n)

    def done(self, n: int) -> None:
        """`n` granted bytes were written (or never will be)."""
        if not self.enabled or n <= 0:
            return
        with self._lock:
            self._pending = max(0, self._pending - n)
