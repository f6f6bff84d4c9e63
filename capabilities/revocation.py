"""Bounded revocation state: the one current token of each invocation on each lane.

Revocation works by allow-list. A token passes the revocation check only while
it is the current token of its (invocation, lane):

- minting for a pair supersedes its earlier token, so a refresh replaces an
  entry and grows nothing, however often it is done;
- ending an invocation forgets its entries, whatever number of tokens it was
  given: revoking leaves no state behind;
- a token the table does not know (superseded, ended, minted before a
  restart) is refused;
- each entry keeps the claims its token was issued with, so a token under a
  live jti is authority only if it says exactly that (`issued`): the same
  invocation, lane, scope and window, never what someone re-signed.

An entry is also forgotten once its token has expired past leeway (the time
check refuses it anyway). At most `capacity` entries: a new pair past the
bound raises `RevocationFull`, so no token is handed out that could not be
revoked. Plain data on an injected clock: no I/O, no threads.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Mapping
from typing import NamedTuple

from capabilities.claims import Claims
from capabilities.errors import RevocationFull

__all__ = ["LiveEntry", "LiveTokens"]

Clock = Callable[[], float]


class LiveEntry(NamedTuple):
    """One live token: the claims it was issued with, and when to forget it."""

    claims: Claims  # as issued: sub is the invocation, aud the lane
    forget_at: float


class LiveTokens:
    """The current token id per (invocation, lane), at most `capacity` of them."""

    def __init__(self, capacity: int, *, leeway: float, clock: Clock) -> None:
        if capacity < 1:
            raise ValueError("live token capacity must be at least 1")
        self._capacity = capacity
        self._leeway = leeway
        self._clock = clock
        self._by_jti: dict[str, LiveEntry] = {}
        self._by_invocation: dict[str, dict[str, str]] = {}
        # No entry expires before this, so a purge before it would find nothing.
        self._next_expiry = math.inf

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return len(self._by_jti)

    def __contains__(self, jti: object) -> bool:
        return jti in self._by_jti

    def view(self) -> Mapping[str, LiveEntry]:
        """A read-only live view by jti for the validator's hot path."""
        return types.MappingProxyType(self._by_jti)

    def issued(self, jti: str) -> Claims | None:
        """The claims the live token `jti` was issued with; None when it is not live."""
        entry = self._by_jti.get(jti)
        return None if entry is None else entry.claims

    def invocations(self) -> int:
        """How many invocations hold at least one live token."""
        return len(self._by_invocation)

    def current(self, invocation_id: str, lane_id: str) -> str | None:
        """The jti of the pair's current token, if it has one."""
        return self._by_invocation.get(invocation_id, {}).get(lane_id)

    def full(self) -> bool:
        """True when no new (invocation, lane) pair fits, even after a purge."""
        if len(self._by_jti) >= self._capacity:
            self.purge()
        return len(self._by_jti) >= self._capacity

    def purge(self) -> int:
        """Forget tokens that have expired past leeway; returns how many."""
        now = self._clock()
        if now < self._next_expiry:
            return 0
        expired = [jti for jti, entry in self._by_jti.items() if entry.forget_at <= now]
        for jti in expired:
            self.revoke(jti)
        self._next_expiry = min((e.forget_at for e in self._by_jti.values()), default=math.inf)
        return len(expired)

    def make_room(self, invocation_id: str, lane_id: str) -> None:
        """RevocationFull unless a token for this pair could be admitted now."""
        if self.current(invocation_id, lane_id) is None and self.full():
            raise RevocationFull(self._capacity)

    def admit(self, claims: Claims) -> str | None:
        """Make the token issued with `claims` the current one of its (invocation `sub`,
        lane `aud`); returns the jti it superseded.

        RevocationFull when the pair is new and there is no room.
        """
        jti, invocation_id, lane_id = claims.jti, claims.sub, claims.aud
        if jti in self._by_jti:
            raise ValueError("jti already live")
        self.make_room(invocation_id, lane_id)
        old = self.current(invocation_id, lane_id)
        if old is not None:
            del self._by_jti[old]
        self._by_invocation.setdefault(invocation_id, {})[lane_id] = jti
        forget_at = claims.exp.timestamp() + self._leeway
        self._by_jti[jti] = LiveEntry(claims, forget_at)
        self._next_expiry = min(self._next_expiry, forget_at)
        return old

    def revoke(self, jti: str) -> bool:
        """Forget one token; False when it was not current."""
        entry = self._by_jti.pop(jti, None)
        if entry is None:
            return False
        invocation_id = entry.claims.sub
        lanes = self._by_invocation[invocation_id]
        del lanes[entry.claims.aud]
        if not lanes:
            del self._by_invocation[invocation_id]
        return True

    def revoke_invocation(self, invocation_id: str) -> int:
        """Forget every token of one invocation; returns how many were live."""
        lanes = self._by_invocation.pop(invocation_id, {})
        for jti in lanes.values():
            del self._by_jti[jti]
        return len(lanes)
