"""Our ends of a lane host's stdin and stdout, and the protocol's frames over them.

The pipes are widened and non-blocking; a frame is written whole and a reply
read whole by waiting on the raw descriptors (`lanehost.protocol` frames and
parses). What a missing, short or garbled reply means is for the caller,
`supervisor.lane_host.LaneHost`, to decide.
"""

from __future__ import annotations

import fcntl
import os

import trio

from lanehost.protocol import HEADER, FrameReader, Reply, decode_reply, frame_length
from supervisor.pipe_writes import write_all

__all__ = ["HostPipes"]

_PIPE_BYTES = 1 << 20  # a bigger pipe: fewer wake-ups per megabyte moved


def _widen_pipe(fd: int) -> None:
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except OSError:
        pass  # over /proc/sys/fs/pipe-max-size: the default size still works


class HostPipes:
    """The write end of the host's stdin, the read end of its stdout, and the
    reader that takes replies off it."""

    def __init__(self, to_host: int, from_host: int) -> None:
        for fd in (to_host, from_host):
            _widen_pipe(fd)
            os.set_blocking(fd, False)
        self.to_host = to_host
        self.from_host = from_host
        self.reader = FrameReader(from_host)

    def close(self) -> None:
        """Close both ends; the host sees EOF on its stdin."""
        os.close(self.to_host)
        os.close(self.from_host)

    async def send(self, data: bytes | memoryview) -> None:
        """Write it all; a pipe with room takes a small frame in one write, no wait."""
        await write_all(self.to_host, data)

    async def _read_exact(self, n: int) -> bytearray | memoryview:
        reader = self.reader
        out, got = reader.start(n)
        while got < n:
            try:
                got = reader.read_into(out, got)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(reader.fd)
        return out

    async def receive(self) -> Reply:
        reader = self.reader
        # The reply cannot be here before the host has read the request: wait
        # first (this is the exchange's scheduling checkpoint), then read.
        if reader.pending:
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            await trio.lowlevel.wait_readable(reader.fd)
        length = frame_length(bytes(await self._read_exact(HEADER.size)))
        return decode_reply(await self._read_exact(length))
