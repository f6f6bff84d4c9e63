"""Minting: claims, lifetimes, the node binding, and revocation bookkeeping."""

from __future__ import annotations

import datetime
import json
import pathlib

import pytest

from capabilities import (
    DEADLINE_MARGIN,
    Isolation,
    KeyRing,
    LaneOp,
    MintedToken,
    MintError,
    RefreshTooEarly,
    RevocationFull,
    TokenRefusal,
    TokenRefused,
    TokenService,
    paseto,
)
from capabilities.claims import implicit_assertion
from tests.fakes.clock import T0, FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def service(tmp_path: pathlib.Path, clock: FakeClock) -> TokenService:
    return TokenService("node-a", KeyRing.open(tmp_path), ttl=600, clock=clock)


def _mint(service: TokenService, invocation: str = "inv-1", **overrides: object) -> str:
    return _minted(service, invocation, **overrides).token


def _minted(service: TokenService, invocation: str = "inv-1", **overrides: object) -> MintedToken:
    args: dict[str, object] = {
        "invocation_id": invocation,
        "lane_id": "lane-0",
        "ops": frozenset({LaneOp.EXECUTE}),
        "vram_bytes": 1 << 30,
        "isolation": Isolation.SANDBOX,
        "deadline": None,
    }
    args.update(overrides)
    return service.mint(**args)  # type: ignore[arg-type]


def test_minted_claims_say_what_was_asked(service: TokenService, clock: FakeClock) -> None:
    clock.now = T0 + 0.75
    minted = service.mint(
        invocation_id="inv-1",
        lane_id="lane-0",
        ops=frozenset({LaneOp.MEMORY_RESERVE, LaneOp.EXECUTE}),
        vram_bytes=123,
        isolation=Isolation.DEDICATED,
        deadline=None,
    )
    c = minted.claims
    assert (c.iss, c.sub, c.aud) == ("node-a", "inv-1", "lane-0")
    assert c.ops == frozenset({LaneOp.MEMORY_RESERVE, LaneOp.EXECUTE})
    assert (c.vram_bytes, c.isolation) == (123, Isolation.DEDICATED)
    assert c.iat == c.nbf == datetime.datetime.fromtimestamp(T0, tz=datetime.UTC)
    assert c.exp.timestamp() == T0 + 600
    assert len(c.jti) == 32
    int(c.jti, 16)


def test_the_payload_is_plain_rfc3339_json(service: TokenService) -> None:
    minted = service.mint(
        invocation_id="inv-1",
        lane_id="lane-0",
        ops=frozenset({LaneOp.MEMORY_RELEASE, LaneOp.EXECUTE}),
        vram_bytes=5,
        isolation=Isolation.SHARED,
        deadline=None,
    )
    body = json.loads(paseto.parse(minted.token).payload)
    assert body == {
        "iss": "node-a",
        "sub": "inv-1",
        "aud": "lane-0",
        "iat": "2027-01-15T08:00:00Z",
        "nbf": "2027-01-15T08:00:00Z",
        "exp": "2027-01-15T08:10:00Z",
        "jti": minted.claims.jti,
        "ops": ["execute", "memory_release"],
        "vram_bytes": 5,
        "isolation": "shared",
    }
    footer = json.loads(paseto.parse(minted.token).footer)
    assert footer == {"kid": service.keyring.active_kid}


def test_tokens_are_signed_with_the_node_binding(service: TokenService) -> None:
    token = _mint(service)
    kid = service.keyring.active_kid
    public = service.keyring.public_key(kid)
    assert public is not None
    assert service.implicit_assertion() == implicit_assertion("node-a") == b'{"node_id":"node-a"}'
    paseto.verify(token, public, implicit=b'{"node_id":"node-a"}')
    with pytest.raises(TokenRefused) as refused:
        paseto.verify(token, public)
    assert refused.value.reason is TokenRefusal.BAD_SIGNATURE


