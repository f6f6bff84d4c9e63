"""What the node publishes to verifiers outside it: the key set and introspection."""

from __future__ import annotations

import datetime
import pathlib

import msgspec
import pytest

from capabilities import (
    DEFAULT_LEEWAY,
    Introspection,
    Isolation,
    KeyRing,
    KeyStatus,
    LaneOp,
    MintedToken,
    TokenService,
    paseto,
)
from capabilities.publication import INACTIVE, MAX_PUBLISHED_KEYS
from tests.fakes.clock import T0, FakeClock

TTL = 600


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def service(tmp_path: pathlib.Path, clock: FakeClock) -> TokenService:
    return TokenService("node-a", KeyRing.open(tmp_path), ttl=TTL, clock=clock)


def _mint(service: TokenService, invocation: str = "inv-1", lane: str = "lane-0") -> MintedToken:
    return service.mint(
        invocation_id=invocation,
        lane_id=lane,
        ops=frozenset({LaneOp.MEMORY_RESERVE, LaneOp.EXECUTE}),
        vram_bytes=1 << 30,
        isolation=Isolation.SHARED,
        deadline=None,
    )


def test_a_current_token_is_active_with_its_claims_in_rfc_7662_shape(
    service: TokenService,
) -> None:
    minted = _mint(service)
    answer = service.introspect(minted.token)
    assert answer == Introspection(
        active=True,
        iss="node-a",
        sub="inv-1",
        aud="lane-0",
        exp=int(T0) + TTL,
        iat=int(T0),
        nbf=int(T0),
        jti=minted.claims.jti,
        scope="execute memory_reserve",
        vram_bytes=1 << 30,
        isolation=Isolation.SHARED,
    )
    wire = msgspec.json.decode(msgspec.json.encode(answer))
    assert wire["active"] is True and wire["exp"] == int(T0) + TTL


def test_a_token_is_inactive_once_expired_past_leeway(
    service: TokenService, clock: FakeClock
) -> None:
    token = _mint(service).token
    clock.now = T0 + TTL + DEFAULT_LEEWAY - 1
    assert service.introspect(token).active
    clock.now = T0 + TTL + DEFAULT_LEEWAY
    assert service.introspect(token) == INACTIVE


def test_a_superseded_token_and_an_ended_invocations_token_are_inactive(
    service: TokenService,
) -> None:
    old = _mint(service).token
    other = _mint(service, lane="lane-1").token
    new = _mint(service).token  # a refresh mints for the same pair
    assert service.introspect(old) == INACTIVE
    assert service.introspect(new).active and service.introspect(other).active
    service.revoke_invocation("inv-1")
    assert service.introspect(new) == INACTIVE
    assert service.introspect(other) == INACTIVE


def test_every_refused_token_is_the_same_bare_inactive_answer(
    service: TokenService, tmp_path: pathlib.Path, clock: FakeClock
) -> None:
    token = _mint(service).token
    body, _, footer = token.removeprefix(paseto.HEADER).partition(".")
    stranger = TokenService("node-b", KeyRing.open(tmp_path / "b"), ttl=TTL, clock=clock)
    flipped = body[:10] + ("A" if body[10] != "A" else "B") + body[11:]
    refused = [
        "",
        "garbage",
        "v4.local." + body,
        paseto.HEADER + body,  # no footer: no key id
        f"{paseto.HEADER}{flipped}.{footer}",  # bad signature
        _mint(stranger).token,  # unknown key
        token + "A" * paseto.MAX_TOKEN_CHARS,  # oversized
        "v4.public.\udc80",
    ]
    for presented in refused:
        answer = service.introspect(presented)
        assert answer == INACTIVE
        assert msgspec.json.encode(answer) == b'{"active":false}'


def test_a_token_of_a_retired_key_is_inactive(service: TokenService) -> None:
    token = _mint(service).token
    old = service.keyring.active_kid
    service.keyring.rotate()
    assert service.introspect(token).active
    service.keyring.retire(old)
    assert service.introspect(token) == INACTIVE


def test_the_key_set_names_the_signing_key_as_paserk_with_its_pid(
    service: TokenService,
) -> None:
    keys = service.key_set()
    assert keys.issuer == "node-a"
    assert keys.implicit_assertion.encode() == service.implicit_assertion()
    [key] = keys.keys
    assert key.status is KeyStatus.ACTIVE and key.verifies_until is None
    assert key.kid == service.keyring.active_kid and key.paserk.startswith("k4.public.")
    public = paseto.load_paserk_public(key.paserk)
    assert paseto.paserk_pid(public) == key.kid
    # What it publishes verifies what the node signs.
    token = _mint(service).token
    payload, _ = paseto.verify(token, public, implicit=keys.implicit_assertion.encode())
    assert b'"sub":"inv-1"' in payload


def test_a_rotated_key_is_listed_until_its_last_token_expires_and_a_retired_one_never(
    service: TokenService, clock: FakeClock
) -> None:
    first = service.keyring.active_kid
    _mint(service)
    clock.now = T0 + 100
    _mint(service, "inv-2")  # the later token decides until when the key verifies
    second = service.keyring.rotate()
    keys = service.key_set().keys
    assert [(k.kid, k.status) for k in keys] == [
        (second, KeyStatus.ACTIVE),
        (first, KeyStatus.VERIFY_ONLY),
    ]
    until = T0 + 100 + TTL + DEFAULT_LEEWAY
    assert keys[1].verifies_until == datetime.datetime.fromtimestamp(until, tz=datetime.UTC)
    clock.now = until - 1
    assert len(service.key_set().keys) == 2
    clock.now = until
    assert [k.kid for k in service.key_set().keys] == [second]
    # Never signed here (known only from disk): listed, with no end known.
    third = service.keyring.rotate()
    assert [(k.kid, k.verifies_until) for k in service.key_set().keys] == [
        (third, None),
        (second, None),
    ]
    service.keyring.retire(second)
    assert [k.kid for k in service.key_set().keys] == [third]


def test_the_key_set_is_bounded_and_keeps_the_newest(service: TokenService) -> None:
    kids = [service.keyring.active_kid]
    for _ in range(MAX_PUBLISHED_KEYS + 4):
        kids.append(service.keyring.rotate())
    published = [k.kid for k in service.key_set().keys]
    assert len(published) == MAX_PUBLISHED_KEYS
    assert published == kids[::-1][:MAX_PUBLISHED_KEYS]


def test_signing_bookkeeping_forgets_keys_that_left_the_ring(service: TokenService) -> None:
    for _ in range(5):
        old = service.keyring.active_kid
        _mint(service)
        service.keyring.rotate()
        service.keyring.retire(old)
    _mint(service)
    assert len(service._signed_until) == 1
