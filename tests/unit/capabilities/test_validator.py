"""The lane owner's validator: every refusal reason, their order, and the cache."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from capabilities import (
    Isolation,
    KeyRing,
    LaneOp,
    LaneValidator,
    TokenRefusal,
    TokenRefused,
    TokenService,
    paseto,
)
from capabilities.claims import decode_claims
from tests.fakes.clock import T0, FakeClock

R = TokenRefusal


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def service(tmp_path: pathlib.Path, clock: FakeClock) -> TokenService:
    return TokenService("node-a", KeyRing.open(tmp_path / "a"), ttl=600, clock=clock, leeway=5)


@pytest.fixture
def validator(service: TokenService) -> LaneValidator:
    return service.validator()


def _mint(service: TokenService, invocation: str = "inv-1", lane: str = "lane-a") -> str:
    return service.mint(
        invocation_id=invocation,
        lane_id=lane,
        ops=frozenset({LaneOp.MEMORY_RESERVE, LaneOp.EXECUTE}),
        vram_bytes=1000,
        isolation=Isolation.SANDBOX,
        deadline=None,
    ).token


def _claims(**overrides: Any) -> dict[str, Any]:
    claims: dict[str, Any] = {
        "iss": "node-a",
        "sub": "inv-1",
        "aud": "lane-a",
        "iat": "2027-01-15T08:00:00Z",
        "nbf": "2027-01-15T08:00:00Z",
        "exp": "2027-01-15T08:10:00Z",
        "jti": "0123456789abcdef0123456789abcdef",
        "ops": ["execute"],
        "vram_bytes": 1000,
        "isolation": "sandbox",
    }
    claims.update(overrides)
    return claims


def _sign(
    service: TokenService,
    payload: dict[str, Any] | bytes,
    *,
    footer: bytes | None = None,
    implicit: bytes | None = None,
    secret: Ed25519PrivateKey | None = None,
) -> str:
    kid, ours = service.keyring.signing_key()
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return paseto.sign(
        secret or ours,
        body,
        footer=json.dumps({"kid": kid}).encode() if footer is None else footer,
        implicit=service.implicit_assertion() if implicit is None else implicit,
    )


def _reason(validator: LaneValidator, token: str, **kwargs: Any) -> TokenRefusal:
    args: dict[str, Any] = {"lane_id": "lane-a", "op": LaneOp.EXECUTE}
    args.update(kwargs)
    with pytest.raises(TokenRefused) as refused:
        validator.validate(token, **args)
    return refused.value.reason


def test_a_fresh_token_is_authorised(service: TokenService, validator: LaneValidator) -> None:
    token = _mint(service)
    claims = validator.validate(token, lane_id="lane-a", op=LaneOp.EXECUTE, vram_bytes=1000)
    assert (claims.sub, claims.aud, claims.vram_bytes) == ("inv-1", "lane-a", 1000)
    validator.validate(token, lane_id="lane-a", op=LaneOp.MEMORY_RESERVE)


def test_a_hand_signed_token_is_authorised_only_while_it_is_current(
    service: TokenService, validator: LaneValidator
) -> None:
    """Signed with our key, good claims, but never issued: refused until it is the
    current token of its invocation on its lane."""
    token = _sign(service, _claims())
    assert _reason(validator, token) is R.REVOKED
    service.live.admit(decode_claims(json.dumps(_claims()).encode()))
    assert validator.validate(token, lane_id="lane-a", op=LaneOp.EXECUTE)


def test_format_refusals(service: TokenService, validator: LaneValidator) -> None:
    token = _mint(service)
    assert _reason(validator, token + "A" * 5000) is R.OVERSIZED
    assert _reason(validator, "v4.local." + token[10:]) is R.BAD_HEADER
    assert _reason(validator, "v2.public." + token[10:]) is R.BAD_HEADER
    assert _reason(validator, "") is R.BAD_HEADER
    assert _reason(validator, token + "==") is R.BAD_ENCODING
    for standard_only in ("+", "/", "=", " ", "é"):  # outside the base64url alphabet
        assert _reason(validator, token[:20] + standard_only + token[21:]) is R.BAD_ENCODING
    assert _reason(validator, token + ".") is R.BAD_ENCODING
    assert _reason(validator, token + ".e30") is R.BAD_ENCODING


def test_key_refusals(
    tmp_path: pathlib.Path, service: TokenService, validator: LaneValidator
) -> None:
    assert _reason(validator, _sign(service, _claims(), footer=b"")) is R.UNKNOWN_KEY
    assert _reason(validator, _sign(service, _claims(), footer=b"not json")) is R.BAD_ENCODING
    extra = json.dumps({"kid": service.keyring.active_kid, "wpk": "x"}).encode()
    assert _reason(validator, _sign(service, _claims(), footer=extra)) is R.BAD_ENCODING
    unknown = json.dumps({"kid": "k4.pid." + "A" * 44}).encode()
    assert _reason(validator, _sign(service, _claims(), footer=unknown)) is R.UNKNOWN_KEY


def test_a_token_from_another_node_is_refused(
    tmp_path: pathlib.Path, clock: FakeClock, validator: LaneValidator
) -> None:
    other = TokenService("node-b", KeyRing.open(tmp_path / "b"), ttl=600, clock=clock)
    assert _reason(validator, _mint(other)) is R.UNKNOWN_KEY
    # Even with our own node id claimed, their key is not in our ring.
    assert _reason(validator, _sign(other, _claims())) is R.UNKNOWN_KEY


def test_a_token_signed_by_a_stranger_under_our_kid_is_refused(
    service: TokenService, validator: LaneValidator
) -> None:
    forged = _sign(service, _claims(), secret=Ed25519PrivateKey.generate())
    assert _reason(validator, forged) is R.BAD_SIGNATURE


def test_signature_refusals(service: TokenService, validator: LaneValidator) -> None:
    token = _mint(service)
    body, footer = token[10:].split(".")
    payload = paseto.b64url_decode(body)
    tampered = payload.replace(b'"vram_bytes":1000', b'"vram_bytes":9000')
    assert tampered != payload
    forged = "v4.public." + paseto.b64url_encode(tampered) + "." + footer
    assert _reason(validator, forged) is R.BAD_SIGNATURE
    # Signed for another node id (implicit assertion), with our key.
    elsewhere = _sign(service, _claims(), implicit=b'{"node_id":"node-b"}')
    assert _reason(validator, elsewhere) is R.BAD_SIGNATURE


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        b"[]",
        json.dumps(_claims(vram_bytes="1000")).encode(),
        json.dumps(_claims(vram_bytes=True)).encode(),
        json.dumps(_claims(vram_bytes=-1)).encode(),
        json.dumps(_claims(ops="execute")).encode(),
        json.dumps(_claims(ops=["execute", "rm_rf"])).encode(),
        json.dumps(_claims(isolation="none")).encode(),
        json.dumps(_claims(exp="2027-01-15T08:10:00")).encode(),  # no offset
        json.dumps(_claims(exp="tomorrow")).encode(),
        json.dumps(_claims(exp=1_800_000_600)).encode(),  # numbers are not RFC 3339
        json.dumps(_claims(nbf="2027-01-15T08:10:00Z")).encode(),  # nbf == exp
        json.dumps(_claims(exp="2027-01-15T09:00:01Z")).encode(),  # longer than an hour
        json.dumps(_claims(jti="short")).encode(),
        json.dumps(_claims(aud=["lane-a", "lane-b"])).encode(),  # one token, one lane
        json.dumps(_claims(scope="admin")).encode(),  # unknown field
        json.dumps({k: v for k, v in _claims().items() if k != "jti"}).encode(),
    ],
)
def test_claims_refusals(service: TokenService, validator: LaneValidator, payload: bytes) -> None:
    assert _reason(validator, _sign(service, payload)) is R.BAD_CLAIMS


def test_wrong_issuer(service: TokenService, validator: LaneValidator) -> None:
    assert _reason(validator, _sign(service, _claims(iss="node-b"))) is R.WRONG_ISSUER


def test_time_window_with_leeway(
    service: TokenService, validator: LaneValidator, clock: FakeClock
) -> None:
    token = _mint(service)  # nbf = T0, exp = T0 + 600, leeway 5
    clock.now = T0 - 5.001
    assert _reason(validator, token) is R.NOT_YET_VALID
    clock.now = T0 - 5
    validator.validate(token, lane_id="lane-a", op=LaneOp.EXECUTE)
    clock.now = T0 + 604.999
    validator.validate(token, lane_id="lane-a", op=LaneOp.EXECUTE)
    clock.now = T0 + 605
    assert _reason(validator, token) is R.EXPIRED


def test_a_token_for_lane_a_is_refused_on_lane_b(
    service: TokenService, validator: LaneValidator
) -> None:
    token = _mint(service, lane="lane-a")
    validator.validate(token, lane_id="lane-a", op=LaneOp.EXECUTE)
    assert _reason(validator, token, lane_id="lane-b") is R.WRONG_AUDIENCE
    assert _reason(validator, token, lane_id="lane-a ") is R.WRONG_AUDIENCE


def test_scope_refusals(service: TokenService, validator: LaneValidator) -> None:
    token = _mint(service)  # execute + memory_reserve, 1000 bytes
    assert _reason(validator, token, op=LaneOp.MEMORY_RELEASE) is R.OP_NOT_GRANTED
    assert _reason(validator, token, vram_bytes=1001) is R.VRAM_OVER_BUDGET
    with pytest.raises(ValueError):
        validator.validate(token, lane_id="lane-a", op=LaneOp.EXECUTE, vram_bytes=-1)


def test_reasons_come_in_the_documented_order(
    service: TokenService, validator: LaneValidator, clock: FakeClock
) -> None:
    token = _mint(service, lane="lane-a")
    service.revoke_invocation("inv-1")
    # revoked, wrong lane, op not granted and over budget at once: audience first
    assert (
        _reason(validator, token, lane_id="lane-b", op=LaneOp.MEMORY_RELEASE, vram_bytes=10**9)
        is R.WRONG_AUDIENCE
    )
    # revoked and out of scope: revoked first
    assert _reason(validator, token, op=LaneOp.MEMORY_RELEASE) is R.REVOKED
    # live but not as issued, and out of scope: not as issued first
    live = service.mint(
        invocation_id="inv-2", lane_id="lane-a", ops=[LaneOp.EXECUTE], vram_bytes=0,
        isolation=Isolation.SANDBOX, deadline=None,
    ).claims  # fmt: skip
    wider = _claims(sub="inv-2", jti=live.jti, vram_bytes=2**40, ops=["execute"])
    resigned = _sign(service, wider)
    assert _reason(validator, resigned, op=LaneOp.MEMORY_RELEASE) is R.NOT_AS_ISSUED
    clock.now = T0 + 3600
    # expired beats all of those
    assert _reason(validator, token, lane_id="lane-b") is R.EXPIRED
    # wrong issuer is found before the time
    assert _reason(validator, _sign(service, _claims(iss="x"))) is R.WRONG_ISSUER
    # a key given twice is found before the issuer
    doubled = json.dumps(_claims(iss="x"))[:-1] + ', "iss": "node-a"}'
    assert _reason(validator, _sign(service, doubled.encode())) is R.DUPLICATE_CLAIM
    # and a bad signature before the claims are even read
    bad = _sign(service, b"not json", secret=Ed25519PrivateKey.generate())
    assert _reason(validator, bad) is R.BAD_SIGNATURE
    # order of the enum is the order of the checks
    assert list(R) == [
        R.OVERSIZED,
        R.BAD_HEADER,
        R.BAD_ENCODING,
        R.UNKNOWN_KEY,
        R.BAD_SIGNATURE,
        R.BAD_CLAIMS,
        R.DUPLICATE_CLAIM,
        R.WRONG_ISSUER,
        R.NOT_YET_VALID,
        R.EXPIRED,
        R.WRONG_AUDIENCE,
        R.REVOKED,
        R.NOT_AS_ISSUED,
        R.OP_NOT_GRANTED,
        R.VRAM_OVER_BUDGET,
        R.WRONG_HOLDER,  # the supervisor's check, after a token is otherwise valid
    ]


# --- the cache -----------------------------------------------------------------


def test_the_cache_pays_for_the_signature_once(
    service: TokenService, validator: LaneValidator
) -> None:
    token = _mint(service)
    for _ in range(5):
        validator.validate(token, lane_id="lane-a", op=LaneOp.EXECUTE)
    assert (validator.misses, validator.hits) == (1, 4)
    assert len(validator) == 1


def test_the_cache_never_skips_time_revocation_or_scope(
    service: TokenService, validator: LaneValidator, clock: FakeClock
) -> None:
    token = _mint(service)
    validator.validate(token, lane_id="lane-a", op=LaneOp.EXECUTE)
    assert _reason(validator, token, lane_id="lane-b") is R.WRONG_AUDIENCE
    assert _reason(validator, token, op=LaneOp.MEMORY_RELEASE) is R.OP_NOT_GRANTED
    assert _reason(validator, token, vram_bytes=10**6) is R.VRAM_OVER_BUDGET
    clock.now = T0 - 60
    assert _reason(validator, token) is R.NOT_YET_VALID
    clock.now = T0 + 10
    service.revoke_invocation("inv-1")
    assert _reason(validator, token) is R.REVOKED
    assert validator.hits >= 5
    clock.now = T0 + 10_000
    assert _reason(validator, token) is R.EXPIRED
    assert len(validator) == 0  # an expired token leaves the cache


def test_revocation_reaches_every_validator(service: TokenService) -> None:
    first, second = service.validator(), service.validator(cache_size=0)
    token = _mint(service)
    for v in (first, second):
        v.validate(token, lane_id="lane-a", op=LaneOp.EXECUTE)
    service.revoke_invocation("inv-1")
    for v in (first, second):
        assert _reason(v, token) is R.REVOKED


def test_retiring_a_key_rejects_its_tokens_even_cached(
    service: TokenService, validator: LaneValidator
) -> None:
    old_token = _mint(service)
    old_kid = service.keyring.active_kid
    validator.validate(old_token, lane_id="lane-a", op=LaneOp.EXECUTE)
    service.keyring.rotate()
    new_token = _mint(service, "inv-2")
    validator.validate(old_token, lane_id="lane-a", op=LaneOp.EXECUTE)  # overlap window
    service.keyring.retire(old_kid)
    assert _reason(validator, old_token) is R.UNKNOWN_KEY
    validator.validate(new_token, lane_id="lane-a", op=LaneOp.EXECUTE)


def test_the_cache_is_bounded_lru(service: TokenService) -> None:
    validator = service.validator(cache_size=2)
    a, b, c = (_mint(service, f"inv-{i}") for i in range(3))
    for token in (a, b, a, c):  # c evicts b, the least recently used
        validator.validate(token, lane_id="lane-a", op=LaneOp.EXECUTE)
    assert len(validator) == 2
    hits = validator.hits
    validator.validate(a, lane_id="lane-a", op=LaneOp.EXECUTE)
    assert validator.hits == hits + 1
    validator.validate(b, lane_id="lane-a", op=LaneOp.EXECUTE)
    assert validator.hits == hits + 1  # b had been evicted
    validator.clear()
    assert len(validator) == 0


def test_refused_tokens_are_not_cached(service: TokenService, validator: LaneValidator) -> None:
    _reason(validator, _sign(service, _claims(iss="node-b")))
    _reason(validator, _sign(service, _claims(), secret=Ed25519PrivateKey.generate()))
    assert len(validator) == 0


def test_authenticate_checks_only_the_token_itself(
    service: TokenService, validator: LaneValidator, clock: FakeClock
) -> None:
    token = _mint(service)
    clock.now = T0 + 10_000
    assert validator.authenticate(token).sub == "inv-1"
    with pytest.raises(TokenRefused) as refused:
        validator.authenticate("x" * 10_000)
    assert refused.value.reason is R.OVERSIZED


def test_refusal_messages_carry_the_reason(service: TokenService, validator: LaneValidator) -> None:
    with pytest.raises(TokenRefused, match=r"^wrong_audience"):
        validator.validate(_mint(service), lane_id="lane-z", op=LaneOp.EXECUTE)


def test_authenticate_also_notices_a_retired_key(
    service: TokenService, validator: LaneValidator
) -> None:
    token = _mint(service)
    old_kid = service.keyring.active_kid
    validator.authenticate(token)
    service.keyring.rotate()
    service.keyring.retire(old_kid)
    with pytest.raises(TokenRefused) as refused:
        validator.authenticate(token)
    assert refused.value.reason is R.UNKNOWN_KEY
