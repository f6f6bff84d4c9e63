"""Stateful property: minting, expiry and revocation against a simple model.

A model keeps every minted token with its invocation, lane, expiry and
whether it was revoked. After any sequence of mints, revocations and clock
moves, both a caching and a non-caching validator give exactly the model's
verdict, the deny list never outgrows its bound, and minting is refused
(RevocationFull) exactly when every revocation slot is spoken for.
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
    Isolation,
    KeyRing,
    LaneOp,
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
    invocation: str
    lane: str
    exp: float
    jti: str
    revoked: bool = False


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
            "node-a", keyring, ttl=TTL, clock=self.clock, deny_list_size=CAPACITY, leeway=LEEWAY
        )
        self.validators = [self.service.validator(cache_size=3), self.service.validator(0)]
        self.minted: list[Minted] = []

    def _alive(self, m: Minted) -> bool:
        return self.clock.now < m.exp + LEEWAY

    def _slots_taken(self) -> int:
        return sum(1 for m in self.minted if self._alive(m))

    @rule(invocation=INVOCATIONS, lane=LANES)
    def mint(self, invocation: str, lane: str) -> None:
        full = self._slots_taken() >= CAPACITY
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
        self.minted.append(
            Minted(minted.token, invocation, lane, minted.claims.exp.timestamp(), minted.claims.jti)
        )

    @rule(seconds=st.sampled_from([0.5, 1, 10, 30, 59, 60, 65, 120]))
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
                assert claims.jti == m.jti

    @invariant()
    def bounded(self) -> None:
        assert len(self.service.deny_list) <= CAPACITY
        live = sum(1 for m in self.minted if self._alive(m) and not m.revoked)
        assert self.service.live_tokens == live


@pytest.fixture(scope="module")
def keyring(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyRing]:
    yield KeyRing.open(tmp_path_factory.mktemp("keys"))


def test_revocation_state_machine(keyring: KeyRing) -> None:
    run_state_machine_as_test(
        lambda: Revocation(keyring),
        settings=settings(max_examples=200, stateful_step_count=40, deadline=None),
    )
