"""What the node tells verifiers outside it: its public keys, and whether a token is active.

A lane host that runs outside the daemon verifies tokens itself with the
published keys (`KeySet`: PASERK `k4.public` with its `k4.pid`, plus the
implicit assertion every token is signed with). A signature proves only that
this node signed the token and when it expires; whether the token is still
current (not superseded by a refresh, its invocation not ended) only the node
knows, so it answers that too (`Introspection`, in the shape of RFC 7662:
inactive carries nothing else, whatever the reason).
"""

from __future__ import annotations

import datetime
import enum

import msgspec

from capabilities.claims import Claims, Isolation, to_unix

__all__ = [
    "INACTIVE",
    "MAX_PUBLISHED_KEYS",
    "Introspection",
    "KeySet",
    "KeyStatus",
    "PublishedKey",
]

#: The most keys one key set lists (the signing key first, then the newest others).
MAX_PUBLISHED_KEYS = 16


class KeyStatus(enum.StrEnum):
    """What a published key is used for."""

    ACTIVE = "active"  # signs new tokens, and verifies them
    VERIFY_ONLY = "verify_only"  # rotated out: signs nothing new, verifies what it signed


class PublishedKey(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One verification key: `paserk` a PASERK k4.public, `kid` its k4.pid (the
    token footer's `kid`). `verifies_until`: no token this key signed is valid
    after it (exp + leeway); null when not known (the signing key, which keeps
    signing, or a key this process never signed with)."""

    kid: str
    paserk: str
    status: KeyStatus
    verifies_until: datetime.datetime | None = None


class KeySet(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The node's verification keys, the signing key first, at most 16.

    `issuer` is every token's `iss`. `implicit_assertion` is the exact
    (UTF-8) implicit assertion of PASETO v4 every token is signed with: it
    binds the token to this node and is never sent with the token.
    """

    issuer: str
    implicit_assertion: str
    keys: list[PublishedKey]


class Introspection(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    """RFC 7662 token introspection: `{"active": false}` for any token this node
    would refuse now (malformed, unknown key, bad signature, expired, revoked),
    without saying why; for an active one its claims. Times are Unix seconds;
    `scope` the granted lane operations, space separated."""

    active: bool
    iss: str | None = None
    sub: str | None = None
    aud: str | None = None
    exp: int | None = None
    iat: int | None = None
    nbf: int | None = None
    jti: str | None = None
    scope: str | None = None
    vram_bytes: int | None = None
    isolation: Isolation | None = None

    @classmethod
    def of(cls, claims: Claims) -> Introspection:
        """The answer for an active token with these claims."""
        return cls(
            active=True,
            iss=claims.iss,
            sub=claims.sub,
            aud=claims.aud,
            exp=int(to_unix(claims.exp)),
            iat=int(to_unix(claims.iat)),
            nbf=int(to_unix(claims.nbf)),
            jti=claims.jti,
            scope=" ".join(sorted(claims.ops)),
            vram_bytes=claims.vram_bytes,
            isolation=claims.isolation,
        )


INACTIVE = Introspection(active=False)
