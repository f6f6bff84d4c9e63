"""EventHub: bounded fan-out, laggards dropped with a marker, capped subscribers."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from supervisor.events import (
    Dropped,
    Envelope,
    EventHub,
    Missed,
    Subscription,
    TooManySubscribers,
)


async def _collect(sub: Subscription[int], into: list[Envelope[int] | Dropped]) -> None:
    async for item in sub:
        into.append(item)


async def test_slow_subscriber_is_dropped_while_a_fast_one_gets_everything() -> None:
    hub: EventHub[int] = EventHub(max_subscribers=4, buffer=3)
    fast: list[Envelope[int] | Dropped] = []
    slow: list[Envelope[int] | Dropped] = []
    async with hub.subscribe() as fast_sub, hub.subscribe() as slow_sub:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_collect, fast_sub, fast)
            await trio.testing.wait_all_tasks_blocked()
            for value in range(10):
                hub.publish(value)
                # The fast reader keeps up; the slow one never reads meanwhile.
                await trio.testing.wait_all_tasks_blocked()
            hub.close()
        await _collect(slow_sub, slow)
    assert fast == [Envelope(n + 1, n) for n in range(10)]
    # The slow one got its buffer's worth, then the marker naming the first miss.
    assert slow == [Envelope(1, 0), Envelope(2, 1), Envelope(3, 2), Dropped(missed_from=4)]


async def test_dropped_subscription_ends_after_the_marker() -> None:
    hub: EventHub[str] = EventHub(max_subscribers=1, buffer=1)
    async with hub.subscribe() as sub:
        hub.publish("a")
        hub.publish("b")  # buffer full: dropped
        hub.publish("c")  # not delivered anywhere, no error
        items = [item async for item in sub]
    assert items == [Envelope(1, "a"), Dropped(missed_from=2)]
    assert hub.sequence == 3


async def test_subscriber_cap_refuses_at_once_and_leaving_frees_a_slot() -> None:
    hub: EventHub[int] = EventHub(max_subscribers=2, buffer=4)
    async with hub.subscribe(), hub.subscribe():
        assert hub.subscriber_count == 2
        with pytest.raises(TooManySubscribers) as info:
            async with hub.subscribe():
                pass  # pragma: no cover
        assert info.value.limit == 2
    assert hub.subscriber_count == 0
    async with hub.subscribe() as sub:
        hub.publish(7)
        assert await sub.__anext__() == Envelope(1, 7)


async def test_dropped_subscriber_keeps_its_slot_until_it_leaves() -> None:
    hub: EventHub[int] = EventHub(max_subscribers=1, buffer=1)
    async with hub.subscribe():
        hub.publish(1)
        hub.publish(2)  # dropped, but its queued items still take memory
        with pytest.raises(TooManySubscribers):
            async with hub.subscribe():
                pass  # pragma: no cover
    async with hub.subscribe():
        assert hub.subscriber_count == 1


async def test_leaving_on_an_error_frees_the_slot() -> None:
    hub: EventHub[int] = EventHub(max_subscribers=1, buffer=1)
    with pytest.raises(RuntimeError):
        async with hub.subscribe():
            raise RuntimeError("client went away")
    assert hub.subscriber_count == 0
    hub.publish(1)  # the departed subscriber is not fed


def test_publish_with_no_subscribers_still_advances_the_sequence() -> None:
    hub: EventHub[str] = EventHub(max_subscribers=1, buffer=1)
    assert hub.sequence == 0
    assert hub.publish("x") == Envelope(1, "x")
    assert hub.publish("y") == Envelope(2, "y")
    assert hub.sequence == 2


async def test_sequence_is_monotonic_across_subscribers_joining_late() -> None:
    hub: EventHub[int] = EventHub(max_subscribers=2, buffer=100)
    hub.publish(0)
    async with hub.subscribe() as sub:
        for value in range(1, 50):
            hub.publish(value)
        hub.close()
        items = [item async for item in sub]
    sequences = [item.sequence for item in items if isinstance(item, Envelope)]
    assert sequences == list(range(2, 51))
    assert [item.event for item in items if isinstance(item, Envelope)] == list(range(1, 50))


async def test_closed_hub_refuses_new_subscribers() -> None:
    hub: EventHub[int] = EventHub(max_subscribers=1, buffer=1)
    hub.close()
    with pytest.raises(trio.ClosedResourceError):
        async with hub.subscribe():
            pass  # pragma: no cover


@pytest.mark.parametrize(("subscribers", "buffer"), [(0, 1), (1, 0)])
def test_bounds_must_be_positive(subscribers: int, buffer: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        EventHub[int](max_subscribers=subscribers, buffer=buffer)


async def test_a_subscriber_resumes_after_the_last_sequence_it_saw() -> None:
    hub: EventHub[str] = EventHub(max_subscribers=2, buffer=4)
    for value in "abcde":
        hub.publish(value)
    async with hub.subscribe(after=3) as sub:
        hub.publish("f")
        hub.close()
        items = [item async for item in sub]
    assert items == [Envelope(4, "d"), Envelope(5, "e"), Envelope(6, "f")]


async def test_resuming_from_the_last_published_event_replays_nothing() -> None:
    hub: EventHub[str] = EventHub(max_subscribers=1, buffer=2)
    hub.publish("a")
    async with hub.subscribe(after=1) as sub:
        hub.close()
        assert [item async for item in sub] == []


async def test_resuming_from_a_point_not_kept_starts_with_missed_then_goes_live() -> None:
    hub: EventHub[int] = EventHub(max_subscribers=4, buffer=3)
    for value in range(10):
        hub.publish(value)
    # Events after 5 and after 0: more than the 3 kept; 1000 and -1: never published.
    for after in (5, 0, 1000, -1):
        async with hub.subscribe(after=after) as sub:
            hub.publish(99)
            first, second = await sub.__anext__(), await sub.__anext__()
        assert first == Missed(after) and isinstance(second, Envelope) and second.event == 99


def test_each_hub_labels_its_run() -> None:
    assert EventHub[int](1, 1).run != EventHub[int](1, 1).run
    assert EventHub[int](1, 1, run="r1").run == "r1"
