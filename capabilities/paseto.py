"""PASETO v4.public and PASERK k4 on `cryptography`'s Ed25519: bytes in, bytes out.

This module knows the standard and nothing about our claims:

- `pae` is the pre-authentication encoding (PASETO "Common", PAE);
- `sign` / `verify` build and check `v4.public.` tokens exactly per the v4
  specification: the signature is Ed25519 over
  PAE("v4.public.", payload, footer, implicit assertion);
- `parse` splits a token and decodes it strictly (size cap, exact header,
  base64url without padding and canonical), without looking at the payload;
- `paserk_*` / `load_paserk_*` write and read PASERK `k4.public`,
  `k4.secret` and `k4.pid`.

Every failure of a presented token raises `TokenRefused` with the reason of
the first check that failed; PASERK parse failures raise `ValueError`.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import struct
from typing import NamedTuple

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from capabilities.errors import TokenRefusal, TokenRefused

__all__ = [
    "HEADER",
    "MAX_TOKEN_CHARS",
    "ParsedToken",
    "b64url_decode",
    "b64url_encode",
    "decode_body",
    "decode_footer",
    "load_paserk_public",
    "load_paserk_secret",
    "pae",
    "parse",
    "paserk_pid",
    "paserk_public",
    "paserk_secret",
    "public_key_bytes",
    "sign",
    "split",
    "verify",
    "verify_parsed",
    "verify_signature",
]

HEADER = "v4.public."
_HEADER_BYTES = HEADER.encode("ascii")
_HEADER_LEN = len(HEADER)
#: Tokens longer than this are refused before anything else is looked at.
MAX_TOKEN_CHARS = 4096
_SIGNATURE_SIZE = 64
_KEY_SIZE = 32

_PASERK_PUBLIC = "k4.public."
_PASERK_SECRET = "k4.secret."  # noqa: S105 -- a PASERK type prefix, not a secret
_PASERK_PID = "k4.pid."
_PID_DIGEST_SIZE = 33

# "-_" become "+/"; "+/=" become "*", which the strict decoder refuses.
_URL_TO_STANDARD = bytes.maketrans(b"-_+/=", b"+/***")
# Padding by len % 4: 1 is never valid (three "=" make the strict decoder refuse it).
_PADDING = (b"", b"===", b"==", b"=")
_le64 = struct.Struct("<Q").pack


# --- base64url, strict ------------------------------------------------------


def b64url_encode(data: bytes) -> str:
    """Base64url without padding (RFC 4648 section 5), as PASETO requires."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


@functools.lru_cache(maxsize=16)
def _footer_segment(footer: bytes) -> str:
    """A footer's segment: the same few footers (one per signing key) sign every token."""
    return "." + b64url_encode(footer) if footer else ""


def b64url_decode(text: str) -> bytes:
    """Decode base64url without padding, refusing anything non-canonical.

    Python's lenient decoder skips characters outside the alphabet and
    ignores non-zero trailing bits. Here: ASCII only; `+`, `/` and `=` are
    mapped to an invalid byte so the strict standard-alphabet decoder refuses
    them; then the result is re-encoded and compared with the input, which
    refuses non-zero trailing bits (two spellings of the same bytes).

    Only the final partial quantum can differ: full 4-character groups map
    one-to-one onto 3 bytes, and groups never straddle, so re-encoding the
    last `len(raw) % 3` bytes on their own and comparing them with the last
    characters is the same test as re-encoding everything, at a fraction of
    the cost.
    """
    try:
        data = text.encode("ascii")
    except UnicodeEncodeError:
        raise ValueError("not base64url: non-ASCII character") from None
    tail = len(data) % 4
    standard = data.translate(_URL_TO_STANDARD) + _PADDING[tail]
    try:
        raw = binascii.a2b_base64(standard, strict_mode=True)
    except binascii.Error:
        raise ValueError("not base64url without padding") from None
    if tail:  # 2 or 3 characters encode the last 1 or 2 bytes
        again = binascii.b2a_base64(raw[-(tail - 1) :], newline=False)
        if not hmac.compare_digest(again, standard[-4:]):
            raise ValueError("non-canonical base64url")
    return raw


