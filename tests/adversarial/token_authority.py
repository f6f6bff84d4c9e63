"""One node's token service on an injected clock, and what a refused token must not change.

Shared by the hostile-token tests that need no HTTP (`test_tokens_unit.py`,
`test_tokens_entry.py`).
"""

from __future__ import annotations

import pathlib

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from capabilities import (
    Isolation,
    KeyRing,
    LaneOp,
    LaneValidator,
    MintedToken,
    TokenRefusal,
    TokenRefused,
    TokenService,
)

__all__ = ["ALL_OPS", "AUTHENTICATION", "LANE", "NODE", "OTHER_LANE", "T0", "Authority", "Clock"]

NODE = "node-a"
LANE = "lane_0123456789abcdef"
OTHER_LANE = "lane_fedcba9876543210"
T0 = 1_800_000_000.0
ALL_OPS = (LaneOp.MEMORY_RESERVE, LaneOp.MEMORY_RELEASE, LaneOp.EXECUTE)

# Refused before anything is cached: a token refused so never enters the cache.
AUTHENTICATION = frozenset(
    {
        TokenRefusal.OVERSIZED,
        TokenRefusal.BAD_HEADER,
        TokenRefusal.BAD_ENCODING,
        TokenRefusal.UNKNOWN_KEY,
        TokenRefusal.BAD_SIGNATURE,
        TokenRefusal.BAD_CLAIMS,
        TokenRefusal.DUPLICATE_CLAIM,
        TokenRefusal.WRONG_ISSUER,
    }
)


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Authority:
    """One node's token service with an injected clock, and what a refusal must not change."""

    def __init__(self, tmp_path: pathlib.Path, node_id: str = NODE) -> None:
        self.clock = Clock()
        self.keyring = KeyRing.open(tmp_path / node_id)
        self.service = TokenService(node_id, self.keyring, ttl=600, clock=self.clock)
        self.validator = self.service.validator()

    def mint(
        self,
        invocation_id: str = "inv-1",
        lane_id: str = LANE,
        ops: tuple[LaneOp, ...] = ALL_OPS,
        vram: int = 2**30,
    ) -> MintedToken:
        return self.service.mint(
            invocation_id=invocation_id,
            lane_id=lane_id,
            ops=ops,
            vram_bytes=vram,
            isolation=Isolation.SHARED,
            deadline=None,
        )

    def secret(self) -> Ed25519PrivateKey:
        return self.keyring.signing_key()[1]

    def counters(self) -> tuple[int, int]:
        return self.service.live_tokens, self.service.live.invocations()

    def refuse(
        self,
        token: str,
        reason: TokenRefusal,
        *,
        lane_id: str = LANE,
        op: LaneOp = LaneOp.EXECUTE,
        vram_bytes: int = 0,
        validator: LaneValidator | None = None,
    ) -> None:
        checker = self.validator if validator is None else validator
        before, cached = self.counters(), len(checker)
        with pytest.raises(TokenRefused) as refused:
            checker.validate(token, lane_id=lane_id, op=op, vram_bytes=vram_bytes)
        assert refused.value.reason is reason, refused.value
        assert self.counters() == before
        if reason in AUTHENTICATION:
            assert len(checker) <= cached, "a token that failed authentication was cached"
