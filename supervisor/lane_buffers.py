"""A lane owner's book of the buffers in its host: which invocation holds which
buffer, and how many buffers and bytes each invocation holds on the lane.

Buffer ids are opaque and scoped to the invocation that reserved them: another
invocation's buffer looks exactly like a missing one. The book only records;
the owner frees in the host (`supervisor.lane_jobs`).

It also books the device memory each live host of the lane holds for itself
(its CUDA context, as its hello reports it: `HelloReply.memory_reserved`): the
sentinel's and each session's. That is the lane's memory too, so it is not free
for buffers, though no invocation's `vram_bytes` is charged for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from lanehost.protocol import HelloReply
from supervisor.lane_work import LaneWorkError

__all__ = ["BUFFERS_PER_INVOCATION", "SENTINEL", "LaneBuffers", "reserved_by"]

SENTINEL = ""  # the lane's own host, in the book of hosts (no invocation id is empty)


def reserved_by(hello: object) -> int:
    """What a started host holds for itself, from its hello (0 from a double's)."""
    return hello.memory_reserved if isinstance(hello, HelloReply) else 0


# The buffers one invocation may hold on one lane, of the lane's 4,096
# (`lanehost.protocol.MAX_BUFFERS`): 64 x 64, the default --max-running, is 4,096,
# so every invocation running at once, all on one lane, can hold its whole share.
BUFFERS_PER_INVOCATION = 64


@dataclasses.dataclass(frozen=True)
class _Buffer:
    invocation_id: str
    nbytes: int


class LaneBuffers:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # the lane's memory
        self._buffers: dict[str, _Buffer] = {}
        self._held: dict[str, int] = {}  # bytes, by invocation
        self._counts: dict[str, int] = {}  # buffers, by invocation
        self._hosts: dict[str, int] = {}  # bytes a live host holds for itself, by owner

    def __len__(self) -> int:
        return len(self._buffers)

    def __contains__(self, buffer_id: object) -> bool:
        return buffer_id in self._buffers

    def held_by(self, invocation_id: str) -> int:
        return self._held.get(invocation_id, 0)

    def count_of(self, invocation_id: str) -> int:
        """How many buffers the invocation holds on the lane."""
        return self._counts.get(invocation_id, 0)

    @property
    def used_bytes(self) -> int:
        return sum(self._held.values())

    @property
    def hosts_bytes(self) -> int:
        """What the lane's live hosts hold for themselves (their CUDA contexts)."""
        return sum(self._hosts.values())

    @property
    def free_bytes(self) -> int:
        """The lane memory no invocation's buffers and no host's own use holds."""
        return max(0, self.capacity - self.used_bytes - self.hosts_bytes)

    def host_started(self, key: str, nbytes: int) -> None:
        """A host (`SENTINEL`, or an invocation's session) holds `nbytes` for itself."""
        if nbytes > 0:
            self._hosts[key] = nbytes
        else:
            self._hosts.pop(key, None)

    def host_ended(self, key: str) -> None:
        self._hosts.pop(key, None)

    def holds_any(self, invocation_id: str) -> bool:
        return invocation_id in self._counts

    def of(self, invocation_id: str) -> list[str]:
        """The ids of the invocation's buffers."""
        return [b for b, buf in self._buffers.items() if buf.invocation_id == invocation_id]

    def nbytes(self, buffer_ids: Iterable[str]) -> int:
        return sum(self._buffers[b].nbytes for b in buffer_ids)

    def own(self, sub: str, buffer_id: str) -> None:
        """Refuse a buffer that `sub` does not hold."""
        buffer = self._buffers.get(buffer_id)
        # Another invocation's buffer looks exactly like a missing one.
        if buffer is None or buffer.invocation_id != sub:
            raise LaneWorkError(404, "buffer_not_found", "no such buffer for this invocation")

    def add(self, buffer_id: str, invocation_id: str, nbytes: int) -> int:
        """Record a new buffer; the bytes its invocation then holds."""
        self._buffers[buffer_id] = _Buffer(invocation_id, nbytes)
        held = self._held[invocation_id] = self._held.get(invocation_id, 0) + nbytes
        self._counts[invocation_id] = self._counts.get(invocation_id, 0) + 1
        return held

    def drop(self, buffer_id: str) -> None:
        """Forget a buffer (if still known) and its bytes."""
        buffer = self._buffers.pop(buffer_id, None)
        if buffer is None:
            return
        invocation_id = buffer.invocation_id
        held = self._held.get(invocation_id, 0) - buffer.nbytes
        if held > 0:
            self._held[invocation_id] = held
        else:
            self._held.pop(invocation_id, None)
        count = self._counts.get(invocation_id, 0) - 1
        if count > 0:
            self._counts[invocation_id] = count
        else:
            self._counts.pop(invocation_id, None)

    def forget(self, invocation_id: str) -> None:
        """Forget every buffer of the invocation, and what its host held for itself:
        its session's host, which held them, is gone."""
        for buffer_id in self.of(invocation_id):
            self.drop(buffer_id)
        self.host_ended(invocation_id)
