"""Bounded fan-out of state-change events to subscribers (e.g. GET /v1/events).

Publishing never waits on a reader. Each subscriber has a memory channel of
`buffer + 1` slots; the extra slot is kept for a final `Dropped` marker. When a
subscriber has `buffer` events queued and another one arrives, it is dropped:
the marker goes into the reserved slot, its channel is closed, and its
iterator ends after yielding the marker. The client then knows it missed
events from `Dropped.missed_from` on and must resynchronise (e.g. from a
snapshot). Subscribers are capped; what exceeds the cap is refused at once
with `TooManySubscribers` (429 at the HTTP edge).

A subscriber that reconnects may resume after the last sequence number it
saw: the hub keeps the last `buffer` events and replays those after it. When
that point is no longer kept (or was never published) the subscription starts
with a `Missed` marker instead, and the client resynchronises. Sequence
numbers restart with each hub; `run` tells one hub's numbers from another's.

Everything is bounded: the subscriber table by `max_subscribers`, each queue
by `buffer + 1`, the replay window by `buffer`.
"""

from __future__ import annotations

import itertools
import secrets
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

import trio

__all__ = ["Dropped", "Envelope", "EventHub", "Missed", "Subscription", "TooManySubscribers"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Envelope(Generic[T]):
    """One published event, stamped with the hub's monotonic sequence number."""

    sequence: int
    event: T


@dataclass(frozen=True, slots=True)
class Dropped:
    """Final item of a subscription that fell `buffer` events behind.

    `missed_from` is the sequence number of the first event not delivered.
    """

    missed_from: int


@dataclass(frozen=True, slots=True)
class Missed:
    """First item of a subscription that asked to resume after `after`, a sequence
    number the hub no longer keeps or never published; live events follow."""

    after: int


class TooManySubscribers(Exception):
    """The hub already has `limit` subscribers; the caller should retry later."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"too many event subscribers (limit {limit})")
        self.limit = limit


Item = Envelope[T] | Dropped | Missed


class Subscription(Generic[T]):
    """Async iterator of envelopes; ends after a `Dropped` marker or when the hub closes."""

    __slots__ = ("_receive",)

    def __init__(self, receive: trio.MemoryReceiveChannel[Item[T]]) -> None:
        self._receive = receive

    def __aiter__(self) -> Subscription[T]:
        return self

    async def __anext__(self) -> Item[T]:
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None


class EventHub(Generic[T]):
    """Fan-out of events to at most `max_subscribers`, each buffering `buffer` events."""

    def __init__(self, max_subscribers: int, buffer: int, *, run: str | None = None) -> None:
        if max_subscribers < 1:
            raise ValueError(f"max_subscribers must be >= 1, got {max_subscribers}")
        if buffer < 1:
            raise ValueError(f"buffer must be >= 1, got {buffer}")
        self._max_subscribers = max_subscribers
        self._buffer = buffer
        self._sequence = 0
        self.run = run or secrets.token_hex(4)  # a label, not a secret
        self._kept: deque[Envelope[T]] = deque(maxlen=buffer)
        self._ids = itertools.count()
        # Open subscribe() contexts; a dropped subscriber keeps its slot (and
        # its queued events) until it leaves, so memory stays within the cap.
        self._slots: set[int] = set()
        # Subscribers still being fed.
        self._live: dict[int, trio.MemorySendChannel[Item[T]]] = {}
        self._closed = False

    @property
    def sequence(self) -> int:
        """Sequence number of the last published event (0 before the first)."""
        return self._sequence

    @property
    def subscriber_count(self) -> int:
        return len(self._slots)

    @property
    def max_subscribers(self) -> int:
        return self._max_subscribers

    @property
    def buffer(self) -> int:
        return self._buffer

    def publish(self, event: T) -> Envelope[T]:
        """Stamp `event` and hand it to every subscriber without waiting; drop laggards."""
        self._sequence += 1
        envelope = Envelope(self._sequence, event)
        self._kept.append(envelope)
        for key, send in list(self._live.items()):
            if send.statistics().current_buffer_used >= self._buffer:
                self._drop(key, Dropped(missed_from=envelope.sequence))
                continue
            try:
                send.send_nowait(envelope)
            except (trio.WouldBlock, trio.BrokenResourceError):
                # Not expected (a slot is reserved; receivers close on leave), but
                # a subscriber we cannot feed is dropped, never waited on.
                self._drop(key, Dropped(missed_from=envelope.sequence))
        return envelope

    def _drop(self, key: int, marker: Dropped) -> None:
        send = self._live.pop(key)
        try:
            send.send_nowait(marker)
        except (trio.WouldBlock, trio.BrokenResourceError):
            pass  # the reader is gone or full; closing the channel still ends it
        send.close()

    def close(self) -> None:
        """End every subscription (their iterators finish); refuse new ones."""
        self._closed = True
        for send in self._live.values():
            send.close()
        self._live.clear()

    def _replay(self, after: int) -> list[Envelope[T]] | None:
        """The kept events after `after`, or None when some of them are not kept."""
        if not 0 <= after <= self._sequence:
            return None
        missing = self._sequence - after
        if missing > len(self._kept):
            return None
        return list(self._kept)[len(self._kept) - missing :]

    @asynccontextmanager
    async def subscribe(self, after: int | None = None) -> AsyncIterator[Subscription[T]]:
        """Receive events published from now on, after replaying the kept ones
        after sequence `after` if given; raises `TooManySubscribers` when full."""
        if self._closed:
            raise trio.ClosedResourceError("event hub is closed")
        if len(self._slots) >= self._max_subscribers:
            raise TooManySubscribers(self._max_subscribers)
        key = next(self._ids)
        send, receive = trio.open_memory_channel[Item[T]](self._buffer + 1)
        if after is not None:
            replay = self._replay(after)
            # At most `buffer` items: they fit, with the marker's slot to spare.
            for item in [Missed(after)] if replay is None else replay:
                send.send_nowait(item)
        self._slots.add(key)
        self._live[key] = send
        try:
            yield Subscription(receive)
        finally:
            self._slots.discard(key)
            live = self._live.pop(key, None)
            if live is not None:
                live.close()
            receive.close()
