"""What a capability token says: the claims, the footer, and the node binding.

Wire types are msgspec Structs (frozen, keyword-only, unknown fields
forbidden). Times are RFC 3339 strings with an offset, as PASETO registers
`iat`, `nbf` and `exp`; ours are whole seconds in UTC.

`LaneOp` and `Isolation` are the scope vocabulary; the supervisor reuses them.
"""

from __future__ import annotations

import datetime
import enum
import json
from typing import Annotated, Any

import msgspec

__all__ = [
    "MAX_TTL_SECONDS",
    "Claims",
    "Footer",
    "Isolation",
    "LaneOp",
    "decode_claims",
    "decode_footer",
    "duplicate_key",
    "encode",
    "from_unix",
    "implicit_assertion",
    "to_unix",
]

#: No token lives longer than this, whatever `--token-ttl` says.
MAX_TTL_SECONDS = 3600.0

_MAX_ID = 256


class LaneOp(enum.StrEnum):
    """The operations a token can grant on its lane."""

    MEMORY_RESERVE = "memory_reserve"
    MEMORY_RELEASE = "memory_release"
    EXECUTE = "execute"
    MEMORY_WRITE = "memory_write"  # upload bytes into a buffer the invocation holds
    MEMORY_READ = "memory_read"  # download bytes from one


class Isolation(enum.StrEnum):
    """Isolation classes, weakest to strongest."""

    SHARED = "shared"
    SANDBOX = "sandbox"
    PARTITIONED = "partitioned"
    DEDICATED = "dedicated"


Identifier = Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_ID)]
# 128 random bits as 32 hex digits; only the length is checked on decode (a
# pattern costs more than half of a claims decode, and only our key signs).
Jti = Annotated[str, msgspec.Meta(min_length=32, max_length=32)]
Instant = Annotated[datetime.datetime, msgspec.Meta(tz=True)]
ByteCount = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class Claims(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The payload of a capability token: one lane, one invocation, a scope, a window.

    `iss` node id, `sub` invocation id, `aud` lane id (exactly one: a token
    for several lanes could be replayed to each of them), `iat`/`nbf`/`exp`
    the validity window, `jti` 128 random bits (32 hex digits), and the scope: `ops`
    granted on the lane, `vram_bytes` the most device memory lane work may
    hold, `isolation` the class the work was admitted under.
    """

    iss: Identifier
    sub: Identifier
    aud: Identifier
    iat: Instant
    nbf: Instant
    exp: Instant
    jti: Jti
    ops: frozenset[LaneOp]
    vram_bytes: ByteCount
    isolation: Isolation

    def __post_init__(self) -> None:
        if not self.iat <= self.nbf < self.exp:
            raise ValueError("claims need iat <= nbf < exp")
        if (self.exp - self.iat).total_seconds() > MAX_TTL_SECONDS:
            raise ValueError("claims outlive the maximum token lifetime")


class Footer(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The token footer: signed but untrusted until verified; only a key id."""

    kid: Annotated[str, msgspec.Meta(pattern="^k4\\.pid\\.[A-Za-z0-9_-]{44}$")]


class _NodeBinding(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str


class _Twice(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _once_each(pairs: list[tuple[str, Any]]) -> None:
    if len(dict(pairs)) != len(pairs):
        keys = [key for key, _ in pairs]
        raise _Twice(next(key for i, key in enumerate(keys) if key in keys[:i]))


# Built once: json.loads with a hook builds a decoder per call (half the cost).
_pairs_decoder = json.JSONDecoder(object_pairs_hook=_once_each)


def duplicate_key(document: bytes) -> str | None:
    """The first key given twice in one object of a JSON document, or None.

    msgspec keeps the last of duplicate keys and other decoders the first, so a
    signed document with one is read differently by each. ValueError when the
    standard parser cannot read the document (never for one msgspec decoded).
    """
    try:
        _pairs_decoder.decode(document.decode())
    except _Twice as twice:
        return twice.key
    return None


_encoder = msgspec.json.Encoder(order="deterministic")
_claims_decoder = msgspec.json.Decoder(Claims)
_footer_decoder = msgspec.json.Decoder(Footer)


def encode(value: Claims | Footer) -> bytes:
    """Canonical JSON of a claims or footer Struct (sets sorted)."""
    return _encoder.encode(value)


def decode_claims(payload: bytes) -> Claims:
    """Strictly decode claims; raises msgspec.ValidationError / DecodeError."""
    return _claims_decoder.decode(payload)


def decode_footer(footer: bytes) -> Footer:
    """Strictly decode a footer, `kid` given once; raises msgspec.ValidationError /
    DecodeError."""
    decoded = _footer_decoder.decode(footer)
    if duplicate_key(footer) is not None:
        raise msgspec.ValidationError("the footer gives a key twice")
    return decoded


def implicit_assertion(node_id: str) -> bytes:
    """The implicit assertion binding a token to its node: `{"node_id":"<id>"}`.

    Signed but never sent; a verifier in any language rebuilds these bytes
    from the node id it expects.
    """
    return _encoder.encode(_NodeBinding(node_id=node_id))


def from_unix(seconds: float) -> datetime.datetime:
    """A UTC instant at whole-second precision (truncated toward the past)."""
    return datetime.datetime.fromtimestamp(int(seconds // 1), tz=datetime.UTC)


def to_unix(instant: datetime.datetime) -> float:
    """Unix seconds of an aware instant."""
    return instant.timestamp()
