"""The lane owner's side: is this token authority for this work on this lane?

`LaneValidator.validate` returns the authorised `Claims` or raises
`TokenRefused` with the reason of the first failed check, in this order:

1. oversized, bad_header, bad_encoding   (size cap, then strict format)
2. unknown_key                           (footer `kid` not in the key ring)
3. bad_signature                         (Ed25519 over the raw bytes)
4. bad_claims, duplicate_claim           (claims decoded only now, strictly;
                                          no key twice)
5. wrong_issuer                          (`iss` is not this node)
6. not_yet_valid, expired                (injected clock, bounded leeway)
7. wrong_audience                        (`aud` is not this lane)
8. revoked, not_as_issued                (`jti` not the current token of
                                          its invocation on this lane; its
                                          claims not exactly those issued
                                          under that jti: sub, aud, scope,
                                          window)
9. op_not_granted, vram_over_budget      (scope)

Step 8 is what makes a token signed with our key, but never issued, no
authority: the live entry of a jti holds the claims it was issued with.

`introspect` runs steps 1-6 and 8 (a token valid now on its own lane,
whatever its scope); the node answers RFC 7662 introspection with it.

Steps 1-5 depend only on the token bytes and the key ring, so their outcome
is cached (bounded LRU): a token seen again skips the signature, never
steps 6-9. Retiring a key empties the cache.

The cache is a dict keyed by the token string. A lookup compares two tokens
byte by byte only after their full 64-bit string hashes matched, and that
hash is a keyed SipHash: a probe cannot be aimed at a cached token it does
not already know, so the lookup leaks nothing about cached tokens (the same
argument as for a dict keyed by an HMAC of the token, at a third of the cost).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import NamedTuple

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from capabilities import paseto
from capabilities.claims import (
    Claims,
    LaneOp,
    decode_claims,
    decode_footer,
    duplicate_key,
    implicit_assertion,
)
from capabilities.errors import TokenRefusal, TokenRefused
from capabilities.keyring import KeyRing
from capabilities.revocation import LiveTokens

__all__ = ["LaneValidator", "not_as_issued"]

# Footers seen with a known kid, remembered so a key lookup costs one dict hit;
# one entry per key in practice, the bound only guards against surprises.
_MAX_FOOTERS = 64


def not_as_issued(issued: Claims, presented: Claims) -> str:
    """Which claims differ from those issued under the same jti (for the log only)."""
    fields = [f for f in Claims.__struct_fields__ if getattr(issued, f) != getattr(presented, f)]
    return f"{', '.join(fields)} differ from what was issued under this jti"


class _Verified(NamedTuple):
    claims: Claims
    nbf: float
    exp: float


class LaneValidator:
    """Checks tokens for lane work; build it with `TokenService.validator()`."""

    def __init__(
        self,
        *,
        node_id: str,
        keyring: KeyRing,
        live: LiveTokens,
        clock: Callable[[], float],
        leeway: float,
        cache_size: int = 4096,
        max_token_chars: int = paseto.MAX_TOKEN_CHARS,
    ) -> None:
        if cache_size < 0:
            raise ValueError("cache_size must not be negative")
        self._node_id = node_id
        self._implicit = implicit_assertion(node_id)
        self._keyring = keyring
        self._current = live.view()
        self._clock = clock
        self._leeway = leeway
        self._cache_size = cache_size
        self._max_chars = max_token_chars
        self._cache: collections.OrderedDict[str, _Verified] = collections.OrderedDict()
        self._footers: dict[str, tuple[bytes, Ed25519PublicKey]] = {}
        self._generation = keyring.generation
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        """How many verified tokens the cache holds."""
        return len(self._cache)

    def clear(self) -> None:
        """Forget every cached verification."""
        self._cache.clear()

    def validate(self, token: str, *, lane_id: str, op: LaneOp, vram_bytes: int = 0) -> Claims:
        """The claims that authorise `op` on `lane_id`, or TokenRefused.

        `vram_bytes` is the device memory the lane work would hold once the
        operation is done; it must not exceed the token's `vram_bytes`.
        """
        if vram_bytes < 0:
            raise ValueError("vram_bytes must not be negative")
        return self._authorise(self._verified(token), token, lane_id, op, vram_bytes)

    def introspect(self, token: str) -> Claims:
        """The claims of a token that is valid now on its own lane, scope aside, or
        TokenRefused: steps 1-6 and 8 (no audience, no scope), cached like `validate`."""
        entry = self._verified(token)
        self._in_window(entry, token)
        self._as_issued(entry.claims)
        return entry.claims

    def _verified(self, token: str) -> _Verified:
        """Steps 1-5, from the cache when this exact token passed them before."""
        if len(token) > self._max_chars:
            raise TokenRefused(TokenRefusal.OVERSIZED, f"longer than {self._max_chars} characters")
        if self._generation != self._keyring.generation:
            self._forget_keys()
        cache = self._cache
        entry = cache.get(token)
        if entry is not None:
            cache.move_to_end(token)
            self.hits += 1
        else:
            self.misses += 1
            entry = self._authenticate(token)
            if self._cache_size:
                cache[token] = entry
                if len(cache) > self._cache_size:
                    cache.popitem(last=False)
        return entry

    def authenticate(self, token: str) -> Claims:
        """Steps 1-5 only (format, key, signature, claims, issuer): no cache, no scope."""
        if len(token) > self._max_chars:
            raise TokenRefused(TokenRefusal.OVERSIZED, f"longer than {self._max_chars} characters")
        if self._generation != self._keyring.generation:
            self._forget_keys()
        return self._authenticate(token).claims

    def _forget_keys(self) -> None:
        # A key was retired: nothing it signed may stay cached, nor its footer.
        self._cache.clear()
        self._footers.clear()
        self._generation = self._keyring.generation

    def _authenticate(self, token: str) -> _Verified:
        body, footer_text = paseto.split(token, max_chars=self._max_chars)
        payload, signature = paseto.decode_body(body)
        known = self._footers.get(footer_text)
        if known is None:
            known = self._find_key(footer_text)
        footer, public = known
        paseto.verify_signature(public, payload, signature, footer, self._implicit)
        try:
            claims = decode_claims(payload)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise TokenRefused(TokenRefusal.BAD_CLAIMS, str(exc)) from None
        try:
            twice = duplicate_key(payload)
        except ValueError as exc:
            raise TokenRefused(TokenRefusal.BAD_CLAIMS, str(exc)) from None
        if twice is not None:
            raise TokenRefused(TokenRefusal.DUPLICATE_CLAIM, f"{twice!r} given twice")
        if claims.iss != self._node_id:
            raise TokenRefused(TokenRefusal.WRONG_ISSUER, "issued for another node")
        return _Verified(claims, claims.nbf.timestamp(), claims.exp.timestamp())

    def _find_key(self, footer_text: str) -> tuple[bytes, Ed25519PublicKey]:
        """The footer's bytes and the key its kid names; remembered per footer text."""
        footer = paseto.decode_footer(footer_text)
        if not footer:
            raise TokenRefused(TokenRefusal.UNKNOWN_KEY, "no key id in the footer")
        try:
            kid = decode_footer(footer).kid
        except (msgspec.ValidationError, msgspec.DecodeError):
            raise TokenRefused(TokenRefusal.BAD_ENCODING, "footer is not {kid: k4.pid}") from None
        public = self._keyring.public_key(kid)
        if public is None:
            raise TokenRefused(TokenRefusal.UNKNOWN_KEY, "key id not in this node's key ring")
        if len(self._footers) >= _MAX_FOOTERS:
            self._footers.clear()
        self._footers[footer_text] = (footer, public)
        return footer, public

    def _in_window(self, entry: _Verified, token: str) -> None:
        now = self._clock()
        if now < entry.nbf - self._leeway:
            raise TokenRefused(TokenRefusal.NOT_YET_VALID, "before nbf")
        if now >= entry.exp + self._leeway:
            self._cache.pop(token, None)
            raise TokenRefused(TokenRefusal.EXPIRED, "after exp")

    def _as_issued(self, claims: Claims) -> None:
        """Step 8: the current token of its pair, and with exactly the claims issued."""
        live = self._current.get(claims.jti)
        if live is None:
            raise TokenRefused(TokenRefusal.REVOKED, "token was revoked")
        if live.claims != claims:
            raise TokenRefused(TokenRefusal.NOT_AS_ISSUED, not_as_issued(live.claims, claims))

    def _authorise(
        self, entry: _Verified, token: str, lane_id: str, op: LaneOp, vram_bytes: int
    ) -> Claims:
        self._in_window(entry, token)
        claims = entry.claims
        if claims.aud != lane_id:
            raise TokenRefused(TokenRefusal.WRONG_AUDIENCE, "token is for another lane")
        self._as_issued(claims)
        if op not in claims.ops:
            raise TokenRefused(TokenRefusal.OP_NOT_GRANTED, f"{op} not granted")
        if vram_bytes > claims.vram_bytes:
            raise TokenRefused(
                TokenRefusal.VRAM_OVER_BUDGET,
                f"{vram_bytes} bytes asked, {claims.vram_bytes} granted",
            )
        return claims
