"""Minting: claims, lifetimes, the node binding, and revocation bookkeeping."""

from __future__ import annotations

import datetime
import json
import pathlib

import pytest

from capabilities import (
    DEADLINE_MARGIN,
    Claims,
    Isolation,
    KeyRing,
    LaneOp,
    MintError,
    RevocationFull,
    TokenRefusal,
    TokenRefused,
    TokenService,
    paseto,
)
from capabilities.claims import implicit_assertion

T0 = 1_800_000_000.0


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def service(tmp_path: pathlib.Path, clock: FakeClock) -> TokenService:
    return TokenService("node-a", KeyRing.open(tmp_path), ttl=600, clock=clock)


def _mint(service: TokenService, invocation: str = "inv-1", **overrides: object) -> str:
    args: dict[str, object] = {
        "invocation_id": invocation,
        "lane_id": "lane-0",
        "ops": frozenset({LaneOp.EXECUTE}),
        "vram_bytes": 1 << 30,
        "isolation": Isolation.SANDBOX,
        "deadline": None,
    }
    args.update(overrides)
    return service.mint(**args).token  # type: ignore[arg-type]


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
    minted = service.mint(
        invocation_id="i",
        lane_id="l",
        ops=[LaneOp.EXECUTE],
        vram_bytes=0,
        isolation=Isolation.SHARED,
        deadline=None,
    )
    assert minted.claims.exp.timestamp() == T0 + 3600


def test_exp_never_passes_the_deadline_plus_margin(service: TokenService) -> None:
    minted = service.mint(
        invocation_id="i",
        lane_id="l",
        ops=[LaneOp.EXECUTE],
        vram_bytes=0,
        isolation=Isolation.SHARED,
        deadline=T0 + 100.9,
    )
    assert minted.claims.exp.timestamp() == T0 + 100 + DEADLINE_MARGIN
    far = service.mint(
        invocation_id="i",
        lane_id="l",
        ops=[LaneOp.EXECUTE],
        vram_bytes=0,
        isolation=Isolation.SHARED,
        deadline=T0 + 10_000,
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
    mine = [_mint(service, "inv-1") for _ in range(3)]
    theirs = _mint(service, "inv-2")
    assert service.live_tokens == 4
    assert service.revoke_invocation("inv-1") == 3
    assert service.revoke_invocation("inv-1") == 0
    for token in mine:
        with pytest.raises(TokenRefused) as refused:
            validator.validate(token, lane_id="lane-0", op=LaneOp.EXECUTE)
        assert refused.value.reason is TokenRefusal.REVOKED
    validator.validate(theirs, lane_id="lane-0", op=LaneOp.EXECUTE)
    assert service.live_tokens == 1
    assert len(service.deny_list) == 3


def test_revoke_one_token(service: TokenService) -> None:
    validator = service.validator()
    minted = service.mint(
        invocation_id="inv-1",
        lane_id="lane-0",
        ops=[LaneOp.EXECUTE],
        vram_bytes=0,
        isolation=Isolation.SHARED,
        deadline=None,
    )
    other = _mint(service, "inv-1")
    service.revoke(minted.claims)
    with pytest.raises(TokenRefused) as refused:
        validator.validate(minted.token, lane_id="lane-0", op=LaneOp.EXECUTE)
    assert refused.value.reason is TokenRefusal.REVOKED
    validator.validate(other, lane_id="lane-0", op=LaneOp.EXECUTE)
    assert service.revoke_invocation("inv-1") == 1


def test_minting_stops_when_no_revocation_slot_is_left(
    tmp_path: pathlib.Path, clock: FakeClock
) -> None:
    service = TokenService("node-a", KeyRing.open(tmp_path), ttl=60, clock=clock, deny_list_size=3)
    for i in range(3):
        _mint(service, f"inv-{i}")
    with pytest.raises(RevocationFull):
        _mint(service, "inv-9")
    # Ending invocations keeps their slots until their tokens expire...
    assert service.revoke_invocation("inv-0") == 1
    with pytest.raises(RevocationFull):
        _mint(service, "inv-9")
    # ...and expiry (plus leeway) frees them: old entries are evicted, not kept forever.
    clock.now = T0 + 60 + service.leeway
    _mint(service, "inv-9")
    assert len(service.deny_list) == 0
    assert service.live_tokens == 1


def test_revoking_a_foreign_token_when_the_deny_list_is_full_is_refused(
    tmp_path: pathlib.Path, clock: FakeClock
) -> None:
    service = TokenService("node-a", KeyRing.open(tmp_path), ttl=60, clock=clock, deny_list_size=1)
    _mint(service, "inv-0")
    stranger = Claims(
        iss="node-a",
        sub="inv-x",
        aud="lane-0",
        iat=datetime.datetime.fromtimestamp(T0, tz=datetime.UTC),
        nbf=datetime.datetime.fromtimestamp(T0, tz=datetime.UTC),
        exp=datetime.datetime.fromtimestamp(T0 + 60, tz=datetime.UTC),
        jti="f" * 32,
        ops=frozenset({LaneOp.EXECUTE}),
        vram_bytes=0,
        isolation=Isolation.SHARED,
    )
    service.revoke_invocation("inv-0")
    with pytest.raises(RevocationFull):
        service.revoke(stranger)


def test_tokens_of_a_rotated_key_still_verify(service: TokenService) -> None:
    validator = service.validator()
    before = _mint(service)
    new_kid = service.keyring.rotate()
    after = _mint(service)
    assert json.loads(paseto.parse(after).footer) == {"kid": new_kid}
    for token in (before, after):
        validator.validate(token, lane_id="lane-0", op=LaneOp.EXECUTE)
