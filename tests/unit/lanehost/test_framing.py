"""Framing large data: no copy of it into the frame, one receive buffer for all."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from lanehost.host import _send
from lanehost.protocol import (
    HEADER,
    MAX_DATA_BYTES,
    SMALL_READ,
    ErrorReply,
    FrameError,
    FrameReader,
    ReadReply,
    Run,
    RunReply,
    Write,
    decode_reply,
    decode_request,
    encode,
    frame,
    frame_length,
)


def _joined(parts: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(part) for part in parts)


@pytest.mark.parametrize("size", [0, 100, SMALL_READ - 1, SMALL_READ, 3 * SMALL_READ + 5])
def test_a_frame_decodes_as_the_encoded_message_and_large_data_is_not_copied(size: int) -> None:
    data = np.arange(size, dtype=np.uint8)
    for message in (
        Write(id=3, buffer_id="b", offset=7, data=memoryview(data)),
        ReadReply(id=4, data=memoryview(data)),
    ):
        parts = frame(message)
        raw = _joined(parts)
        assert frame_length(raw[: HEADER.size]) == len(raw) - HEADER.size
        decode = decode_request if isinstance(message, Write) else decode_reply
        got = decode(raw[HEADER.size :])
        assert got.id == message.id and bytes(got.data) == data.tobytes()
        if size < SMALL_READ:
            assert raw == b"".join(encode(message))  # small: exactly the encoded frame
        else:
            assert np.shares_memory(np.frombuffer(parts[-1], np.uint8), data)
    small = Run(id=5, kernel="noop")
    assert _joined(frame(small)) == b"".join(encode(small))


def test_a_frame_over_the_bound_is_refused() -> None:
    with pytest.raises(FrameError):
        frame(ReadReply(id=1, data=memoryview(bytes(MAX_DATA_BYTES + 64 * 1024 + 1))))


def test_large_frames_are_read_into_one_kept_buffer() -> None:
    read_fd, write_fd = os.pipe()
    payloads = [os.urandom(3 * SMALL_READ), os.urandom(2 * SMALL_READ), b"small"]

    def writer() -> None:
        for payload in payloads:
            os.write(write_fd, HEADER.pack(len(payload)) + payload)
        os.close(write_fd)

    thread = threading.Thread(target=writer)
    thread.start()
    reader = FrameReader(read_fd)
    buffers = []
    try:
        for payload in payloads:
            out, got = reader.start(HEADER.size)
            while got < HEADER.size:
                got = reader.read_into(out, got)
            length = frame_length(bytes(out))
            out, got = reader.start(length)
            while got < length:
                got = reader.read_into(out, got)
            assert bytes(out) == payload
            buffers.append(out)
    finally:
        thread.join()
        os.close(read_fd)
    first, second, small = buffers
    assert isinstance(first, memoryview) and isinstance(second, memoryview)
    assert first.obj is second.obj  # the second large frame reused the first one's memory
    assert isinstance(small, bytearray)


@pytest.mark.parametrize(
    "message",
    [
        Run(id=5, kernel="noop", args={"x": 2**70}),
        Run(id=5, kernel="noop", args={"x": object()}),  # type: ignore[dict-item]
        RunReply(id=5, result={"v": -(2**64)}),
        Write(id=5, buffer_id="b", offset=2**64, data=memoryview(bytes(SMALL_READ))),
    ],
    ids=["2**70", "an object", "-2**64", "a large write at 2**64"],
)
def test_a_message_msgpack_cannot_carry_is_a_frame_error_and_nothing_is_written(
    message: Run | RunReply | Write,
) -> None:
    with pytest.raises(FrameError, match="does not encode"):
        encode(message)
    with pytest.raises(FrameError, match="does not encode"):
        frame(message)


def test_a_kernel_result_msgpack_cannot_carry_is_answered_kernel_failed() -> None:
    """A plugin kernel's result of 2**70 once raised out of the host's reply and
    ended the host, and every tenant's buffers in it; now the request fails alone."""
    read_end, write_end = os.pipe()
    try:
        _send(write_end, RunReply(id=5, result={"v": 2**70}))
        raw = os.read(read_end, 65536)
    finally:
        os.close(read_end)
        os.close(write_end)
    reply = decode_reply(raw[HEADER.size :])
    assert frame_length(raw[: HEADER.size]) == len(raw) - HEADER.size
    assert isinstance(reply, ErrorReply) and (reply.id, reply.code) == (5, "kernel_failed")
