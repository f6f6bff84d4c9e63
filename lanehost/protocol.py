"""The lane host protocol, version 1: what the lane owner and its lane host say.

Every message travels as one frame: a 4-byte big-endian unsigned length, then
that many bytes of msgpack (msgspec). A frame's payload is at most
`MAX_FRAME_BYTES` (64 MiB of data plus 64 KiB for the envelope); a longer
declared length is a protocol error on either side and is never allocated.
The owner sends one request and waits for its reply before the next; every
reply carries the id of the request it answers. docs/lane-host-protocol.md
is the prose version of this module.
"""

from __future__ import annotations

import os
import struct
from typing import Annotated, Literal

import msgspec

__all__ = [
    "BUFFER_ID_PATTERN",
    "DTYPES",
    "ERROR_CODES",
    "HEADER",
    "ITEMSIZE",
    "KERNEL_NAME_PATTERN",
    "MAX_ARGS",
    "MAX_BUFFERS",
    "MAX_DATA_BYTES",
    "MAX_DIM",
    "MAX_DIMS",
    "MAX_FRAME_BYTES",
    "MAX_OFFSET",
    "PROTOCOL_VERSION",
    "Alloc",
    "AllocReply",
    "Dtype",
    "EndOfStream",
    "ErrorCode",
    "ErrorReply",
    "FrameError",
    "FrameReader",
    "Free",
    "FreeAll",
    "FreeAllReply",
    "FreeReply",
    "Hello",
    "HelloReply",
    "Read",
    "ReadReply",
    "Reply",
    "Request",
    "Run",
    "RunReply",
    "Scalar",
    "Stats",
    "StatsReply",
    "Write",
    "WriteReply",
    "decode_reply",
    "decode_request",
    "encode",
    "frame",
    "frame_length",
    "joined",
]

PROTOCOL_VERSION = 1

HEADER = struct.Struct(">I")
MAX_DATA_BYTES = 64 * 1024 * 1024  # one Write's data or one Read's length
MAX_FRAME_BYTES = MAX_DATA_BYTES + 64 * 1024  # payload bound; the header is 4 more bytes
MAX_BUFFERS = 4096  # live buffers per lane, as the lane owner bounds them
MAX_DIMS = 8
MAX_DIM = 2**40  # one dimension of a buffer's shape
MAX_OFFSET = 2**62  # a byte offset into a buffer
MAX_ARGS = 32  # scalar args, and named buffers, per Run

BUFFER_ID_PATTERN = r"^[A-Za-z0-9_]{1,64}$"
KERNEL_NAME_PATTERN = r"^[a-z][a-z0-9_]{0,63}$"

Dtype = Literal["float32", "float16", "float64", "int32", "int64", "uint8"]
DTYPES: tuple[str, ...] = ("float32", "float16", "float64", "int32", "int64", "uint8")
# Bytes per element of each dtype (known without importing NumPy).
ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "float64": 8,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
}

ErrorCode = Literal[
    "bad_request",  # the frame did not decode as a request
    "unsupported_version",  # Hello named a version this host does not speak
    "frame_too_large",  # a declared length over MAX_FRAME_BYTES; the host then exits
    "bad_args",
    "unknown_buffer",
    "unknown_kernel",
    "out_of_range",
    "out_of_memory",
    "too_many_buffers",
    "dtype_mismatch",
    "shape_mismatch",
    "kernel_failed",
    # Hello refused: the host was given a CUDA device and cannot run CUDA kernels on
    # it (no CuPy, no driver, a missing cuBLAS or NVRTC); it exits, never serving
    # the lane from host memory instead.
    "cuda_unavailable",
    # A sticky device error (after it the CUDA context is dead and every later call
    # fails): the request's work is lost, and the host exits after this reply.
    "device_failed",
]
ERROR_CODES: tuple[str, ...] = ErrorCode.__args__  # type: ignore[attr-defined]

_Id = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
_BufferId = Annotated[str, msgspec.Meta(pattern=BUFFER_ID_PATTERN)]
_Offset = Annotated[int, msgspec.Meta(ge=0, le=MAX_OFFSET)]
_Dim = Annotated[int, msgspec.Meta(ge=1, le=MAX_DIM)]
_Bytes = Annotated[int, msgspec.Meta(ge=0)]
Scalar = bool | int | float


class _Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


# -- requests (tag field "op") -------------------------------------------------


class Hello(_Message, frozen=True, tag="hello", tag_field="op"):
    """First request on a fresh host; anything else before it is refused."""

    id: _Id
    version: int