def test_each_token_gets_a_fresh_jti(service: TokenService) -> None:
    jtis = {paseto.parse(_mint(service)).payload for _ in range(50)}
    assert len(jtis) == 50


def test_ttl_is_capped_at_one_hour(tmp_path: pathlib.Path, clock: FakeClock) -> None:
    service = TokenService("node-a", KeyRing.open(tmp_path), ttl=86_400, clock=clock)
    assert service.ttl == 3600
    minted = _minted(service, "i", lane_id="l", vram_bytes=0, isolation=Isolation.SHARED)
    assert minted.claims.exp.timestamp() == T0 + 3600


def test_exp_never_passes_the_deadline_plus_margin(service: TokenService) -> None:
    minted = _minted(
        service, "i", lane_id="l", vram_bytes=0, isolation=Isolation.SHARED, deadline=T0 + 100.9
    )
    assert minted.claims.exp.timestamp() == T0 + 100 + DEADLINE_MARGIN
    far = _minted(
        service, "i", lane_id="l", vram_bytes=0, isolation=Isolation.SHARED, deadline=T0 + 10_000
    )
    assert far.claims.exp.timestamp() == T0 + 600


def test_a_deadline_long_past_is_refused(service: TokenService) -> None:
    with pytest.raises(MintError, match="deadline"):
        _mint(service, deadline=T0 - DEADLINE_MARGIN - 5)


@pytest.mark.parametrize(
    "overrides",
    [
        {"ops": frozenset()},
        {"ops": ["format_disk"]},
        {"vram_bytes": -1},
        {"invocation_id": ""},
        {"lane_id": "x" * 300},
        {"isolation": "none"},
        {"deadline": float("nan")},
    ],
)
def test_bad_mint_requests_are_refused(service: TokenService, overrides: dict[str, object]) -> None:
    with pytest.raises(MintError):
        _mint(service, **overrides)
    assert service.live_tokens == 0


