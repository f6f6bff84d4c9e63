"""Signed telemetry pushes: the node proves each snapshot it sends is its own.

Each push carries, in the `Litegraph-Signature` header, a PASETO v4.public
token signed with the node's signing key (the key ring's active key, listed
first at `GET /v1/keys`). Its claims (`PushClaims`) name the node (`iss`),
the scheduler URL it was sent to (`aud`), a window (`iat`, `exp`: 60 s), a
nonce (`jti`, 128 random bits) and the SHA-256 of the exact body bytes
(`body_sha256`, base64url). The footer holds the key id (`kid`, a k4.pid).
The implicit assertion is `{"node_id":"<id>","purpose":"telemetry"}`, which a
capability token never carries: a guest's token is never a valid push
signature, and a push signature is never a capability token.

`PushVerifier` is the scheduler's half: key lookup through the node's
published keys, signature, claims, issuer, audience, window, body digest,
and a nonce seen before (a replay). It refuses with a typed `PushRefusal`,
and remembers at most `max_nonces` nonces, each only until its token expires.

A scheduler may also hand each node a bearer credential (`read_bearer_file`,
`--telemetry-bearer-file`), sent as `Authorization: Bearer` beside the
signature: it admits a push before any key is fetched, and an impostor at a
node's address, whose keys would verify its own pushes, does not hold it.
"""

from __future__ import annotations

import base64
import datetime
import enum
import hashlib
import heapq
import hmac
import pathlib
import re
import secrets
import time
from collections.abc import Callable
from typing import Annotated

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from capabilities import paseto
from capabilities.claims import Footer, decode_footer, from_unix, to_unix
from capabilities.errors import CapabilityError, TokenRefused
from capabilities.keyring import KeyRing
from capabilities.publication import KeySet
from capabilities.securefile import read_secret_file

__all__ = [
    "MAX_PUSH_LIFETIME",
    "PUSH_LIFETIME",
    "SIGNATURE_HEADER",
    "PushClaims",
    "PushRefusal",
    "PushRefused",
    "PushSigner",
    "PushVerifier",
    "body_digest",
    "keys_of",
    "push_assertion",
    "read_bearer_file",
]

SIGNATURE_HEADER = "litegraph-signature"
#: How long a signed push is valid: long enough for one delivery, short for a replay.
PUSH_LIFETIME = 60
#: A verifier refuses a signature whose window is longer than this.
MAX_PUSH_LIFETIME = 300
DEFAULT_LEEWAY = 5.0
DEFAULT_MAX_NONCES = 65_536


class PushRefusal(enum.StrEnum):
    """Why a push was refused, in the order the checks run."""

    MISSING = "missing_signature"
    MALFORMED = "malformed_signature"
    UNKNOWN_KEY = "unknown_key"
    BAD_SIGNATURE = "bad_signature"
    BAD_CLAIMS = "bad_claims"
    WRONG_ISSUER = "wrong_issuer"
    WRONG_AUDIENCE = "wrong_audience"
    NOT_YET_VALID = "not_yet_valid"
    STALE = "stale"
    BODY_MISMATCH = "body_mismatch"
    REPLAYED = "replayed"
    NONCES_FULL = "nonces_full"


