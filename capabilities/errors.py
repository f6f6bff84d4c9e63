"""Every way the capability layer says no, in one place.

Exception tree::

    CapabilityError                 base of everything raised here
    ├── TokenRefused                a presented token is not authority; `.reason`
    │                               is a TokenRefusal (remote fault: the bearer's)
    ├── KeyFileError                a key file or the key folder is unsafe or
    │                               unreadable; `.problem` is a KeyFileProblem
    │                               (local fault: the operator's); the daemon
    │                               must refuse to start on it
    ├── KeyRingError                a key ring operation that cannot be done
    │                               (retire the signing key, unknown kid)
    ├── MintError                   a mint request that cannot be honoured
    │                               (bad ids, deadline already past)
    ├── RefreshTooEarly             a refresh before the token used half its
    │                               life; `.retry_after` says when (seconds)
    └── RevocationFull              no room to track one more live token (a
                                    token that could not be revoked is never
                                    handed out)

`TokenRefusal` values are wire-visible (snake_case) and listed in the order
the validator checks them: a token that is wrong in several ways is refused
for the first one in this order.
"""

from __future__ import annotations

import enum
import pathlib

__all__ = [
    "CapabilityError",
    "KeyFileError",
    "KeyFileProblem",
    "KeyRingError",
    "MintError",
    "RefreshTooEarly",
    "RevocationFull",
    "TokenRefusal",
    "TokenRefused",
]


class TokenRefusal(enum.StrEnum):
    """Why a token was refused, in the order the checks run."""

    OVERSIZED = "oversized"
    BAD_HEADER = "bad_header"
    BAD_ENCODING = "bad_encoding"
    UNKNOWN_KEY = "unknown_key"
    BAD_SIGNATURE = "bad_signature"
    BAD_CLAIMS = "bad_claims"
    # A key given twice in the claims: decoders disagree on which one counts.
    DUPLICATE_CLAIM = "duplicate_claim"
    WRONG_ISSUER = "wrong_issuer"
    NOT_YET_VALID = "not_yet_valid"
    EXPIRED = "expired"
    WRONG_AUDIENCE = "wrong_audience"
    REVOKED = "revoked"
    # Signed with our key under a live jti, but not the claims issued under it.
    NOT_AS_ISSUED = "not_as_issued"
    OP_NOT_GRANTED = "op_not_granted"
    VRAM_OVER_BUDGET = "vram_over_budget"
    # On the guests' Unix socket: presented by a uid other than the guest's it was minted for.
    WRONG_HOLDER = "wrong_holder"


class KeyFileProblem(enum.StrEnum):
    """What is wrong with a key file or the key folder."""

    LOOSE_MODE = "loose_mode"
    SYMLINK = "symlink"
    NOT_REGULAR = "not_regular"
    WRONG_OWNER = "wrong_owner"
    MALFORMED = "malformed"
    UNREADABLE = "unreadable"


class CapabilityError(Exception):
    """Base class of every error raised by the capabilities package."""


class TokenRefused(CapabilityError):
    """A token was refused; `reason` says why (never more than that to the bearer)."""

    def __init__(self, reason: TokenRefusal, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)


class KeyFileError(CapabilityError):
    """A key file or folder cannot be trusted or read; the daemon must not start."""

    def __init__(self, path: pathlib.Path, problem: KeyFileProblem, message: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {message} ({problem.value})")


class KeyRingError(CapabilityError):
    """A key ring operation that cannot be carried out."""


class MintError(CapabilityError):
    """A token cannot be minted for the request as given."""


class RefreshTooEarly(CapabilityError):
    """A token is refreshed only once it has used half its life; retry after `retry_after` s."""

    def __init__(self, retry_after: int) -> None:
        self.retry_after = retry_after
        super().__init__(f"the token has more than half its life left; refresh in {retry_after} s")


class RevocationFull(CapabilityError):
    """The table of live (revocable) tokens is at its bound."""

    def __init__(self, capacity: int, message: str = "") -> None:
        self.capacity = capacity
        super().__init__(message or f"no room to track a new token ({capacity} live tokens)")
