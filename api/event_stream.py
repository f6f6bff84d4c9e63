"""`GET /v1/events` as server-sent events: ids to resume from, heartbeats, resyncs.

Each event's id is `<run>-<sequence>`, so a client that reconnects with
`Last-Event-ID` resumes right after it, out of the hub's replay window. An id
from another run of the daemon, a malformed one, or one that fell out of the
window gets a `resync` event first: the client re-reads `GET /v1/snapshot`,
and the stream goes on live. A quiet stream carries a heartbeat comment every
few seconds, so neither side takes it for dead; `retry:` tells an EventSource
how long to wait before reconnecting.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import msgspec
import trio

from supervisor.events import Dropped, EventHub, Missed, Subscription
from supervisor.wire import NodeEvent

__all__ = ["HEARTBEAT_SECONDS", "RETRY_MILLIS", "event_frames", "resume_point"]

HEARTBEAT_SECONDS = 5.0
RETRY_MILLIS = 2000


def resume_point(hub: EventHub[NodeEvent], last_event_id: str | None) -> int | None:
    """The sequence number to resume after: None for a fresh stream, -1 (never
    kept) for an id this run did not give out."""
    if last_event_id is None:
        return None
    run, _, sequence = last_event_id.strip().rpartition("-")
    if run != hub.run or not sequence.isdigit() or len(sequence) > 18:
        return -1
    return int(sequence)


def _resync(reason: str) -> bytes:
    data = msgspec.json.encode({"reason": reason, "snapshot": "/v1/snapshot"})
    return b"event: resync\ndata: " + data + b"\n\n"


async def event_frames(
    hub: EventHub[NodeEvent], stream: Subscription[NodeEvent], heartbeat: float
) -> AsyncGenerator[bytes, None]:
    """The stream's bytes; ends when the subscriber is dropped or the hub closes."""
    yield f"retry: {RETRY_MILLIS}\n: connected\n\n".encode()
    while True:
        item = None
        with trio.move_on_after(heartbeat):
            try:
                item = await stream.__anext__()
            except StopAsyncIteration:
                return
        if item is None:
            yield b": heartbeat\n\n"
        elif isinstance(item, Dropped):
            data = msgspec.json.encode({"missed_from": item.missed_from})
            yield b"event: dropped\ndata: " + data + b"\n\n"
            return
        elif isinstance(item, Missed):
            yield _resync("not_kept")
        else:
            data = msgspec.json.encode(item.event)
            head = f"id: {hub.run}-{item.sequence}\nevent: {item.event.kind.value}\n"
            yield head.encode() + b"data: " + data + b"\n\n"
