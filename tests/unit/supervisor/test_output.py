"""OutputRing keeps the newest bytes within its bound; pump copies until EOF."""

from __future__ import annotations

import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from supervisor.output import OutputRing, pump


def test_keeps_everything_below_the_bound() -> None:
    ring = OutputRing(10)
    ring.write(b"abc")
    ring.write(b"def")
    assert ring.getvalue() == b"abcdef"
    assert ring.total_bytes == 6
    assert ring.dropped_bytes == 0


def test_keeps_only_the_newest_bytes() -> None:
    ring = OutputRing(4)
    ring.write(b"abc")
    ring.write(b"defg")
    assert ring.getvalue() == b"defg"
    assert ring.total_bytes == 7
    assert ring.dropped_bytes == 3
    ring.write(b"0123456789")
    assert ring.getvalue() == b"6789"
    assert ring.dropped_bytes == 13


def test_zero_capacity_drops_everything() -> None:
    ring = OutputRing(0)
    ring.write(b"abc")
    assert ring.getvalue() == b""
    assert (ring.total_bytes, ring.dropped_bytes) == (3, 3)


def test_text_replaces_a_character_cut_in_half() -> None:
    ring = OutputRing(3)
    ring.write("é".encode() + b"xy")  # b"\xc3\xa9xy": the cut leaves a lone \xa9
    assert ring.text() == "\ufffdxy"


@given(st.integers(min_value=0, max_value=64), st.lists(st.binary(max_size=100), max_size=20))
def test_matches_the_tail_of_everything_written(limit: int, chunks: list[bytes]) -> None:
    ring = OutputRing(limit)
    for chunk in chunks:
        ring.write(chunk)
    everything = b"".join(chunks)
    assert ring.getvalue() == (everything[-limit:] if limit else b"")
    assert ring.total_bytes == len(everything)
    assert ring.dropped_bytes == len(everything) - len(ring.getvalue())
    assert len(ring) <= limit


@given(
    st.integers(min_value=0, max_value=64),
    st.integers(min_value=0, max_value=70),
    st.lists(st.binary(max_size=40), max_size=10),
)
def test_tail_is_always_the_tail_of_the_current_text(
    limit: int, chars: int, chunks: list[bytes]
) -> None:
    # Every status read asks for the tail; it is decoded once per write, never stale.
    ring = OutputRing(limit)
    for chunk in chunks:
        ring.write(chunk)
        assert ring.tail(chars) == (ring.text()[-chars:] if chars else "")
        assert ring.tail(chars) == (ring.text()[-chars:] if chars else "")


async def test_pump_reads_until_eof_and_reports_chunks() -> None:
    send, receive = trio.testing.memory_stream_one_way_pair()
    ring = OutputRing(5)
    seen: list[bytes] = []

    async def sink(chunk: bytes) -> None:
        seen.append(chunk)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump, receive, ring, sink)
        await send.send_all(b"hello ")
        await send.send_all(b"world")
        await send.aclose()
    assert ring.getvalue() == b"world"
    assert b"".join(seen) == b"hello world"
    assert ring.total_bytes == 11


async def test_pump_without_callback() -> None:
    send, receive = trio.testing.memory_stream_one_way_pair()
    ring = OutputRing(100)
    await send.send_all(b"data")
    await send.aclose()
    await pump(receive, ring)
    assert ring.text() == "data"