# --- PAE, sign, verify ------------------------------------------------------


def pae(*pieces: bytes) -> bytes:
    """Pre-authentication encoding: LE64(count) then LE64(len) || piece for each.

    LE64 clears the most significant bit, as the standard specifies.
    """
    out = [_le64(len(pieces) & 0x7FFF_FFFF_FFFF_FFFF)]
    for piece in pieces:
        out.append(_le64(len(piece) & 0x7FFF_FFFF_FFFF_FFFF))
        out.append(piece)
    return b"".join(out)


_PAE_HEAD = _le64(4) + _le64(len(_HEADER_BYTES)) + _HEADER_BYTES


def _signed_message(payload: bytes, footer: bytes, implicit: bytes) -> bytes:
    """PAE("v4.public.", payload, footer, implicit), the header part precomputed."""
    return b"".join(
        (
            _PAE_HEAD,
            _le64(len(payload)),
            payload,
            _le64(len(footer)),
            footer,
            _le64(len(implicit)),
            implicit,
        )
    )


def sign(
    secret: Ed25519PrivateKey, payload: bytes, *, footer: bytes = b"", implicit: bytes = b""
) -> str:
    """A `v4.public.` token for `payload`, with an optional footer and implicit assertion."""
    signature = secret.sign(_signed_message(payload, footer, implicit))
    return HEADER + b64url_encode(payload + signature) + _footer_segment(footer)


class ParsedToken(NamedTuple):
    """A token split and decoded, not yet verified: nothing in it is trusted."""

    payload: bytes
    signature: bytes
    footer: bytes


def split(token: str, *, max_chars: int = MAX_TOKEN_CHARS) -> tuple[str, str]:
    """(body segment, footer segment or "") after the size, header and shape checks.

    Raises TokenRefused: oversized, bad_header, bad_encoding (a third
    segment, or a footer dot with nothing after it).
    """
    if len(token) > max_chars:
        raise TokenRefused(TokenRefusal.OVERSIZED, f"longer than {max_chars} characters")
    if not token.startswith(HEADER):
        raise TokenRefused(TokenRefusal.BAD_HEADER, "not a v4.public token")
    body, dot, footer = token[_HEADER_LEN:].partition(".")
    if dot and not footer:
        raise TokenRefused(TokenRefusal.BAD_ENCODING, "empty footer segment")
    if "." in footer:
        raise TokenRefused(TokenRefusal.BAD_ENCODING, "too many segments")
    return body, footer


def decode_body(body: str) -> tuple[bytes, bytes]:
    """(payload, signature) of a body segment; TokenRefused(bad_encoding) if malformed."""
    try:
        raw = b64url_decode(body)
    except ValueError as exc:
        raise TokenRefused(TokenRefusal.BAD_ENCODING, str(exc)) from None
    if len(raw) < _SIGNATURE_SIZE:
        raise TokenRefused(TokenRefusal.BAD_ENCODING, "shorter than a signature")
    return raw[:-_SIGNATURE_SIZE], raw[-_SIGNATURE_SIZE:]


def decode_footer(footer: str) -> bytes:
    """The bytes of a footer segment ("" for none); TokenRefused(bad_encoding) if malformed."""
    if not footer:
        return b""
    try:
        return b64url_decode(footer)
    except ValueError as exc:
        raise TokenRefused(TokenRefusal.BAD_ENCODING, f"footer: {exc}") from None


def parse(token: str, *, max_chars: int = MAX_TOKEN_CHARS) -> ParsedToken:
    """Split a `v4.public.` token and decode its parts strictly.

    Checks, in order: size cap (oversized), exact header (bad_header), strict
    base64url and structure (bad_encoding). The payload is not interpreted.
    """
    body, footer = split(token, max_chars=max_chars)
    payload, signature = decode_body(body)
    return ParsedToken(payload, signature, decode_footer(footer))


