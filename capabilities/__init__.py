"""Capability tokens: what guest code gets instead of a device handle.

A token names one lane, one invocation, what may be done there and until
when: PASETO v4.public (Ed25519), key id in the footer as PASERK k4.pid, the
node bound through the implicit assertion. `TokenService` mints and revokes;
`LaneValidator` is what a lane owner calls before any lane work; `KeySet` and
`Introspection` are what the node publishes to verifiers outside it.
"""

from capabilities.claims import MAX_TTL_SECONDS, Claims, Footer, Isolation, LaneOp
from capabilities.errors import (
    CapabilityError,
    KeyFileError,
    KeyFileProblem,
    KeyRingError,
    MintError,
    RefreshTooEarly,
    RevocationFull,
    TokenRefusal,
    TokenRefused,
)
from capabilities.keyring import KeyRing
from capabilities.paseto import MAX_TOKEN_CHARS
from capabilities.publication import Introspection, KeySet, KeyStatus, PublishedKey
from capabilities.revocation import LiveTokens
from capabilities.service import (
    DEADLINE_MARGIN,
    DEFAULT_LEEWAY,
    MAX_LEEWAY,
    MintedToken,
    TokenService,
)
from capabilities.validator import LaneValidator

__all__ = [
    "DEADLINE_MARGIN",
    "DEFAULT_LEEWAY",
    "MAX_LEEWAY",
    "MAX_TOKEN_CHARS",
    "MAX_TTL_SECONDS",
    "CapabilityError",
    "Claims",
    "Footer",
    "Introspection",
    "Isolation",
    "KeyFileError",
    "KeyFileProblem",
    "KeyRing",
    "KeyRingError",
    "KeySet",
    "KeyStatus",
    "LaneOp",
    "LaneValidator",
    "LiveTokens",
    "MintError",
    "MintedToken",
    "PublishedKey",
    "RefreshTooEarly",
    "RevocationFull",
    "TokenRefusal",
    "TokenRefused",
    "TokenService",
]
