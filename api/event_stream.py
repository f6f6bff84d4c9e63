"""`GET /v1/events` as server-sent events: ids to resume from, heartbeats, resyncs.

Each event's id is `<run>-<sequence>`, so a client that reconnects with
`Last-Event-ID` resumes right after it, out of the hub's replay window. An id
from another run of the daemon, a malformed one, or one that fell out of the
window gets a `resync` event first: the client re-reads `GET /v1/snapshot`,
and the stream goes on live. A quiet stream carries a heartbeat comment every
few seconds, so neither side takes it for dead; `retry:` tells an EventSource
how long to wait before reconnecting. `?ids=a,b` keeps only the events of those
invocations.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import msgspec
import trio

from supervisor.events import Dropped, EventHub, Missed, Subscription
from supervisor.wire import INVOCATION_ID, MAX_BATCH, NodeEvent

__all__ = ["HEARTBEAT_SECONDS", "RETRY_MILLIS", "event_frames", "only_ids", "resume_point"]

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


def only_ids(raw: str | None) -> frozenset[str] | None:
    """`?ids=a,b`: the invocations a stream is filtered to (None: every event). Raises
    ValueError for more than MAX_BATCH ids or one that is not an invocation id."""
    if raw is None:
        return None
    ids = frozenset(raw.split(","))
    if not ids or len(ids) > MAX_BATCH or not all(INVOCATION_ID.match(i) for i in ids):
        raise ValueError(f"ids: 1 to {MAX_BATCH} invocation ids, separated by commas")
    return ids


def _wanted(event: NodeEvent, only: frozenset[str] | None) -> bool:
    return only is None or (event.invocation is not None and event.invocation.id in only)


async def event_frames(
    hub: EventHub[NodeEvent],
    stream: Subscription[NodeEvent],
    heartbeat: float,
    only: frozenset[str] | None = None,
) -> AsyncGenerator[bytes, None]:
    """The stream's bytes; ends when the subscriber is dropped or the hub closes. With
    `only`, just the invocation and admission events of those ids (resyncs, drops and
    heartbeats as always)."""
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
        elif _wanted(item.event, only):
            data = msgspec.json.encode(item.event)
            head = f"id: {hub.run}-{item.sequence}\nevent: {item.event.kind.value}\n"
            yield head.encode() + b"data: " + data + b"\n\n"
