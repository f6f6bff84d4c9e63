"""The node's token authority: mint capability tokens, revoke them, hand out validators.

One `TokenService` per node. It signs with the key ring's active key, binds
every token to the node id through the PASETO implicit assertion, and keeps
the bounded revocation state: which live tokens each invocation holds, and
the deny list they move to when the invocation ends.

Lifetimes: `exp` is the earliest of now + `ttl` (at most one hour) and the
invocation's deadline plus `DEADLINE_MARGIN`, in whole seconds.

Bounds: every live token holds a reserved slot on the deny list, so ending an
invocation can always revoke all its tokens; when no slot is free, `mint`
raises `RevocationFull` instead of handing out a token it could not revoke.
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
from capabilities.errors import MintError, RevocationFull
from capabilities.keyring import KeyRing
from capabilities.revocation import DenyList, InvocationTracker
from capabilities.validator import LaneValidator

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
        deny_list_size: int = 65536,
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
        self._deny = DenyList(deny_list_size, leeway=self._leeway, clock=clock)
        self._tracker = InvocationTracker(deny_list_size, leeway=self._leeway, clock=clock)

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
    def deny_list(self) -> DenyList:
        return self._deny

    @property
    def live_tokens(self) -> int:
        """Tokens minted, not revoked and not yet past exp + leeway."""
        self._tracker.purge()
        return len(self._tracker)

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
        """A token for one invocation on one lane; MintError or RevocationFull when refused."""
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
        claims = Claims(
            iss=self._node_id,
            sub=invocation_id,
            aud=lane_id,
            iat=from_unix(iat),
            nbf=from_unix(iat),
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
        self._reserve_slot()
        kid, secret = self._keyring.signing_key()
        token = paseto.sign(
            secret, payload, footer=encode(Footer(kid=kid)), implicit=self._implicit
        )
        self._tracker.add(invocation_id, claims.jti, to_unix(claims.exp))
        return MintedToken(token=token, claims=claims)

    def _reserve_slot(self) -> None:
        if len(self._tracker) + len(self._deny) >= self._deny.capacity:
            self._tracker.purge()
            self._deny.purge()
            if len(self._tracker) + len(self._deny) >= self._deny.capacity:
                raise RevocationFull(
                    self._deny.capacity,
                    "no revocation slot left for a new token "
                    f"({self._deny.capacity} live or revoked tokens)",
                )

    def revoke(self, claims: Claims) -> None:
        """Revoke one token; RevocationFull if it was not ours and there is no room."""
        self._tracker.discard(claims.sub, claims.jti)
        self._deny.revoke(claims.jti, to_unix(claims.exp))

    def revoke_invocation(self, invocation_id: str) -> int:
        """Revoke every live token of an invocation (call it when the invocation ends).

        Returns how many tokens were newly denied. Never runs out of room:
        every live token reserved its deny-list slot when it was minted.
        """
        return self._deny.revoke_many(self._tracker.pop_invocation(invocation_id))

    def validator(self, cache_size: int = 4096) -> LaneValidator:
        """A lane-owner validator sharing this service's keys, clock and deny list."""
        return LaneValidator(
            node_id=self._node_id,
            keyring=self._keyring,
            deny_list=self._deny,
            clock=self._clock,
            leeway=self._leeway,
            cache_size=cache_size,
        )
