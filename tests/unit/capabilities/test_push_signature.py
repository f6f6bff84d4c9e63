"""Push signatures: what a verifier accepts and what it refuses, on a fake clock,
and the documented scheme checked with pyseto, an independent PASETO implementation."""

from __future__ import annotations

import json
import pathlib

import pyseto
import pytest

from capabilities import Isolation, KeyRing, LaneOp, TokenService
from capabilities.push_signature import (
    PUSH_LIFETIME,
    PushRefusal,
    PushRefused,
    PushSigner,
    PushVerifier,
    body_digest,
    keys_of,
)

AUD = "https://scheduler.example/v1/telemetry"
BODY = b'{"node_id":"node-a","sequence":7}'


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ring(tmp_path: pathlib.Path) -> KeyRing:
    return KeyRing.open(tmp_path / "node")


def verifier(ring: KeyRing, clock: Clock, **options: int) -> PushVerifier:
    published = TokenService("node-a", ring, ttl=600).key_set()
    keys = keys_of(published)
    return PushVerifier("node-a", AUD, keys.get, clock=clock, **options)


def refusal(check: PushVerifier, signature: str | None, body: bytes = BODY) -> PushRefusal:
    with pytest.raises(PushRefused) as raised:
        check.verify(signature, body)
    return raised.value.reason


def test_a_signed_push_verifies_once_with_the_published_keys(ring: KeyRing) -> None:
    clock = Clock()
    signature = PushSigner(ring, "node-a", AUD, clock=clock).sign(BODY)
    check = verifier(ring, clock)
    claims = check.verify(signature, BODY)
    assert (claims.iss, claims.aud, claims.body_sha256) == ("node-a", AUD, body_digest(BODY))
    assert refusal(check, signature) is PushRefusal.REPLAYED
    # Each push is signed afresh: the next one has a new nonce and verifies.
    assert check.verify(PushSigner(ring, "node-a", AUD, clock=clock).sign(BODY), BODY)


def test_tampered_foreign_and_misdirected_pushes_are_refused(
    ring: KeyRing, tmp_path: pathlib.Path
) -> None:
    clock = Clock()
    check = verifier(ring, clock)
    signature = PushSigner(ring, "node-a", AUD, clock=clock).sign(BODY)
    assert refusal(check, None) is PushRefusal.MISSING
    assert refusal(check, "v4.public.!!") is PushRefusal.MALFORMED
    assert refusal(check, signature, BODY + b" ") is PushRefusal.BODY_MISMATCH
    flipped = signature[:20] + ("A" if signature[20] != "A" else "B") + signature[21:]
    assert refusal(check, flipped) in {PushRefusal.BAD_SIGNATURE, PushRefusal.MALFORMED}
    other = KeyRing.open(tmp_path / "impostor")
    assert refusal(check, PushSigner(other, "node-a", AUD, clock=clock).sign(BODY)) is (
        PushRefusal.UNKNOWN_KEY
    )
    # Another node's push, even one whose key the scheduler holds under this node.
    node_b = PushSigner(ring, "node-b", AUD, clock=clock).sign(BODY)
    assert refusal(check, node_b) is PushRefusal.BAD_SIGNATURE
    elsewhere = PushSigner(ring, "node-a", "https://other.example/", clock=clock).sign(BODY)
    assert refusal(check, elsewhere) is PushRefusal.WRONG_AUDIENCE
    # None of the refusals used up the real push's nonce.
    assert check.verify(signature, BODY).iss == "node-a"


def test_a_capability_token_is_never_a_push_signature(ring: KeyRing) -> None:
    clock = Clock()
    tokens = TokenService("node-a", ring, ttl=600, clock=clock)
    token = tokens.mint(
        invocation_id="inv-1",
        lane_id="lane-a",
        ops=[LaneOp.EXECUTE],
        vram_bytes=0,
        isolation=Isolation.SHARED,
        deadline=None,
    ).token
    assert refusal(verifier(ring, clock), token) is PushRefusal.BAD_SIGNATURE


def test_stale_and_future_pushes_are_refused_and_a_replay_never_comes_back(
    ring: KeyRing,
) -> None:
    clock = Clock()
    check = verifier(ring, clock)
    signature = PushSigner(ring, "node-a", AUD, clock=clock).sign(BODY)
    early = PushSigner(ring, "node-a", AUD, clock=Clock(clock.now + 60)).sign(BODY)
    assert refusal(check, early) is PushRefusal.NOT_YET_VALID
    check.verify(signature, BODY)
    clock.now += PUSH_LIFETIME + 6  # past exp and the 5 s leeway
    # The nonce is forgotten now, and the push is refused as stale instead.
    assert refusal(check, signature) is PushRefusal.STALE
    assert check.remembered == 0


def test_remembered_nonces_are_bounded_and_fail_closed(ring: KeyRing) -> None:
    clock = Clock()
    check = verifier(ring, clock, max_nonces=3)
    sign = PushSigner(ring, "node-a", AUD, clock=clock).sign
    for _ in range(3):
        check.verify(sign(BODY), BODY)
    assert refusal(check, sign(BODY)) is PushRefusal.NONCES_FULL
    assert check.remembered == 3
    clock.now += PUSH_LIFETIME + 6
    check.verify(sign(BODY), BODY)  # the old ones expired and were forgotten
    assert check.remembered == 1


def test_the_documented_scheme_verifies_in_pyseto(ring: KeyRing) -> None:
    # docs/telemetry.md: v4.public, footer {"kid"}, implicit assertion with the purpose.
    clock = Clock()
    signature = PushSigner(ring, "node-a", AUD, clock=clock).sign(BODY)
    kid = ring.active_kid
    key = pyseto.Key.from_paserk(ring.public_paserks()[kid])
    implicit = json.dumps({"node_id": "node-a", "purpose": "telemetry"}, separators=(",", ":"))
    decoded = pyseto.decode(key, signature, implicit_assertion=implicit.encode(), deserializer=json)
    assert decoded.footer == {"kid": kid}
    payload = decoded.payload
    assert isinstance(payload, dict)
    assert set(payload) == {"iss", "aud", "iat", "exp", "jti", "body_sha256"}
    assert (payload["iss"], payload["aud"], payload["body_sha256"]) == (
        "node-a",
        AUD,
        body_digest(BODY),
    )
    with pytest.raises(pyseto.VerifyError):
        pyseto.decode(key, signature, implicit_assertion=b'{"node_id":"node-a"}')
