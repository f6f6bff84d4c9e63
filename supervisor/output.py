"""Bounded capture of a child's stdout or stderr.

A child can write without end; the daemon keeps only the newest `max_bytes`
of each stream and counts what it let go, so memory stays bounded and the
caller can say honestly that output was cut.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

__all__ = ["READ_CHUNK_BYTES", "OutputRing", "Sink", "pump"]

# One read from the pipe; also the largest chunk handed to a sink.
READ_CHUNK_BYTES = 64 * 1024
# Where every chunk goes besides the ring (the invocation's log file); awaited, so a
# slow sink slows the reads and the child waits on its full pipe.
Sink = Callable[[bytes], Awaitable[None]]


class OutputRing:
    """The last `max_bytes` bytes written, plus counts of all and dropped bytes."""

    __slots__ = ("_buffer", "_dropped", "_max", "_tail", "_total")

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self._max = max_bytes
        self._buffer = bytearray()
        self._total = 0
        self._dropped = 0
        self._tail: tuple[int, int, str] = (0, 0, "")  # (total, chars, text) last returned

    @property
    def max_bytes(self) -> int:
        return self._max

    @property
    def total_bytes(self) -> int:
        """Every byte ever written, kept or not."""
        return self._total

    @property
    def dropped_bytes(self) -> int:
        """Bytes written but no longer kept (the oldest ones)."""
        return self._dropped

    def write(self, data: bytes) -> None:
        size = len(data)
        self._total += size
        if size >= self._max:
            # The new data alone fills the ring: keep its tail only.
            self._dropped += len(self._buffer) + size - self._max
            self._buffer = bytearray(data[size - self._max :]) if self._max else bytearray()
            return
        self._buffer += data
        excess = len(self._buffer) - self._max
        if excess > 0:
            del self._buffer[:excess]
            self._dropped += excess

    def getvalue(self) -> bytes:
        return bytes(self._buffer)

    def text(self) -> str:
        # The cut can land inside a multi-byte character: replace, never fail.
        return self._buffer.decode("utf-8", errors="replace")

    def tail(self, chars: int) -> str:
        """The last `chars` characters of `text()`; decoded again only after a write
        (every status read asks for it)."""
        total, asked, text = self._tail
        if total != self._total or asked != chars:
            text = self.text()[-chars:] if chars else ""
            self._tail = (self._total, chars, text)
        return text

    def __len__(self) -> int:
        return len(self._buffer)


async def pump(
    stream: trio.abc.ReceiveStream,
    ring: OutputRing,
    sink: Sink | None = None,
) -> None:
    """Copy `stream` into `ring` (and `sink`) until EOF.

    No deadline here on purpose: the caller owns the stream's lifetime (it ends
    the child, which closes the pipe) and cancels the pump if that fails.
    """
    while True:
        received = await stream.receive_some(READ_CHUNK_BYTES)
        if not received:
            return
        chunk = bytes(received)  # no copy when it is bytes already
        ring.write(chunk)
        if sink is not None:
            await sink(chunk)
