"""The node's token authority: mint capability tokens, revoke them, hand out validators.

One `TokenService` per node. It signs with the key ring's active key, binds
every token to the node id through the PASETO implicit assertion, and keeps
the bounded revocation state (`LiveTokens`): the one current token of each
invocation on each lane. Minting for a pair supersedes its earlier token;
ending an invocation forgets all of its tokens.

Lifetimes: `exp` is the earliest of now + `ttl` (at most one hour) and the
invocation's deadline plus `DEADLINE_MARGIN`, in whole seconds.

Refresh trades the current token for a fresh one with the same scope, but
only once the token has used half its life (`RefreshTooEarly` before that),
so a token holder cannot turn refreshes into work for the node, and a
refresh replaces state instead of adding any.

For verifiers outside the node, `key_set` publishes the verification keys
and `introspect` says whether a token is active now (RFC 7662).

Bounds: at most `max_live_tokens` (invocation, lane) pairs; when no room is
left, `mint` raises `RevocationFull` instead of handing out a token it could
not revoke.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Iterable

import msgspec

from capabilities import paseto
from capabilities.claims import (
    MAX_TTL_SECONDS,
    Claims,
    Footer,
    Isolation,
    LaneOp,
    decode_claims,
    encode,
    from_unix,
    implicit_assertion,
    to_unix,
)
from capabilities.errors import MintError, RefreshTooEarly, TokenRefusal, TokenRefused
from capabilities.keyring import KeyRing
from capabilities.publication import (
    INACTIVE,
    MAX_PUBLISHED_KEYS,
    Introspection,
    KeySet,
    KeyStatus,
    PublishedKey,
)
from capabilities.revocation import LiveTokens
from capabilities.validator import LaneValidator, not_as_issued

__all__ = ["DEADLINE_MARGIN", "DEFAULT_LEEWAY", "MAX_LEEWAY", "MintedToken", "TokenService"]

#: Clock skew tolerated on nbf/exp when validating.
DEFAULT_LEEWAY = 5.0
#: The most leeway a service accepts.
MAX_LEEWAY = 30.0
#: How long a token may outlive its invocation's deadline.
DEADLINE_MARGIN = 30.0


class MintedToken(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A freshly minted token and the claims it carries."""

    token: str
    claims: Claims


