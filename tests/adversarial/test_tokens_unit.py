"""Hostile capability tokens against the capabilities package itself (no HTTP).

Every case is refused with its typed reason, and a refusal changes nothing: no
live token appears or disappears, no invocation gains or loses one, and nothing that
failed authentication lands in the validator's cache.
"""

from __future__ import annotations

import base64
import binascii
import json
import pathlib
from collections.abc import Callable

import pyseto
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from capabilities import LaneOp, LaneValidator, TokenRefusal, TokenRefused, paseto
from tests.adversarial.fixtures import craft, fresh_kid, kid_footer
from tests.adversarial.token_authority import ALL_OPS, LANE, NODE, OTHER_LANE, Authority

pytestmark = pytest.mark.hostile("tokens")


@pytest.fixture
def node(tmp_path: pathlib.Path) -> Authority:
    return Authority(tmp_path)


def _body_and_footer(token: str) -> tuple[str, str]:
    body, _, footer = token[len(paseto.HEADER) :].partition(".")
    return body, footer


# --- other versions and purposes ---------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        "v4.local.",
        "v3.public.",
        "v2.public.",
        "v1.public.",
        "V4.public.",
        "v4.PUBLIC.",
        " v4.public.",
    ],
)
def test_token_other_version_or_purpose_header_refused(node: Authority, header: str) -> None:
    token = node.mint().token
    node.refuse(header + token[len(paseto.HEADER) :], TokenRefusal.BAD_HEADER)


def _pem(secret: Ed25519PrivateKey) -> bytes:
    return secret.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())


def test_token_genuine_v2_public_with_our_key_refused(node: Authority) -> None:
    """Key/purpose confusion: our own Ed25519 key, a correct v2.public signature."""
    claims = json.loads(paseto.parse(node.mint().token).payload)
    key = pyseto.Key.new(version=2, purpose="public", key=_pem(node.secret()))
    token = pyseto.encode(key, claims, footer=kid_footer(node.keyring.active_kid)).decode()
    assert token.startswith("v2.public.")
    node.refuse(token, TokenRefusal.BAD_HEADER)


def test_token_genuine_v4_local_refused(node: Authority) -> None:
    """A symmetric v4.local token whose key is the raw seed of our signing key."""
    claims = json.loads(paseto.parse(node.mint().token).payload)
    seed = node.secret().private_bytes_raw()
    key = pyseto.Key.new(version=4, purpose="local", key=seed)
    token = pyseto.encode(key, claims, footer=kid_footer(node.keyring.active_kid)).decode()
    assert token.startswith("v4.local.")
    node.refuse(token, TokenRefusal.BAD_HEADER)


# --- keys --------------------------------------------------------------------------


def test_token_signed_by_foreign_key_with_our_kid_refused(node: Authority) -> None:
    minted = node.mint()
    claims = json.loads(paseto.parse(minted.token).payload)
    forged = craft(
        Ed25519PrivateKey.generate(),
        claims,
        footer=kid_footer(node.keyring.active_kid),
        node_id=NODE,
    )
    node.refuse(forged, TokenRefusal.BAD_SIGNATURE)


def test_token_signed_by_foreign_key_with_its_own_kid_refused(node: Authority) -> None:
    claims = json.loads(paseto.parse(node.mint().token).payload)
    key, kid = fresh_kid()
    node.refuse(craft(key, claims, footer=kid_footer(kid), node_id=NODE), TokenRefusal.UNKNOWN_KEY)


@pytest.mark.parametrize(
    ("footer", "reason"),
    [
        (b"", TokenRefusal.UNKNOWN_KEY),
        (b'{"kid":"k4.pid.' + b"A" * 44 + b'"}', TokenRefusal.UNKNOWN_KEY),
        (b'{"kid":"k4.lid.' + b"A" * 44 + b'"}', TokenRefusal.BAD_ENCODING),
        (b'{"kid":"k4.public.' + b"A" * 43 + b'"}', TokenRefusal.BAD_ENCODING),
        (b"not json", TokenRefusal.BAD_ENCODING),
        (b'{"kid":null}', TokenRefusal.BAD_ENCODING),
        (b'["k4.pid.xx"]', TokenRefusal.BAD_ENCODING),
    ],
    ids=["none", "unknown_pid", "local_kid", "public_key_in_footer", "not_json", "null", "list"],
)
def test_token_unknown_or_malformed_kid_refused(
    node: Authority, footer: bytes, reason: TokenRefusal
) -> None:
    claims = json.loads(paseto.parse(node.mint().token).payload)
    node.refuse(craft(node.secret(), claims, footer=footer, node_id=NODE), reason)


