"""FairQueue: a bounded share per key, keys served in turn, items taken back by identity."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from supervisor.lane_queue import FairQueue, Full


class Item:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Item)  # every item equal: removal must not care

    __hash__ = object.__hash__


async def test_keys_are_served_in_turn_and_each_is_bounded_by_its_share() -> None:
    queue = FairQueue[str](share=3, max_keys=4)
    for n in range(3):
        queue.put_nowait("a", f"a{n}")
    with pytest.raises(Full):
        queue.put_nowait("a", "a3")
    queue.put_nowait("b", "b0")
    assert [await queue.get() for _ in range(4)] == ["a0", "b0", "a1", "a2"]
    with pytest.raises(trio.WouldBlock):
        queue.get_nowait()


def test_the_number_of_keys_is_capped() -> None:
    queue = FairQueue[int](share=1, max_keys=2)
    queue.put_nowait("a", 1)
    queue.put_nowait("b", 2)
    with pytest.raises(Full):
        queue.put_nowait("c", 3)


def test_remove_takes_back_that_very_item_and_frees_its_place() -> None:
    queue = FairQueue[Item](share=2, max_keys=1)
    first, second = Item(), Item()
    queue.put_nowait("a", first)
    queue.put_nowait("a", second)
    assert queue.remove("a", second) and not queue.remove("a", second)
    assert queue.get_nowait() is first
    assert not queue.remove("a", first) and len(queue) == 0
    queue.put_nowait("b", second)  # the key's place came free too


async def test_get_waits_for_an_item() -> None:
    queue = FairQueue[int](share=1, max_keys=1)
    async with trio.open_nursery() as nursery:
        got: list[int] = []

        async def reader() -> None:
            got.append(await queue.get())

        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        queue.put_nowait("a", 7)
    assert got == [7]
