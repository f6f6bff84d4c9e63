"""Bounded revocation state: the deny list and the per-invocation token tracker.

`DenyList` holds revoked `jti`s until their token could no longer pass the
time check anyway (`exp` plus leeway); past its bound it raises
`RevocationFull` rather than forget anything.

`InvocationTracker` remembers which live `jti`s each invocation holds so that
ending an invocation revokes every token it was given. It forgets a token
once that token has expired (plus leeway), never earlier.

Both are plain data structures on an injected clock: no I/O, no threads.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container, Iterable

from capabilities.errors import RevocationFull

__all__ = ["DenyList", "InvocationTracker"]

Clock = Callable[[], float]


class DenyList:
    """Revoked token ids, each kept until `exp + leeway`, at most `capacity` of them."""

    def __init__(self, capacity: int, *, leeway: float, clock: Clock) -> None:
        if capacity < 1:
            raise ValueError("deny list capacity must be at least 1")
        self._capacity = capacity
        self._leeway = leeway
        self._clock = clock
        self._evict_at: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return len(self._evict_at)

    def __contains__(self, jti: object) -> bool:
        return jti in self._evict_at

    def live_view(self) -> Container[str]:
        """A read-only live view for `in` tests on the hot path (no method call per test)."""
        return self._evict_at.keys()

    def purge(self) -> int:
        """Forget entries whose token has expired past leeway; returns how many."""
        now = self._clock()
        dropped = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            evict_at, jti = heapq.heappop(heap)
            if self._evict_at.get(jti) == evict_at:
                del self._evict_at[jti]
                dropped += 1
        return dropped

    def revoke(self, jti: str, exp: float) -> None:
        """Deny `jti` until `exp + leeway`; RevocationFull when there is no room."""
        self.revoke_many([(jti, exp)])

    def revoke_many(self, entries: Iterable[tuple[str, float]]) -> int:
        """Deny every (jti, exp) or none of them; returns how many were new."""
        wanted: dict[str, float] = {}
        for jti, exp in entries:
            evict_at = exp + self._leeway
            wanted[jti] = max(evict_at, wanted.get(jti, evict_at))
        if not wanted:
            return 0
        self.purge()
        now = self._clock()
        fresh = {
            jti: at for jti, at in wanted.items() if at > now and self._evict_at.get(jti, -1.0) < at
        }
        new = sum(1 for jti in fresh if jti not in self._evict_at)
        if len(self._evict_at) + new > self._capacity:
            raise RevocationFull(self._capacity)
        for jti, at in fresh.items():
            self._evict_at[jti] = at
            heapq.heappush(self._heap, (at, jti))
        self._compact()
        return new

    def _compact(self) -> None:
        # Superseded heap entries (a jti re-revoked with a later exp) are
        # skipped by purge; rebuild when they would let the heap outgrow its bound.
        if len(self._heap) > 2 * self._capacity:
            self._heap = [(at, jti) for jti, at in self._evict_at.items()]
            heapq.heapify(self._heap)


class InvocationTracker:
    """Live token ids per invocation, at most `capacity` in all."""

    def __init__(self, capacity: int, *, leeway: float, clock: Clock) -> None:
        if capacity < 1:
            raise ValueError("tracker capacity must be at least 1")
        self._capacity = capacity
        self._leeway = leeway
        self._clock = clock
        self._by_invocation: dict[str, dict[str, float]] = {}
        self._heap: list[tuple[float, str, str]] = []
        self._count = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return self._count

    def invocations(self) -> int:
        """How many invocations hold at least one live token."""
        return len(self._by_invocation)

    def purge(self) -> int:
        """Forget tokens that have expired past leeway; returns how many."""
        now = self._clock()
        dropped = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, invocation_id, jti = heapq.heappop(heap)
            held = self._by_invocation.get(invocation_id)
            if held is not None and held.pop(jti, None) is not None:
                dropped += 1
                if not held:
                    del self._by_invocation[invocation_id]
        self._count -= dropped
        return dropped

    def add(self, invocation_id: str, jti: str, exp: float) -> None:
        """Remember a freshly minted token; RevocationFull when there is no room."""
        if self._count >= self._capacity:
            self.purge()
            if self._count >= self._capacity:
                raise RevocationFull(self._capacity, "too many live tokens to track")
        held = self._by_invocation.setdefault(invocation_id, {})
        if jti in held:
            raise ValueError("jti already tracked")
        held[jti] = exp
        self._count += 1
        heapq.heappush(self._heap, (exp + self._leeway, invocation_id, jti))
        if len(self._heap) > 2 * self._capacity:
            self._heap = [
                (at + self._leeway, inv, j)
                for inv, tokens in self._by_invocation.items()
                for j, at in tokens.items()
            ]
            heapq.heapify(self._heap)

    def discard(self, invocation_id: str, jti: str) -> bool:
        """Stop tracking one token (it was revoked on its own)."""
        held = self._by_invocation.get(invocation_id)
        if held is None or held.pop(jti, None) is None:
            return False
        self._count -= 1
        if not held:
            del self._by_invocation[invocation_id]
        return True

    def pop_invocation(self, invocation_id: str) -> list[tuple[str, float]]:
        """Hand over and forget every live (jti, exp) of one invocation."""
        held = self._by_invocation.pop(invocation_id, None)
        if held is None:
            return []
        self._count -= len(held)
        return list(held.items())