class Alloc(_Message, frozen=True, tag="alloc", tag_field="op"):
    """A zeroed buffer of prod(shape) * itemsize bytes, charged to the lane's budget."""

    id: _Id
    buffer_id: _BufferId
    dtype: Dtype
    shape: Annotated[tuple[_Dim, ...], msgspec.Meta(min_length=1, max_length=MAX_DIMS)]


class Free(_Message, frozen=True, tag="free", tag_field="op"):
    id: _Id
    buffer_id: _BufferId


class FreeAll(_Message, frozen=True, tag="free_all", tag_field="op"):
    """Frees the listed buffers; ids the host does not hold are skipped."""

    id: _Id
    buffer_ids: Annotated[list[_BufferId], msgspec.Meta(max_length=MAX_BUFFERS)]


class Write(_Message, frozen=True, tag="write", tag_field="op"):
    """Copies `data` into the buffer's bytes starting at byte `offset`."""

    id: _Id
    buffer_id: _BufferId
    offset: _Offset
    # A view into the received frame: the host copies it once, into the buffer.
    data: Annotated[memoryview, msgspec.Meta(max_length=MAX_DATA_BYTES)]


class Read(_Message, frozen=True, tag="read", tag_field="op"):
    id: _Id
    buffer_id: _BufferId
    offset: _Offset
    length: Annotated[int, msgspec.Meta(ge=0, le=MAX_DATA_BYTES)]


class Run(_Message, frozen=True, tag="run", tag_field="op"):
    """Runs a trusted kernel from the host's registry, by name."""

    id: _Id
    kernel: Annotated[str, msgspec.Meta(pattern=KERNEL_NAME_PATTERN)]
    args: Annotated[dict[str, Scalar], msgspec.Meta(max_length=MAX_ARGS)] = msgspec.field(
        default_factory=dict
    )
    buffers: Annotated[dict[str, _BufferId], msgspec.Meta(max_length=MAX_ARGS)] = msgspec.field(
        default_factory=dict
    )


class Stats(_Message, frozen=True, tag="stats", tag_field="op"):
    id: _Id


Request = Hello | Alloc | Free | FreeAll | Write | Read | Run | Stats


# -- replies (tag field "reply") -----------------------------------------------


class HelloReply(_Message, frozen=True, tag="hello", tag_field="reply"):
    id: _Id
    version: int
    backend: Literal["numpy", "cupy"]
    device: str  # "host" for NumPy; the device's name and UUID for CuPy
    memory_total: _Bytes  # the lane's budget, --memory-bytes
    kernels: list[str]
    # Of the budget, the device memory the host holds for itself, measured at its
    # start (its CUDA context, cuBLAS's workspace; 0 on NumPy): its buffers and
    # their temporaries get the rest.
    memory_reserved: _Bytes = 0


class AllocReply(_Message, frozen=True, tag="alloc", tag_field="reply"):
    id: _Id
    buffer_id: str
    nbytes: _Bytes


class FreeReply(_Message, frozen=True, tag="free", tag_field="reply"):
    id: _Id
    nbytes: _Bytes


class FreeAllReply(_Message, frozen=True, tag="free_all", tag_field="reply"):
    id: _Id
    freed: _Bytes  # buffers freed
    nbytes: _Bytes  # bytes given back to the budget


class WriteReply(_Message, frozen=True, tag="write", tag_field="reply"):
    id: _Id
    nbytes: _Bytes


class ReadReply(_Message, frozen=True, tag="read", tag_field="reply"):
    id: _Id
    data: memoryview  # encoded straight from the buffer; decoded as a view of the frame


class RunReply(_Message, frozen=True, tag="run", tag_field="reply"):
    id: _Id
    result: dict[str, Scalar]


class StatsReply(_Message, frozen=True, tag="stats", tag_field="reply"):
    id: _Id
    used: _Bytes
    free: _Bytes  # total - reserved - used
    total: _Bytes
    buffers: _Bytes
    reserved: _Bytes = 0  # HelloReply.memory_reserved


class ErrorReply(_Message, frozen=True, tag="error", tag_field="reply"):
    """The request failed and changed nothing (except `kernel_failed` and
    `device_failed`: see the docs).

    `id` is 0 when the frame could not be read as a request at all.
    """

    id: Annotated[int, msgspec.Meta(ge=0)]
    code: ErrorCode
    message: str


Reply = (
    HelloReply
    | AllocReply
    | FreeReply
    | FreeAllReply
    | WriteReply
    | ReadReply
    | RunReply
    | StatsReply
    | ErrorReply
)


# -- framing -------------------------------------------------------------------


class FrameError(Exception):
    """A frame that breaks the framing: one received that way means the stream can
    no longer be trusted; one that would be sent that way (over the bound, or a
    value msgpack cannot carry) is refused before a byte of it is written."""


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