def test_token_footer_with_extra_field_refused(node: Authority) -> None:
    claims = json.loads(paseto.parse(node.mint().token).payload)
    footer = json.dumps({"kid": node.keyring.active_kid, "alg": "none"}).encode()
    node.refuse(
        craft(node.secret(), claims, footer=footer, node_id=NODE), TokenRefusal.BAD_ENCODING
    )


def test_token_footer_swapped_for_another_kid_of_the_ring_refused(node: Authority) -> None:
    minted = node.mint()
    node.keyring.rotate()  # two keys now verify; point the old token at the new one
    body, _ = _body_and_footer(minted.token)
    swapped = paseto.HEADER + body + "." + paseto.b64url_encode(kid_footer(node.keyring.active_kid))
    node.refuse(swapped, TokenRefusal.BAD_SIGNATURE)


def test_token_of_retired_key_refused_even_when_cached(node: Authority) -> None:
    minted = node.mint()
    node.validator.validate(minted.token, lane_id=LANE, op=LaneOp.EXECUTE)
    assert len(node.validator) == 1
    old = node.keyring.active_kid
    node.keyring.rotate()
    node.keyring.retire(old)
    node.refuse(minted.token, TokenRefusal.UNKNOWN_KEY)
    assert len(node.validator) == 0


# --- tampering ---------------------------------------------------------------------


def _flip_payload_byte(token: str, index: int) -> str:
    parsed = paseto.parse(token)
    payload = bytearray(parsed.payload)
    payload[index] ^= 0x01
    body = paseto.b64url_encode(bytes(payload) + parsed.signature)
    return paseto.HEADER + body + "." + paseto.b64url_encode(parsed.footer)


@pytest.mark.parametrize("index", [0, 10, -2])
def test_token_tampered_payload_refused(node: Authority, index: int) -> None:
    node.refuse(_flip_payload_byte(node.mint().token, index), TokenRefusal.BAD_SIGNATURE)


def test_token_tampered_signature_refused(node: Authority) -> None:
    parsed = paseto.parse(node.mint().token)
    signature = bytes([parsed.signature[0] ^ 0x80]) + parsed.signature[1:]
    token = (
        paseto.HEADER
        + paseto.b64url_encode(parsed.payload + signature)
        + "."
        + paseto.b64url_encode(parsed.footer)
    )
    node.refuse(token, TokenRefusal.BAD_SIGNATURE)


def test_token_scope_widened_in_payload_refused(node: Authority) -> None:
    """The attack the signature exists for: more VRAM, more ops, another lane."""
    minted = node.mint(ops=(LaneOp.EXECUTE,), vram=0)
    parsed = paseto.parse(minted.token)
    claims = json.loads(parsed.payload)
    claims.update(vram_bytes=2**40, ops=[op.value for op in ALL_OPS], aud=OTHER_LANE)
    body = paseto.b64url_encode(json.dumps(claims).encode() + parsed.signature)
    token = paseto.HEADER + body + "." + paseto.b64url_encode(parsed.footer)
    node.refuse(token, TokenRefusal.BAD_SIGNATURE, lane_id=OTHER_LANE)


def test_token_bound_to_another_node_by_implicit_assertion_refused(
    tmp_path: pathlib.Path, node: Authority
) -> None:
    """Same keys, same claims, another node id: the implicit assertion differs."""
    other = LaneValidator(
        node_id="node-b",
        keyring=node.keyring,
        live=node.service.live,
        clock=node.clock,
        leeway=5.0,
    )
    node.refuse(node.mint().token, TokenRefusal.BAD_SIGNATURE, validator=other)


def test_token_with_another_issuer_signed_for_this_node_refused(node: Authority) -> None:
    claims = json.loads(paseto.parse(node.mint().token).payload)
    claims["iss"] = "node-b"
    footer = kid_footer(node.keyring.active_kid)
    node.refuse(
        craft(node.secret(), claims, footer=footer, node_id=NODE), TokenRefusal.WRONG_ISSUER
    )


def test_token_every_single_character_substitution_refused(node: Authority) -> None:
    token = node.mint().token
    before = node.counters()
    for index, char in enumerate(token):
        for other in {"A", "_", "."} - {char}:
            mutated = token[:index] + other + token[index + 1 :]
            with pytest.raises(TokenRefused):
                node.validator.validate(mutated, lane_id=LANE, op=LaneOp.EXECUTE)
    assert node.counters() == before
    assert len(node.validator) == 0