class PushRefused(CapabilityError):
    def __init__(self, reason: PushRefusal, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason


Instant = Annotated[datetime.datetime, msgspec.Meta(tz=True)]


class PushClaims(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a push signature says: this node (`iss`) sent this body (`body_sha256`,
    unpadded base64url of its SHA-256) to this scheduler URL (`aud`), once (`jti`),
    within `iat`..`exp` (RFC 3339, whole seconds)."""

    iss: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    aud: Annotated[str, msgspec.Meta(min_length=1, max_length=2048)]
    iat: Instant
    exp: Instant
    jti: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
    body_sha256: Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_-]{43}$")]


class _Purpose(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    purpose: str


_encoder = msgspec.json.Encoder(order="deterministic")
_claims_decoder = msgspec.json.Decoder(PushClaims)


def push_assertion(node_id: str) -> bytes:
    """Every push signature's implicit assertion: `{"node_id":"<id>","purpose":"telemetry"}`."""
    return _encoder.encode(_Purpose(node_id=node_id, purpose="telemetry"))


def body_digest(body: bytes) -> str:
    """Unpadded base64url of the body's SHA-256."""
    return base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=").decode("ascii")


#: RFC 6750 b64token: what may follow "Bearer " in an Authorization header.
_BEARER = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_MAX_BEARER = 4096


def read_bearer_file(path: pathlib.Path) -> str:
    """The bearer credential in `path` (a 0600 file of ours, surrounding whitespace
    ignored). SecretFileError for an unsafe file, ValueError for unusable content."""
    raw = read_secret_file(path, max_bytes=_MAX_BEARER)
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: the bearer credential is not ASCII") from None
    if _BEARER.fullmatch(text) is None:
        raise ValueError(f"{path}: not a bearer credential (RFC 6750 characters, one line)")
    return text


def keys_of(key_set: KeySet) -> dict[str, Ed25519PublicKey]:
    """kid -> public key of a published key set; a key whose PASERK does not load is left out."""
    keys: dict[str, Ed25519PublicKey] = {}
    for key in key_set.keys:
        try:
            public = paseto.load_paserk_public(key.paserk)
        except ValueError:
            continue
        if paseto.paserk_pid(public) == key.kid:  # a kid must name its own key
            keys[key.kid] = public
    return keys


class PushSigner:
    """Signs the node's pushes with the key ring's current signing key."""

    def __init__(
        self,
        keyring: KeyRing,
        node_id: str,
        audience: str,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._keyring = keyring
        self._node_id = node_id
        self._audience = audience
        self._clock = clock
        self._implicit = push_assertion(node_id)

    def sign(self, body: bytes) -> str:
        """A fresh signature (new nonce, new window) for `body`."""
        iat = int(self._clock() // 1)
        claims = PushClaims(
            iss=self._node_id,
            aud=self._audience,
            iat=from_unix(iat),
            exp=from_unix(iat + PUSH_LIFETIME),
            jti=secrets.token_hex(16),
            body_sha256=body_digest(body),
        )
        kid, secret = self._keyring.signing_key()
        return paseto.sign(
            secret,
            _encoder.encode(claims),
            footer=_encoder.encode(Footer(kid=kid)),
            implicit=self._implicit,
        )


class PushVerifier:
    """The scheduler's check of one node's pushes.

    `keys(kid)` returns the node's published key for `kid`, or None; a
    scheduler fetches `GET /v1/keys` from the node's known address again when
    it meets a kid it does not hold (every restart makes a new key).
    """

    def __init__(
        self,
        node_id: str,
        audience: str,
        keys: Callable[[str], Ed25519PublicKey | None],
        *,
        clock: Callable[[], float] = time.time,
        leeway: float = DEFAULT_LEEWAY,
        max_nonces: int = DEFAULT_MAX_NONCES,
    ) -> None:
        self._node_id = node_id
        self._audience = audience
        self._keys = keys
        self._clock = clock
        self._leeway = leeway
        self._implicit = push_assertion(node_id)
        self._max_nonces = max_nonces
        self._seen: dict[str, float] = {}
        self._expiry: list[tuple[float, str]] = []  # (forget at, jti), a min-heap

    @property
    def remembered(self) -> int:
        return len(self._seen)

    def verify(self, signature: str | None, body: bytes) -> PushClaims:
        """The claims of a push this node signed for this body, now, for the first time."""
        self._forget_expired()
        if not signature:
            raise PushRefused(PushRefusal.MISSING, f"no {SIGNATURE_HEADER} header")
        try:
            parsed = paseto.parse(signature)
            footer: Footer = decode_footer(parsed.footer)
        except TokenRefused as exc:
            raise PushRefused(PushRefusal.MALFORMED, str(exc)) from None
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise PushRefused(PushRefusal.MALFORMED, f"footer: {exc}") from None
        public = self._keys(footer.kid)
        if public is None:
            raise PushRefused(PushRefusal.UNKNOWN_KEY, footer.kid)
        try:
            paseto.verify_parsed(parsed, public, implicit=self._implicit)
        except TokenRefused:
            raise PushRefused(PushRefusal.BAD_SIGNATURE, "signature does not verify") from None
        try:
            claims = _claims_decoder.decode(parsed.payload)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise PushRefused(PushRefusal.BAD_CLAIMS, str(exc)) from None
        self._check_claims(claims, body)
        self._remember(claims)
        return claims

    def _check_claims(self, claims: PushClaims, body: bytes) -> None:
        if claims.iss != self._node_id:
            raise PushRefused(PushRefusal.WRONG_ISSUER, claims.iss)
        if claims.aud != self._audience:
            raise PushRefused(PushRefusal.WRONG_AUDIENCE, claims.aud)
        now = self._clock()
        iat, exp = to_unix(claims.iat), to_unix(claims.exp)
        if not iat < exp <= iat + MAX_PUSH_LIFETIME:
            raise PushRefused(PushRefusal.BAD_CLAIMS, "window is empty or too long")
        if iat > now + self._leeway:
            raise PushRefused(PushRefusal.NOT_YET_VALID, f"signed {iat - now:.0f}s in the future")
        if exp + self._leeway < now:
            raise PushRefused(PushRefusal.STALE, f"expired {now - exp:.0f}s ago")
        if not hmac.compare_digest(claims.body_sha256, body_digest(body)):
            raise PushRefused(PushRefusal.BODY_MISMATCH, "the body is not the one signed")

    def _forget_expired(self) -> None:
        """A nonce is kept until its push would be refused as stale anyway."""
        now = self._clock()
        while self._expiry and self._expiry[0][0] < now:
            _, jti = heapq.heappop(self._expiry)
            self._seen.pop(jti, None)

    def _remember(self, claims: PushClaims) -> None:
        if claims.jti in self._seen:
            raise PushRefused(PushRefusal.REPLAYED, claims.jti)
        if len(self._seen) >= self._max_nonces:
            # Fail closed: forgetting a live nonce early would let its push be replayed.
            raise PushRefused(PushRefusal.NONCES_FULL, f"{self._max_nonces} live nonces")
        forget_at = to_unix(claims.exp) + self._leeway
        self._seen[claims.jti] = forget_at
        heapq.heappush(self._expiry, (forget_at, claims.jti))