@pytest.mark.parametrize(
    "kwargs",
    [{"ttl": 0}, {"ttl": float("inf")}, {"ttl": 60, "leeway": 31}, {"ttl": 60, "leeway": -1}],
)
def test_bad_service_settings_are_refused(tmp_path: pathlib.Path, kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        TokenService("node-a", KeyRing.open(tmp_path), **kwargs)


def test_revoke_invocation_revokes_only_that_invocations_tokens(service: TokenService) -> None:
    validator = service.validator()
    mine = [_mint(service, "inv-1", lane_id=f"lane-{i}") for i in range(3)]
    theirs = _mint(service, "inv-2")
    assert service.live_tokens == 4
    assert service.revoke_invocation("inv-1") == 3
    assert service.revoke_invocation("inv-1") == 0
    for i, token in enumerate(mine):
        with pytest.raises(TokenRefused) as refused:
            validator.validate(token, lane_id=f"lane-{i}", op=LaneOp.EXECUTE)
        assert refused.value.reason is TokenRefusal.REVOKED
    validator.validate(theirs, lane_id="lane-0", op=LaneOp.EXECUTE)
    # Revoking left nothing behind: only inv-2's one token is held.
    assert (service.live_tokens, len(service.live), service.live.invocations()) == (1, 1, 1)


def test_a_new_token_for_the_same_lane_supersedes_the_old_one(service: TokenService) -> None:
    validator = service.validator()
    first = _mint(service, "inv-1")
    second = _mint(service, "inv-1")
    with pytest.raises(TokenRefused) as refused:
        validator.validate(first, lane_id="lane-0", op=LaneOp.EXECUTE)
    assert refused.value.reason is TokenRefusal.REVOKED
    validator.validate(second, lane_id="lane-0", op=LaneOp.EXECUTE)
    assert service.live_tokens == 1


def test_revoke_one_token(service: TokenService) -> None:
    validator = service.validator()
    minted = _minted(service, "inv-1", vram_bytes=0, isolation=Isolation.SHARED)
    other = _mint(service, "inv-1", lane_id="lane-1")
    assert service.revoke(minted.claims)
    assert not service.revoke(minted.claims)
    with pytest.raises(TokenRefused) as refused:
        validator.validate(minted.token, lane_id="lane-0", op=LaneOp.EXECUTE)
    assert refused.value.reason is TokenRefusal.REVOKED
    validator.validate(other, lane_id="lane-1", op=LaneOp.EXECUTE)
    assert service.revoke_invocation("inv-1") == 1


def test_minting_stops_when_the_table_is_full_and_ending_work_frees_room_at_once(
    tmp_path: pathlib.Path, clock: FakeClock
) -> None:
    service = TokenService("node-a", KeyRing.open(tmp_path), ttl=60, clock=clock, max_live_tokens=3)
    for i in range(3):
        _mint(service, f"inv-{i}")
    assert service.full_reason() is not None
    with pytest.raises(RevocationFull):
        _mint(service, "inv-9")
    # A pair that holds a token can still get a new one: it replaces, not adds.
    _mint(service, "inv-2")
    # Ending an invocation frees its room at once, not when its tokens expire...
    assert service.revoke_invocation("inv-0") == 1
    _mint(service, "inv-9")
    with pytest.raises(RevocationFull):
        _mint(service, "inv-10")
    # ...and an expired token (plus leeway) is forgotten: nothing is kept forever.
    clock.now = T0 + 60 + service.leeway
    assert service.full_reason() is None
    _mint(service, "inv-10")
    assert service.live_tokens == 1


def test_refresh_is_refused_until_half_the_token_life_is_used(
    service: TokenService, clock: FakeClock
) -> None:
    claims = _minted(service, vram_bytes=7).claims
    for now, wait in ((T0, 300), (T0 + 0.5, 300), (T0 + 299.2, 1)):
        clock.now = now
        with pytest.raises(RefreshTooEarly) as early:
            service.refresh(claims, deadline=None)
        assert early.value.retry_after == wait
    assert service.live_tokens == 1 and claims.jti in service.live
    clock.now = T0 + 300
    fresh = service.refresh(claims, deadline=None).claims
    assert (fresh.sub, fresh.aud, fresh.ops, fresh.vram_bytes) == (
        claims.sub,
        claims.aud,
        claims.ops,
        claims.vram_bytes,
    )
    assert claims.jti not in service.live and fresh.jti in service.live
    # The traded-in token cannot be refreshed again, whenever asked.
    clock.now = T0 + 500
    with pytest.raises(TokenRefused) as refused:
        service.refresh(claims, deadline=None)
    assert refused.value.reason is TokenRefusal.REVOKED
    # Nor can a token past its life (plus leeway), current or not.
    clock.now = fresh.exp.timestamp() + service.leeway
    with pytest.raises(TokenRefused) as late:
        service.refresh(fresh, deadline=None)
    assert late.value.reason is TokenRefusal.EXPIRED


def test_refreshes_grow_nothing_however_many(tmp_path: pathlib.Path, clock: FakeClock) -> None:
    service = TokenService("node-a", KeyRing.open(tmp_path), ttl=60, clock=clock, max_live_tokens=2)
    claims = _minted(service).claims
    for _ in range(1000):
        clock.now += 30
        claims = service.refresh(claims, deadline=None).claims
        assert (len(service.live), service.live.invocations()) == (1, 1)
    _mint(service, "inv-2")  # the other slot is still free


def test_tokens_of_a_rotated_key_still_verify(service: TokenService) -> None:
    validator = service.validator()
    before = _mint(service)
    new_kid = service.keyring.rotate()
    after = _mint(service, lane_id="lane-1")
    assert json.loads(paseto.parse(after).footer) == {"kid": new_kid}
    validator.validate(before, lane_id="lane-0", op=LaneOp.EXECUTE)
    validator.validate(after, lane_id="lane-1", op=LaneOp.EXECUTE)