class TokenService:
    """Mints, tracks and revokes this node's capability tokens."""

    def __init__(
        self,
        node_id: str,
        keyring: KeyRing,
        *,
        ttl: float,
        clock: Callable[[], float] = time.time,
        max_live_tokens: int = 65536,
        leeway: float = DEFAULT_LEEWAY,
    ) -> None:
        if not math.isfinite(ttl) or ttl < 1:
            raise ValueError("token ttl must be at least one second")
        if not 0 <= leeway <= MAX_LEEWAY:
            raise ValueError(f"leeway must be between 0 and {MAX_LEEWAY} seconds")
        if not node_id:
            raise ValueError("node_id must not be empty")
        self._node_id = node_id
        self._keyring = keyring
        self._ttl = min(float(ttl), MAX_TTL_SECONDS)
        self._clock = clock
        self._leeway = float(leeway)
        self._implicit = implicit_assertion(node_id)
        self._live = LiveTokens(max_live_tokens, leeway=self._leeway, clock=clock)
        # kid -> the latest exp of a token it signed; one entry per key of the ring.
        self._signed_until: dict[str, float] = {}
        self._last_footer: tuple[str, bytes] = ("", b"")
        self._inspector = self.validator(cache_size=1024)

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def keyring(self) -> KeyRing:
        return self._keyring

    @property
    def ttl(self) -> float:
        """The lifetime given to tokens, after the one-hour cap."""
        return self._ttl

    @property
    def leeway(self) -> float:
        return self._leeway

    @property
    def live(self) -> LiveTokens:
        """The revocation state: every token that is current and not past exp + leeway."""
        return self._live

    @property
    def live_tokens(self) -> int:
        """Tokens minted, not superseded or revoked, and not yet past exp + leeway."""
        self._live.purge()
        return len(self._live)

    def full_reason(self) -> str | None:
        """Why no new invocation can get a token now, or None (a readiness check)."""
        if not self._live.full():
            return None
        return (
            f"token_table_full: {self._live.capacity} live tokens; "
            "new invocations get 503 token_unavailable until some end"
        )

    def implicit_assertion(self) -> bytes:
        """The implicit assertion every token of this node is signed with."""
        return self._implicit

    def mint(
        self,
        *,
        invocation_id: str,
        lane_id: str,
        ops: Iterable[LaneOp],
        vram_bytes: int,
        isolation: Isolation,
        deadline: float | None,
    ) -> MintedToken:
        """A token for one invocation on one lane; MintError or RevocationFull when refused.

        The new token supersedes the pair's earlier one, if any.
        """
        now = self._clock()
        try:
            granted = frozenset(LaneOp(op) for op in ops)
            isolation = Isolation(isolation)
        except ValueError as exc:
            raise MintError(str(exc)) from None
        if not granted:
            raise MintError("a token must grant at least one operation")
        iat = math.floor(now)
        end = iat + self._ttl
        if deadline is not None:
            if not math.isfinite(deadline):
                raise MintError("deadline must be a finite time")
            end = min(end, deadline + DEADLINE_MARGIN)
        if end < iat + 1:
            raise MintError("the invocation's deadline has already passed")
        issued = from_unix(iat)
        claims = Claims(
            iss=self._node_id,
            sub=invocation_id,
            aud=lane_id,
            iat=issued,
            nbf=issued,
            exp=from_unix(end),
            jti=secrets.token_hex(16),
            ops=granted,
            vram_bytes=vram_bytes,
            isolation=isolation,
        )
        payload = encode(claims)
        try:
            decode_claims(payload)  # Meta constraints are enforced on decode only
        except msgspec.ValidationError as exc:
            raise MintError(f"invalid claims: {exc}") from None
        self._live.make_room(invocation_id, lane_id)  # before paying for a signature
        kid, secret = self._keyring.signing_key()
        token = paseto.sign(secret, payload, footer=self._footer(kid), implicit=self._implicit)
        exp = float(math.floor(end))  # to_unix(claims.exp): from_unix keeps whole seconds
        self._live.admit(claims)
        self._note_signed(kid, exp)
        return MintedToken(token=token, claims=claims)

    def _footer(self, kid: str) -> bytes:
        """The encoded footer naming `kid` (the same bytes for every token it signs)."""
        cached_kid, footer = self._last_footer
        if cached_kid != kid:
            footer = encode(Footer(kid=kid))
            self._last_footer = (kid, footer)
        return footer

    def _note_signed(self, kid: str, exp: float) -> None:
        until = self._signed_until.get(kid)
        if until is None:
            # A new signing key: forget keys that left the ring, so this stays bounded.
            kids = set(self._keyring.kids())
            self._signed_until = {k: v for k, v in self._signed_until.items() if k in kids}
            until = exp
        self._signed_until[kid] = max(until, exp)

    def key_set(self) -> KeySet:
        """The keys a verifier outside the node needs: the signing key first, then the
        newest keys that may still verify a token, at most MAX_PUBLISHED_KEYS.

        A rotated-out key is left out once every token it signed here has expired
        past leeway. A retired key (and so every key from before a restart) has
        left the ring and is never listed.
        """
        now = self._clock()
        paserks = self._keyring.public_paserks()
        active = self._keyring.active_kid
        keys = [PublishedKey(kid=active, paserk=paserks[active], status=KeyStatus.ACTIVE)]
        for kid in reversed(list(paserks)):
            if len(keys) >= MAX_PUBLISHED_KEYS:
                break
            if kid == active:
                continue
            signed = self._signed_until.get(kid)
            until = None if signed is None else signed + self._leeway
            if until is not None and until <= now:
                continue
            keys.append(
                PublishedKey(
                    kid=kid,
                    paserk=paserks[kid],
                    status=KeyStatus.VERIFY_ONLY,
                    verifies_until=None if until is None else from_unix(math.ceil(until)),
                )
            )
        return KeySet(issuer=self._node_id, implicit_assertion=self._implicit.decode(), keys=keys)

    def introspect(self, token: str) -> Introspection:
        """RFC 7662: the claims of a token this node would accept now on its own lane,
        or inactive, never saying why (malformed, unknown key, bad signature,
        another node's, not yet valid, expired, superseded, ended)."""
        try:
            return Introspection.of(self._inspector.introspect(token))
        except TokenRefused:
            return INACTIVE

    def refresh(self, claims: Claims, *, deadline: float | None) -> MintedToken:
        """A fresh token with the scope of `claims`, which it supersedes.

        `claims` must be a validated token's, unexpired, still current and as
        issued (else TokenRefused `expired`, `revoked` or `not_as_issued`, in the
        validator's order).
        Before the token has used half its life this raises RefreshTooEarly,
        saying when to come back.
        """
        iat, exp = to_unix(claims.iat), to_unix(claims.exp)
        now = self._clock()
        if now >= exp + self._leeway:
            raise TokenRefused(TokenRefusal.EXPIRED, "after exp")
        issued = self._live.issued(claims.jti)
        if issued is None:
            raise TokenRefused(TokenRefusal.REVOKED, "not the current token")
        if issued != claims:  # the scope copied must be the one issued, never a re-signed one
            raise TokenRefused(TokenRefusal.NOT_AS_ISSUED, not_as_issued(issued, claims))
        halfway = iat + (exp - iat) / 2
        if now < halfway:
            raise RefreshTooEarly(max(1, math.ceil(halfway - now)))
        return self.mint(
            invocation_id=claims.sub,
            lane_id=claims.aud,
            ops=claims.ops,
            vram_bytes=claims.vram_bytes,
            isolation=claims.isolation,
            deadline=deadline,
        )

    def revoke(self, claims: Claims) -> bool:
        """Revoke one token; False when it was not current anyway."""
        return self._live.revoke(claims.jti)

    def revoke_invocation(self, invocation_id: str) -> int:
        """Revoke every token of an invocation (call it when the invocation ends).

        Returns how many were live. Leaves no state behind, so it never runs
        out of room.
        """
        return self._live.revoke_invocation(invocation_id)

    def validator(self, cache_size: int = 4096) -> LaneValidator:
        """A lane-owner validator sharing this service's keys, clock and live tokens."""
        return LaneValidator(
            node_id=self._node_id,
            keyring=self._keyring,
            live=self._live,
            clock=self._clock,
            leeway=self._leeway,
            cache_size=cache_size,
        )
