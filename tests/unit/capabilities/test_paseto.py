"""PASETO v4.public and PASERK k4 against the official test vectors, and the strict decoders."""

from __future__ import annotations

import base64
import json
import pathlib
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from capabilities import TokenRefusal, TokenRefused, paseto

VECTORS = pathlib.Path(__file__).resolve().parents[2] / "vectors" / "paseto"


def _load(name: str) -> list[dict[str, Any]]:
    tests: list[dict[str, Any]] = json.loads((VECTORS / name).read_text())["tests"]
    return tests


V4 = _load("v4.json")
SIGNED = [t for t in V4 if t["name"].startswith("4-S-")]
FAILING = [t for t in V4 if t["name"].startswith("4-F-")]
# The public key the 4-S vectors are signed with (and the one a confused
# verifier would try on the failure vectors).
TEST_PUBLIC = bytes.fromhex(SIGNED[0]["public-key"])


def _ids(tests: list[dict[str, Any]]) -> list[str]:
    return [t["name"] for t in tests]


def test_vector_files_hold_what_we_expect() -> None:
    assert len(SIGNED) == 3
    assert len(FAILING) == 5


@pytest.mark.parametrize("vector", SIGNED, ids=_ids(SIGNED))
def test_signed_vectors_verify_and_decode(vector: dict[str, Any]) -> None:
    public = Ed25519PublicKey.from_public_bytes(bytes.fromhex(vector["public-key"]))
    payload, footer = paseto.verify(
        vector["token"], public, implicit=vector["implicit-assertion"].encode()
    )
    assert payload == vector["payload"].encode()
    assert json.loads(payload) == json.loads(vector["payload"])
    assert footer == vector["footer"].encode()


@pytest.mark.parametrize("vector", SIGNED, ids=_ids(SIGNED))
def test_signed_vectors_are_reproduced_by_our_signer(vector: dict[str, Any]) -> None:
    # Ed25519 is deterministic: signing the same inputs must give the same token.
    secret = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(vector["secret-key-seed"]))
    assert paseto.public_key_bytes(secret.public_key()).hex() == vector["public-key"]
    token = paseto.sign(
        secret,
        vector["payload"].encode(),
        footer=vector["footer"].encode(),
        implicit=vector["implicit-assertion"].encode(),
    )
    assert token == vector["token"]


@pytest.mark.parametrize("vector", SIGNED, ids=_ids(SIGNED))
def test_signed_vectors_fail_with_another_implicit_assertion(vector: dict[str, Any]) -> None:
    public = Ed25519PublicKey.from_public_bytes(bytes.fromhex(vector["public-key"]))
    with pytest.raises(TokenRefused) as refused:
        paseto.verify(vector["token"], public, implicit=b'{"test-vector":"other"}')
    assert refused.value.reason is TokenRefusal.BAD_SIGNATURE


@pytest.mark.parametrize("vector", FAILING, ids=_ids(FAILING))
def test_failure_vectors_fail(vector: dict[str, Any]) -> None:
    candidates = [TEST_PUBLIC]
    if "public-key" in vector:
        candidates.append(bytes.fromhex(vector["public-key"]))
    if "key" in vector:  # a v4.local key offered where a public key belongs
        candidates.append(bytes.fromhex(vector["key"]))
    implicit = vector["implicit-assertion"].encode()
    for raw in candidates:
        public = Ed25519PublicKey.from_public_bytes(raw)
        with pytest.raises(TokenRefused) as refused:
            paseto.verify(vector["token"], public, implicit=implicit)
        assert refused.value.reason in {TokenRefusal.BAD_HEADER, TokenRefusal.BAD_SIGNATURE}


def test_failure_vectors_of_other_versions_and_purposes_fail_on_the_header() -> None:
    for vector in FAILING:
        if not vector["token"].startswith("v4.public."):
            with pytest.raises(TokenRefused) as refused:
                paseto.parse(vector["token"])
            assert refused.value.reason is TokenRefusal.BAD_HEADER, vector["name"]


# --- PASERK -----------------------------------------------------------------

PID = _load("k4.pid.json")
PUBLIC = _load("k4.public.json")
SECRET = _load("k4.secret.json")


@pytest.mark.parametrize("vector", PID, ids=_ids(PID))
def test_k4_pid_vectors(vector: dict[str, Any]) -> None:
    key = bytes.fromhex(vector["key"])
    if vector["expect-fail"]:
        with pytest.raises(ValueError):
            paseto.paserk_pid(key)
    else:
        assert paseto.paserk_pid(key) == vector["paserk"]
        assert paseto.paserk_pid(Ed25519PublicKey.from_public_bytes(key)) == vector["paserk"]


@pytest.mark.parametrize("vector", PUBLIC, ids=_ids(PUBLIC))
def test_k4_public_vectors(vector: dict[str, Any]) -> None:
    key = bytes.fromhex(vector["key"])
    if vector["expect-fail"]:
        with pytest.raises(ValueError):
            paseto.paserk_public(key)
    else:
        assert paseto.paserk_public(key) == vector["paserk"]
        loaded = paseto.load_paserk_public(vector["paserk"])
        assert paseto.public_key_bytes(loaded) == key


