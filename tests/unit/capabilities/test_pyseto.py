"""Cross-checks against pyseto, an independent PASETO implementation.

Our tokens verify in pyseto with nothing but our exported k4.public key and
the node's implicit assertion; tokens pyseto signs with our key verify here.
"""

from __future__ import annotations

import json
import pathlib
import time

import pyseto
import pytest

from capabilities import (
    Isolation,
    KeyRing,
    LaneOp,
    TokenRefusal,
    TokenRefused,
    TokenService,
    paseto,
)
from capabilities import claims as claims_module


@pytest.fixture
def service(tmp_path: pathlib.Path) -> TokenService:
    # pyseto checks exp against the real clock, so these tokens use it too.
    return TokenService("node-a", KeyRing.open(tmp_path), ttl=600)


def _mint(service: TokenService) -> str:
    return service.mint(
        invocation_id="inv-1",
        lane_id="lane-a",
        ops=frozenset({LaneOp.EXECUTE, LaneOp.MEMORY_RESERVE}),
        vram_bytes=1 << 20,
        isolation=Isolation.PARTITIONED,
        deadline=time.time() + 60,
    ).token


def test_our_tokens_verify_in_pyseto_with_the_exported_public_key(service: TokenService) -> None:
    token = _mint(service)
    kid = service.keyring.active_kid
    key = pyseto.Key.from_paserk(service.keyring.public_paserks()[kid])
    decoded = pyseto.decode(
        key, token, implicit_assertion=service.implicit_assertion(), deserializer=json
    )
    assert decoded.payload["sub"] == "inv-1"
    assert decoded.payload["aud"] == "lane-a"
    assert decoded.payload["ops"] == ["execute", "memory_reserve"]
    assert decoded.footer == {"kid": kid}
    # pyseto computes the same PASERK id for our key.
    assert key.to_paserk_id() == kid


def test_pyseto_refuses_our_token_bound_to_another_node(service: TokenService) -> None:
    key = pyseto.Key.from_paserk(service.keyring.public_paserks()[service.keyring.active_kid])
    with pytest.raises(pyseto.VerifyError):
        pyseto.decode(key, _mint(service), implicit_assertion=b'{"node_id":"node-b"}')


def test_tokens_pyseto_signs_with_our_key_verify_here(service: TokenService) -> None:
    kid, secret = service.keyring.signing_key()
    key = pyseto.Key.from_paserk(paseto.paserk_secret(secret))
    now = time.time()
    claims = claims_module.Claims(
        iss="node-a",
        sub="inv-9",
        aud="lane-a",
        iat=claims_module.from_unix(now),
        nbf=claims_module.from_unix(now),
        exp=claims_module.from_unix(now + 120),
        jti="ab" * 16,
        ops=frozenset({LaneOp.EXECUTE}),
        vram_bytes=42,
        isolation=Isolation.SHARED,
    )
    token = pyseto.encode(
        key,
        payload=claims_module.encode(claims),
        footer=json.dumps({"kid": kid}).encode(),
        implicit_assertion=service.implicit_assertion(),
    )
    # Authority needs more than a signature: the token must be the current one.
    service.live.admit(claims)
    validated = service.validator().validate(
        token.decode(), lane_id="lane-a", op=LaneOp.EXECUTE, vram_bytes=42
    )
    assert validated == claims


def test_a_pyseto_token_without_the_node_binding_is_refused(service: TokenService) -> None:
    kid, secret = service.keyring.signing_key()
    key = pyseto.Key.from_paserk(paseto.paserk_secret(secret))
    token = pyseto.encode(key, payload=b"{}", footer=json.dumps({"kid": kid}).encode())
    with pytest.raises(TokenRefused) as refused:
        service.validator().validate(token.decode(), lane_id="lane-a", op=LaneOp.EXECUTE)
    assert refused.value.reason is TokenRefusal.BAD_SIGNATURE


def test_pyseto_agrees_on_the_paserk_encodings(service: TokenService) -> None:
    _, secret = service.keyring.signing_key()
    ours = paseto.paserk_secret(secret)
    assert pyseto.Key.from_paserk(ours).to_paserk() == ours
    public = paseto.paserk_public(secret.public_key())
    assert pyseto.Key.from_paserk(public).to_paserk() == public
