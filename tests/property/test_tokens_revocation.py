"""Stateful property: minting, refresh, expiry and revocation against a simple model.

A model keeps every minted token with its invocation, lane, lifetime and
whether it was revoked (its invocation ended, or a newer token for the same
invocation and lane superseded it). After any sequence of mints, refreshes,
endings and clock moves, both a caching and a non-caching validator give
exactly the model's verdict, a refresh is refused before half the token's
life, the live table never outgrows its bound and holds exactly the model's
live tokens, and minting is refused (RevocationFull) exactly when a new
(invocation, lane) pair finds no room.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from capabilities import (
    Claims,
    Isolation,
    KeyRing,
    LaneOp,
    RefreshTooEarly,
    RevocationFull,
    TokenRefusal,
    TokenRefused,
    TokenService,
)

T0 = 1_800_000_000.0
TTL = 60
LEEWAY = 5.0
CAPACITY = 6
INVOCATIONS = st.sampled_from(["inv-1", "inv-2", "inv-3"])
LANES = st.sampled_from(["lane-a", "lane-b"])


@dataclasses.dataclass
class Minted:
    token: str
    claims: Claims
    revoked: bool = False

    @property
    def invocation(self) -> str:
        return self.claims.sub

    @property
    def lane(self) -> str:
        return self.claims.aud

    @property
    def exp(self) -> float:
        return self.claims.exp.timestamp()

    @property
    def halfway(self) -> float:
        iat = self.claims.iat.timestamp()
        return iat + (self.exp - iat) / 2


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


class Revocation(RuleBasedStateMachine):
    def __init__(self, keyring: KeyRing) -> None:
        super().__init__()
        self.clock = Clock()
        self.service = TokenService(
            "node-a", keyring, ttl=TTL, clock=self.clock, max_live_tokens=CAPACITY, leeway=LEEWAY
        )
        self.validators = [self.service.validator(cache_size=3), self.service.validator(0)]
        self.minted: list[Minted] = []

    def _alive(self, m: Minted) -> bool:
        return self.clock.now < m.exp + LEEWAY

    def _live(self) -> list[Minted]:
        # The `bounded` invariant reads live_tokens, which forgets expired
        # tokens, so before every rule the table holds exactly these.
        return [m for m in self.minted if self._alive(m) and not m.revoked]

    def _issued(self, token: str, claims: Claims) -> None:
        for m in self._live():
            if (m.invocation, m.lane) == (claims.sub, claims.aud):
                m.revoked = True  # superseded
        self.minted.append(Minted(token, claims))

    @rule(invocation=INVOCATIONS, lane=LANES)
    def mint(self, invocation: str, lane: str) -> None:
        live = self._live()
        held = any((m.invocation, m.lane) == (invocation, lane) for m in live)
        full = not held and len(live) >= CAPACITY
        try:
            minted = self.service.mint(
                invocation_id=invocation,
                lane_id=lane,
                ops=[LaneOp.EXECUTE],
                vram_bytes=100,
                isolation=Isolation.SHARED,
                deadline=None,
            )
        except RevocationFull:
            assert full
            return
        assert not full
        self._issued(minted.token, minted.claims)

    @precondition(lambda self: bool(self.minted))
    @rule(data=st.data())
    def refresh(self, data: st.DataObject) -> None:
        m = data.draw(st.sampled_from(self.minted))
        try:
            fresh = self.service.refresh(m.claims, deadline=None)
        except TokenRefused as refused:
            if self._alive(m):
                assert m.revoked and refused.reason is TokenRefusal.REVOKED
            else:
                assert refused.reason is TokenRefusal.EXPIRED
            return
        except RefreshTooEarly as early:
            assert not m.revoked and self._alive(m)
            assert self.clock.now < m.halfway
            assert early.retry_after >= 1
            assert self.clock.now + early.retry_after >= m.halfway
            return
        assert not m.revoked and self._alive(m) and self.clock.now >= m.halfway
        assert (fresh.claims.sub, fresh.claims.aud) == (m.invocation, m.lane)
        self._issued(fresh.token, fresh.claims)

    @rule(seconds=st.sampled_from([0.5, 1, 10, 29.5, 30, 59, 60, 65, 120]))
    def advance(self, seconds: float) -> None:
        self.clock.now += seconds

    @rule(invocation=INVOCATIONS)
    def end_invocation(self, invocation: str) -> None:
        expected = 0
        for m in self.minted:
            if m.invocation == invocation and not m.revoked:
                m.revoked = True
                expected += self._alive(m)
        assert self.service.revoke_invocation(invocation) == expected

    @precondition(lambda self: bool(self.minted))
    @rule(data=st.data(), lane=LANES, vram=st.sampled_from([0, 100, 101]))
    def validate(self, data: st.DataObject, lane: str, vram: int) -> None:
        m = data.draw(st.sampled_from(self.minted))
        if not self._alive(m):
            expected: TokenRefusal | None = TokenRefusal.EXPIRED
        elif lane != m.lane:
            expected = TokenRefusal.WRONG_AUDIENCE
        elif m.revoked:
            expected = TokenRefusal.REVOKED
        elif vram > 100:
            expected = TokenRefusal.VRAM_OVER_BUDGET
        else:
            expected = None
        for validator in self.validators:
            try:
                claims = validator.validate(
                    m.token, lane_id=lane, op=LaneOp.EXECUTE, vram_bytes=vram
                )
            except TokenRefused as refused:
                assert refused.reason is expected
            else:
                assert expected is None
                assert claims == m.claims

    @invariant()
    def bounded(self) -> None:
        assert len(self.service.live) <= CAPACITY
        assert self.service.live_tokens == len(self._live())
        assert self.service.live.invocations() == len({m.invocation for m in self._live()})


@pytest.fixture(scope="module")
def keyring(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyRing]:
    yield KeyRing.open(tmp_path_factory.mktemp("keys"))


def test_revocation_state_machine(keyring: KeyRing) -> None:
    run_state_machine_as_test(
        lambda: Revocation(keyring),
        settings=settings(max_examples=200, stateful_step_count=40, deadline=None),
    )