@pytest.mark.parametrize(
    ("claims_edit", "ident"),
    [
        (lambda c: c.update(aud=[c["aud"], OTHER_LANE]), "two_audiences"),
        (lambda c: c.update(extra="x"), "unknown_claim"),
        (lambda c: c.pop("jti"), "no_jti"),
        (lambda c: c.update(exp="2999-01-01T00:00:00Z"), "outlives_max_ttl"),
        (lambda c: c.update(nbf=c["exp"]), "empty_window"),
        (lambda c: c.update(exp="2027-01-15T08:00:00"), "naive_time"),
        (lambda c: c.update(vram_bytes=-1), "negative_vram"),
        (lambda c: c.update(vram_bytes=2**64), "huge_vram"),
        (lambda c: c.update(ops=["execute", "root"]), "unknown_op"),
        (lambda c: c.update(jti="x" * 4000), "long_jti"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_token_validly_signed_but_bad_claims_refused(
    node: Authority, claims_edit: Callable[[dict[str, object]], object], ident: str
) -> None:
    claims = json.loads(paseto.parse(node.mint().token).payload)
    claims_edit(claims)
    token = craft(node.secret(), claims, footer=kid_footer(node.keyring.active_kid), node_id=NODE)
    reason = (
        TokenRefusal.OVERSIZED if len(token) > paseto.MAX_TOKEN_CHARS else TokenRefusal.BAD_CLAIMS
    )
    node.refuse(token, reason)


# --- encoding ------------------------------------------------------------------------


def _mint_with_tail(node: Authority, tail: int) -> str:
    """A genuine token whose body segment ends in a partial quantum of `tail` chars."""
    for length in range(1, 40):
        token = node.mint(invocation_id="i" * length).token
        body, _ = _body_and_footer(token)
        if len(body) % 4 == tail:
            return token
    raise AssertionError("no token with that tail")


def _lenient(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


def _set_trailing_bits(segment: str) -> str:
    spare = {2: 4, 3: 2}[len(segment) % 4]  # unused low bits of the last character
    value = _ALPHABET.index(segment[-1]) | ((1 << spare) - 1)
    return segment[:-1] + _ALPHABET[value]


@pytest.mark.parametrize("tail", [2, 3])
def test_token_body_with_trailing_bits_set_refused(node: Authority, tail: int) -> None:
    token = _mint_with_tail(node, tail)
    body, footer = _body_and_footer(token)
    alias = _set_trailing_bits(body)
    assert alias != body and _lenient(alias) == _lenient(body)  # same bytes to a lax decoder
    node.refuse(paseto.HEADER + alias + "." + footer, TokenRefusal.BAD_ENCODING)


def test_token_footer_with_trailing_bits_set_refused(node: Authority) -> None:
    token = node.mint().token
    body, footer = _body_and_footer(token)
    assert len(footer) % 4 in (2, 3)
    alias = _set_trailing_bits(footer)
    assert alias != footer and _lenient(alias) == _lenient(footer)
    node.refuse(paseto.HEADER + body + "." + alias, TokenRefusal.BAD_ENCODING)


@pytest.mark.parametrize("padding", ["=", "==", "==="])
def test_token_body_with_padding_refused(node: Authority, padding: str) -> None:
    token = _mint_with_tail(node, 2)
    body, footer = _body_and_footer(token)
    node.refuse(paseto.HEADER + body + padding + "." + footer, TokenRefusal.BAD_ENCODING)


def test_token_standard_alphabet_refused(node: Authority) -> None:
    """'+' and '/' for '-' and '_': the same bytes to a decoder that mixes alphabets."""
    for _ in range(64):
        token = node.mint().token
        body, footer = _body_and_footer(token)
        if "-" in body or "_" in body:
            break
    else:
        raise AssertionError("no token with '-' or '_' in 64 mints")
    standard = body.replace("-", "+").replace("_", "/")
    assert binascii.a2b_base64(standard + "=" * (-len(standard) % 4)) == _lenient(body)
    node.refuse(paseto.HEADER + standard + "." + footer, TokenRefusal.BAD_ENCODING)


@pytest.mark.parametrize(
    "mutation",
    [
        lambda b: b[:10] + "\n" + b[10:],
        lambda b: b[:10] + " " + b[10:],
        lambda b: b[:10] + "\u0410" + b[11:],  # Cyrillic A for Latin A-ish
        lambda b: b[:10] + "\uff21" + b[11:],  # fullwidth A
        lambda b: b[:10] + "\x00" + b[11:],
        lambda b: b + ".",
        lambda b: b[:-1],
    ],
    ids=["newline", "space", "cyrillic", "fullwidth", "nul", "empty_segment", "truncated"],
)
def test_token_noncanonical_characters_refused(
    node: Authority, mutation: Callable[[str], str]
) -> None:
    token = node.mint().token
    body, footer = _body_and_footer(token)
    mutated = paseto.HEADER + mutation(body) + "." + footer
    with pytest.raises(TokenRefused) as refused:
        node.validator.validate(mutated, lane_id=LANE, op=LaneOp.EXECUTE)
    assert refused.value.reason in (TokenRefusal.BAD_ENCODING, TokenRefusal.BAD_SIGNATURE)


def test_token_with_three_segments_refused(node: Authority) -> None:
    node.refuse(node.mint().token + ".AAAA", TokenRefusal.BAD_ENCODING)


def test_token_shorter_than_a_signature_refused(node: Authority) -> None:
    node.refuse(paseto.HEADER + paseto.b64url_encode(b"x" * 63), TokenRefusal.BAD_ENCODING)


# --- size ------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [paseto.MAX_TOKEN_CHARS + 1, 64 * 1024, 8 * 2**20])
def test_token_oversized_refused_before_parsing(node: Authority, size: int) -> None:
    token = node.mint().token
    node.refuse(token + "A" * (size - len(token)), TokenRefusal.OVERSIZED)


# --- time ------------------------------------------------------------------------------


def test_token_expired_refused_at_exp_plus_leeway(node: Authority) -> None:
    minted = node.mint()
    exp = minted.claims.exp.timestamp()
    node.clock.now = exp + node.service.leeway - 0.5
    node.validator.validate(minted.token, lane_id=LANE, op=LaneOp.EXECUTE)
    node.clock.now = exp + node.service.leeway
    with pytest.raises(TokenRefused) as refused:
        node.validator.validate(minted.token, lane_id=LANE, op=LaneOp.EXECUTE)
    assert refused.value.reason is TokenRefusal.EXPIRED
    assert len(node.validator) == 0  # an expired token leaves the cache


def test_token_not_yet_valid_refused(node: Authority) -> None:
    minted = node.mint()
    node.clock.now = minted.claims.nbf.timestamp() - node.service.leeway - 1
    node.refuse(minted.token, TokenRefusal.NOT_YET_VALID)


def test_token_crafted_with_future_nbf_refused(node: Authority) -> None:
    claims = json.loads(paseto.parse(node.mint().token).payload)
    claims["nbf"] = "2027-01-15T10:00:00Z"  # after T0 + leeway, before exp
    claims["exp"] = "2027-01-15T10:30:00Z"
    claims["iat"] = "2027-01-15T09:59:00Z"
    token = craft(node.secret(), claims, footer=kid_footer(node.keyring.active_kid), node_id=NODE)
    node.refuse(token, TokenRefusal.NOT_YET_VALID)


# --- audience, revocation, scope ----------------------------------------------------


def test_token_wrong_lane_refused(node: Authority) -> None:
    node.refuse(node.mint().token, TokenRefusal.WRONG_AUDIENCE, lane_id=OTHER_LANE)


def test_token_revoked_refused_even_when_cached(node: Authority) -> None:
    minted = node.mint()
    node.validator.validate(minted.token, lane_id=LANE, op=LaneOp.EXECUTE)
    live, invocations = node.counters()
    assert node.service.revoke_invocation("inv-1") == 1
    assert node.counters() == (live - 1, invocations - 1)
    node.refuse(minted.token, TokenRefusal.REVOKED)


def test_token_op_not_granted_refused(node: Authority) -> None:
    cpu = node.mint(ops=(LaneOp.EXECUTE,), vram=0).token
    node.refuse(cpu, TokenRefusal.OP_NOT_GRANTED, op=LaneOp.MEMORY_RESERVE)
    node.refuse(cpu, TokenRefusal.OP_NOT_GRANTED, op=LaneOp.MEMORY_RELEASE)


def test_token_vram_over_budget_refused(node: Authority) -> None:
    token = node.mint(vram=2**30).token
    node.validator.validate(token, lane_id=LANE, op=LaneOp.MEMORY_RESERVE, vram_bytes=2**30)
    node.refuse(
        token, TokenRefusal.VRAM_OVER_BUDGET, op=LaneOp.MEMORY_RESERVE, vram_bytes=2**30 + 1
    )


def test_token_of_another_node_with_its_own_keys_refused(
    tmp_path: pathlib.Path, node: Authority
) -> None:
    other = Authority(tmp_path, "node-b")
    node.refuse(other.mint().token, TokenRefusal.UNKNOWN_KEY)