@pytest.mark.parametrize("vector", SECRET, ids=_ids(SECRET))
def test_k4_secret_vectors(vector: dict[str, Any]) -> None:
    key = bytes.fromhex(vector["key"])
    if vector["expect-fail"]:
        # A short key, or a key of another version, is not a k4.secret.
        with pytest.raises(ValueError):
            paseto.load_paserk_secret("k4.secret." + paseto.b64url_encode(key))
        return
    secret = paseto.load_paserk_secret(vector["paserk"])
    assert secret.private_bytes_raw().hex() == vector["secret-key-seed"]
    assert paseto.public_key_bytes(secret.public_key()).hex() == vector["public-key"]
    assert paseto.paserk_secret(secret) == vector["paserk"]


def test_k4_secret_with_a_mismatched_public_half_is_refused() -> None:
    good = SECRET[1]["paserk"]
    raw = bytearray(paseto.b64url_decode(good.removeprefix("k4.secret.")))
    raw[-1] ^= 1
    with pytest.raises(ValueError, match="does not match"):
        paseto.load_paserk_secret("k4.secret." + paseto.b64url_encode(bytes(raw)))


@pytest.mark.parametrize(
    "text",
    [
        "k3.public.cHFyc3R1dnd4eXp7fH1-f4CBgoOEhYaHiImKi4yNjo8",
        "k4.secret.cHFyc3R1dnd4eXp7fH1-f4CBgoOEhYaHiImKi4yNjo8",
        "k4.public.cHFyc3R1dnd4eXp7fH1-f4CBgoOEhYaHiImKi4yNjo",
        "k4.public.cHFyc3R1dnd4eXp7fH1+f4CBgoOEhYaHiImKi4yNjo8",
        "k4.public.cHFyc3R1dnd4eXp7fH1-f4CBgoOEhYaHiImKi4yNjo8=",
    ],
)
def test_malformed_k4_public_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        paseto.load_paserk_public(text)


# --- PAE and base64url --------------------------------------------------------


def test_pae_matches_the_specification_examples() -> None:
    # From the PASETO specification, "Common", PAE.
    assert paseto.pae() == b"\x00" * 8
    assert paseto.pae(b"") == b"\x01" + b"\x00" * 7 + b"\x00" * 8
    assert paseto.pae(b"test") == b"\x01" + b"\x00" * 7 + b"\x04" + b"\x00" * 7 + b"test"


def test_pae_keeps_piece_boundaries() -> None:
    assert paseto.pae(b"ab", b"c") != paseto.pae(b"a", b"bc")


@pytest.mark.parametrize("size", range(0, 10))
def test_b64url_round_trips(size: int) -> None:
    data = bytes(range(250, 250 - size, -1))
    text = paseto.b64url_encode(data)
    assert "=" not in text
    assert paseto.b64url_decode(text) == data


@pytest.mark.parametrize(
    "text",
    [
        "A",  # a length no encoding has
        "AB",  # non-zero trailing bits: "AA" is the canonical spelling
        "AAB",  # idem for two bytes
        "AA==",  # padding
        "AA=",
        "+/AA",  # the standard alphabet
        "AA AA",
        "AA\nA",
        "AAé",
        "AA.A",
    ],
)
def test_b64url_refuses_non_canonical_input(text: str) -> None:
    with pytest.raises(ValueError):
        paseto.b64url_decode(text)


def test_python_alone_would_have_accepted_some_of_these() -> None:
    # Why the strict decoder exists.
    assert base64.urlsafe_b64decode("AB==") == base64.urlsafe_b64decode("AA==")


def test_parse_checks_size_header_and_segments_in_that_order() -> None:
    secret = Ed25519PrivateKey.from_private_bytes(bytes(32))
    token = paseto.sign(secret, b"{}", footer=b"f")
    with pytest.raises(TokenRefused) as refused:
        paseto.parse("x" * 5000)
    assert refused.value.reason is TokenRefusal.OVERSIZED
    for bad_header in (
        "v4.local." + token[10:],
        "V4.public." + token[10:],
        "v4-public." + token[10:],
        " " + token,
    ):
        with pytest.raises(TokenRefused) as refused:
            paseto.parse(bad_header)
        assert refused.value.reason is TokenRefusal.BAD_HEADER
    for bad_shape in (token + ".Zg", token + ".", "v4.public.AAAA", "v4.public."):
        with pytest.raises(TokenRefused) as refused:
            paseto.parse(bad_shape)
        assert refused.value.reason is TokenRefusal.BAD_ENCODING
    parsed = paseto.parse(token)
    assert (parsed.payload, parsed.footer, len(parsed.signature)) == (b"{}", b"f", 64)


def test_a_token_without_footer_has_no_footer_segment() -> None:
    secret = Ed25519PrivateKey.from_private_bytes(bytes(32))
    token = paseto.sign(secret, b"{}")
    assert token.count(".") == 2
    assert paseto.verify(token, secret.public_key()) == (b"{}", b"")


@pytest.mark.parametrize("pieces", [(b"", b"", b""), (b"{}", b"f", b"i"), (b"x" * 300, b"", b"ia")])
def test_the_precomputed_pae_of_the_signer_is_the_general_pae(
    pieces: tuple[bytes, bytes, bytes],
) -> None:
    assert paseto._signed_message(*pieces) == paseto.pae(b"v4.public.", *pieces)