# What msgspec raises for a value msgpack cannot carry: an int outside
# [-2**63, 2**64 - 1], an unsupported type, a structure nested too deep.
_UNENCODABLE = (msgspec.EncodeError, OverflowError, RecursionError, TypeError, ValueError)


def _payload(message: Request | Reply) -> bytes:
    try:
        return _encoder.encode(message)
    except _UNENCODABLE as exc:
        raise FrameError(f"the message does not encode: {exc}") from None


def encode(message: Request | Reply) -> tuple[bytes, bytes]:
    """(header, payload) of one frame; FrameError if the payload is over the bound
    or does not encode."""
    payload = _payload(message)
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(payload)} bytes is over {MAX_FRAME_BYTES}")
    return HEADER.pack(len(payload)), payload


def frame_length(header: bytes) -> int:
    """The payload length a header declares; FrameError over the bound."""
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"declared frame of {length} bytes is over {MAX_FRAME_BYTES}")
    return int(length)


def decode_request(payload: bytes | bytearray | memoryview) -> Request:
    """msgspec.ValidationError / DecodeError on a payload that is not a request."""
    return _request_decoder.decode(payload)


def decode_reply(payload: bytes | bytearray | memoryview) -> Reply:
    return _reply_decoder.decode(payload)


SMALL_READ = 64 * 1024  # below this, read a whole chunk: one syscall for a small frame


class EndOfStream(Exception):
    """The peer closed its end; `args[0]` is how many bytes of the read had arrived."""


class FrameReader:
    """Reads exact byte counts from a pipe with few syscalls, for both ends.

    A small read takes a whole chunk and keeps what is past the frame for the
    next one; a large one reads straight into the frame's own buffer. Blocking
    or not is the fd's: a non-blocking one raises BlockingIOError to wait on.

    A large frame's buffer is kept for the next large frame (it is at most
    MAX_FRAME_BYTES): a fresh one costs a page fault per page each time, which
    was most of a large Read. So a large frame is a view that the next frame
    overwrites; callers are done with it (decoded and copied out) by then.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._pending = bytearray()  # bytes read past the end of the last frame
        self._large = bytearray()  # the buffer large frames are read into

    @property
    def pending(self) -> int:
        """Bytes already read past the last frame."""
        return len(self._pending)

    def start(self, n: int) -> tuple[bytearray | memoryview, int]:
        """A buffer for n bytes, holding what is already here, and how many that is."""
        out: bytearray | memoryview
        if n < SMALL_READ:
            out = bytearray(n)
        else:
            if len(self._large) < n:
                self._large = bytearray(n)
            out = memoryview(self._large)[:n]
        got = min(n, len(self._pending))
        out[:got] = self._pending[:got]
        del self._pending[:got]
        return out, got

    def read_into(self, out: bytearray | memoryview, got: int) -> int:
        """One read towards filling `out`; the new count of bytes in it."""
        view = memoryview(out)[got:]
        if len(view) >= SMALL_READ:
            count = os.readv(self.fd, [view])
            if count == 0:
                raise EndOfStream(got)
            return got + count
        chunk = os.read(self.fd, SMALL_READ)
        if not chunk:
            raise EndOfStream(got)
        take = min(len(chunk), len(view))
        view[:take] = chunk[:take]
        self._pending += chunk[take:]
        return got + take


def joined(header: bytes, payload: bytes) -> list[bytes]:
    """What to write for one frame: one write when small, no copy of a large payload."""
    return [header + payload] if len(payload) < SMALL_READ else [header, payload]


_EMPTY_BIN = b"\xc4\x00"  # msgpack bin8 of length 0
_BIN32 = struct.Struct(">BI")  # msgpack bin32: 0xc6, then the length


def frame(message: Request | Reply) -> list[bytes | memoryview]:
    """What to write for one frame; FrameError over the bound or for a message that
    does not encode. A large `Write` or
    `ReadReply` is not copied into its payload: the message is encoded with empty
    data (its last field), whose bin header becomes a bin32 one, and the data
    follows as a piece of its own. The bytes decode as `encode` would give them."""
    if not isinstance(message, (Write, ReadReply)) or message.data.nbytes < SMALL_READ:
        return list(joined(*encode(message)))
    data = message.data.cast("B") if message.data.format != "B" else message.data
    head = _payload(msgspec.structs.replace(message, data=memoryview(b"")))
    assert head.endswith(_EMPTY_BIN), "data is the last field"
    head = head[: -len(_EMPTY_BIN)] + _BIN32.pack(0xC6, data.nbytes)
    length = len(head) + data.nbytes
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {length} bytes is over {MAX_FRAME_BYTES}")
    return [HEADER.pack(length) + head, data]
