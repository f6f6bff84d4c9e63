"""The lane host process: reads request frames on stdin, writes reply frames on stdout.

It serves one request at a time until stdin reaches EOF (its owner closed the
pipe or died), then exits 0. A frame whose declared length is over the bound
breaks the framing: the host answers `frame_too_large` and exits 2. A host
whose backend cannot run (CuPy asked for, or a device named, and CUDA unusable)
answers its first request `cuda_unavailable` with the reason and exits 2,
never serving from host memory instead. A sticky device error is answered
`device_failed`, and the host exits 3: its context is dead, so its owner starts
a fresh host. Logs go to stderr; file descriptor 1 is pointed at stderr too, so
nothing a library prints can land inside the protocol stream.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Sequence

import msgspec

from lanehost.backend import BackendUnavailable, select_backend
from lanehost.kernels import load_kernels
from lanehost.protocol import (
    HEADER,
    EndOfStream,
    ErrorCode,
    ErrorReply,
    FrameError,
    FrameReader,
    Reply,
    decode_request,
    frame,
    frame_length,
)
from lanehost.state import LaneState

__all__ = ["main", "refuse", "serve"]

log = logging.getLogger("lanehost")

EXIT_BROKEN_STREAM = 2
EXIT_BACKEND_UNAVAILABLE = 2
EXIT_DEVICE_FAILED = 3


class _IdOnly(msgspec.Struct):
    """Enough of a request to answer it when the rest fails validation."""

    id: int = 0


def _read_exact(reader: FrameReader, n: int) -> bytearray | memoryview:
    out, got = reader.start(n)
    while got < n:
        got = reader.read_into(out, got)
    return out


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _send(fd: int, reply: Reply) -> None:
    try:
        parts = frame(reply)
    except FrameError as exc:
        parts = frame(ErrorReply(id=reply.id, code="kernel_failed", message=str(exc)))
    for data in parts:
        _write_all(fd, data)


def _answer(state: LaneState, payload: bytearray | memoryview) -> Reply:
    try:
        return state.handle(decode_request(payload))
    except msgspec.ValidationError as exc:
        try:
            request_id = msgspec.msgpack.decode(payload, type=_IdOnly).id
        except msgspec.MsgspecError:
            request_id = 0
        if request_id > 0:
            return ErrorReply(id=request_id, code="bad_args", message=str(exc))
        return ErrorReply(id=0, code="bad_request", message=str(exc))
    except msgspec.DecodeError as exc:
        return ErrorReply(id=0, code="bad_request", message=str(exc))


def serve(in_fd: int, out_fd: int, state: LaneState) -> int:
    """Serve frames until EOF; the exit status."""
    reader = FrameReader(in_fd)
    while True:
        try:
            header = _read_exact(reader, HEADER.size)
        except EndOfStream as exc:
            if exc.args[0] == 0:
                return 0  # the owner closed the pipe between frames
            log.error("stream ended inside a frame header")
            return EXIT_BROKEN_STREAM
        try:
            length = frame_length(bytes(header))
        except FrameError as exc:
            log.error("%s; closing", exc)
            _send(out_fd, ErrorReply(id=0, code="frame_too_large", message=str(exc)))
            return EXIT_BROKEN_STREAM
        try:
            payload = _read_exact(reader, length)
        except EndOfStream:
            log.error("stream ended inside a frame of %d bytes", length)
            return EXIT_BROKEN_STREAM
        _send(out_fd, _answer(state, payload))
        if state.failed is not None:
            log.error("exiting: the device's context is lost (%s)", state.failed)
            return EXIT_DEVICE_FAILED


def refuse(in_fd: int, out_fd: int, code: ErrorCode, message: str) -> int:
    """Answer the first request with `code` and the reason (the host cannot serve:
    its backend is unavailable), then the exit status."""
    reader = FrameReader(in_fd)
    try:
        header = _read_exact(reader, HEADER.size)
        payload = _read_exact(reader, frame_length(bytes(header)))
    except (EndOfStream, FrameError):
        return EXIT_BROKEN_STREAM
    try:
        request_id = msgspec.msgpack.decode(payload, type=_IdOnly).id
    except msgspec.MsgspecError:
        request_id = 0
    _send(out_fd, ErrorReply(id=max(0, request_id), code=code, message=message))
    return EXIT_BACKEND_UNAVAILABLE


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGKILL this host when the owner's thread that started it dies.

    The owner sets this before exec too, but an exec that changes credentials
    or raises capabilities clears it; set here, after exec, it holds. If the
    owner died before this point, stdin is already at EOF and the host exits.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError) as exc:
        log.warning("no parent-death signal: %r", exc)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lanehost", description=__doc__)
    parser.add_argument("--lane-id", required=True)
    parser.add_argument("--memory-bytes", type=int, required=True, help="the lane's budget")
    parser.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto")
    args = parser.parse_args(argv)
    if args.memory_bytes < 0:
        parser.error("--memory-bytes must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"lanehost[{args.lane_id}] %(levelname)s %(name)s: %(message)s",
    )
    # Keep private copies of the protocol pipes, then point 0 at /dev/null and
    # 1 at stderr: a stray print() or a library's banner cannot corrupt a frame.
    _die_with_parent()
    in_fd, out_fd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    try:
        try:
            backend = select_backend(args.backend)
        except BackendUnavailable as exc:
            # Never host memory in place of the device: the owner learns why at its hello.
            log.error("backend %s unavailable: %s", args.backend, exc)
            return refuse(in_fd, out_fd, "cuda_unavailable", str(exc))
        kernels = load_kernels()
        state = LaneState(backend, args.memory_bytes, kernels)
        log.info(
            "serving: backend %s on %s, %d bytes (%d reserved by the host), kernels %s",
            backend.name,
            backend.device,
            args.memory_bytes,
            state.reserved,
            ",".join(sorted(kernels)),
        )
        return serve(in_fd, out_fd, state)
    except BrokenPipeError:
        return 0  # the owner went away while we answered
