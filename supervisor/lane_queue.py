"""A lane's queue of work: a bounded share per invocation, served in turn.

One queue per key (an invocation), each holding at most `share` items; the
reader takes one item from each key in turn. A tenant that floods a lane fills
only its own share (`Full`), and its backlog delays another tenant's work by at
most one item. Keys are capped too (`max_keys`), though admission already
bounds them: only a live invocation's valid token gets an item queued.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, TypeVar

import trio

__all__ = ["FairQueue", "Full"]

T = TypeVar("T")


class Full(Exception):
    """The key's share, or the number of keys, is used up."""


class FairQueue(Generic[T]):
    def __init__(self, *, share: int, max_keys: int) -> None:
        if share < 1 or max_keys < 1:
            raise ValueError("share and max_keys must be >= 1")
        self._share = share
        self._max_keys = max_keys
        self._queues: OrderedDict[str, deque[T]] = OrderedDict()
        self._wakeup = trio.Event()

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def queued(self, key: str) -> int:
        return len(self._queues.get(key, ()))

    def put_nowait(self, key: str, item: T) -> None:
        queue = self._queues.get(key)
        if queue is None:
            if len(self._queues) >= self._max_keys:
                raise Full(f"{self._max_keys} invocations already have work queued")
            queue = self._queues[key] = deque()
        elif len(queue) >= self._share:
            raise Full(f"{self._share} items already queued for {key}")
        queue.append(item)
        self._wakeup.set()

    def remove(self, key: str, item: T) -> bool:
        """Take back an item still queued (its sender left); False if it was taken."""
        queue = self._queues.get(key, deque())
        for index, queued in enumerate(queue):
            if queued is item:  # by identity: equal items may belong to others
                del queue[index]
                if not queue:
                    del self._queues[key]
                return True
        return False

    def get_nowait(self) -> T:
        """The next item, taking keys in turn; trio.WouldBlock when empty."""
        if not self._queues:
            raise trio.WouldBlock
        key, queue = next(iter(self._queues.items()))
        item = queue.popleft()
        if queue:
            self._queues.move_to_end(key)  # the others go first next time
        else:
            del self._queues[key]
        return item

    async def get(self) -> T:
        await trio.lowlevel.checkpoint()
        while not self._queues:
            self._wakeup = trio.Event()
            await self._wakeup.wait()
        return self.get_nowait()