def verify_signature(
    public: Ed25519PublicKey, payload: bytes, signature: bytes, footer: bytes, implicit: bytes
) -> None:
    """Check a v4.public signature; raises TokenRefused(bad_signature)."""
    try:
        public.verify(signature, _signed_message(payload, footer, implicit))
    except InvalidSignature:
        raise TokenRefused(TokenRefusal.BAD_SIGNATURE, "signature does not verify") from None


def verify_parsed(parsed: ParsedToken, public: Ed25519PublicKey, *, implicit: bytes = b"") -> None:
    """Check the signature of a parsed token; raises TokenRefused(bad_signature)."""
    verify_signature(public, parsed.payload, parsed.signature, parsed.footer, implicit)


def verify(
    token: str, public: Ed25519PublicKey, *, implicit: bytes = b"", max_chars: int = MAX_TOKEN_CHARS
) -> tuple[bytes, bytes]:
    """Verify a `v4.public.` token; returns (payload, footer) as raw bytes."""
    parsed = parse(token, max_chars=max_chars)
    verify_parsed(parsed, public, implicit=implicit)
    return parsed.payload, parsed.footer


# --- PASERK k4 --------------------------------------------------------------


def public_key_bytes(public: Ed25519PublicKey) -> bytes:
    """The 32 raw bytes of an Ed25519 public key."""
    return public.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _raw_public(public: Ed25519PublicKey | bytes) -> bytes:
    raw = public if isinstance(public, bytes) else public_key_bytes(public)
    if len(raw) != _KEY_SIZE:
        raise ValueError(f"an Ed25519 public key is {_KEY_SIZE} bytes, not {len(raw)}")
    return raw


def paserk_public(public: Ed25519PublicKey | bytes) -> str:
    """PASERK `k4.public.` of a public key."""
    return _PASERK_PUBLIC + b64url_encode(_raw_public(public))


def paserk_pid(public: Ed25519PublicKey | bytes) -> str:
    """PASERK `k4.pid.`: the key id of a public key (BLAKE2b-264 over its k4.public)."""
    digest = hashlib.blake2b(
        (_PASERK_PID + paserk_public(public)).encode("ascii"), digest_size=_PID_DIGEST_SIZE
    ).digest()
    return _PASERK_PID + b64url_encode(digest)


def paserk_secret(secret: Ed25519PrivateKey) -> str:
    """PASERK `k4.secret.`: the 32-byte seed followed by the 32-byte public key."""
    seed = secret.private_bytes_raw()
    return _PASERK_SECRET + b64url_encode(seed + public_key_bytes(secret.public_key()))


def _paserk_body(text: str, prefix: str, size: int) -> bytes:
    if not text.startswith(prefix):
        raise ValueError(f"not a {prefix.rstrip('.')} PASERK")
    raw = b64url_decode(text[len(prefix) :])
    if len(raw) != size:
        raise ValueError(f"{prefix.rstrip('.')} must hold {size} bytes, not {len(raw)}")
    return raw


def load_paserk_public(text: str) -> Ed25519PublicKey:
    """Read a PASERK `k4.public.`; ValueError for anything else."""
    return Ed25519PublicKey.from_public_bytes(_paserk_body(text, _PASERK_PUBLIC, _KEY_SIZE))


def load_paserk_secret(text: str) -> Ed25519PrivateKey:
    """Read a PASERK `k4.secret.`; its public half must match its seed."""
    raw = _paserk_body(text, _PASERK_SECRET, 2 * _KEY_SIZE)
    secret = Ed25519PrivateKey.from_private_bytes(raw[:_KEY_SIZE])
    if not hmac.compare_digest(public_key_bytes(secret.public_key()), raw[_KEY_SIZE:]):
        raise ValueError("k4.secret public half does not match its seed")
    return secret
