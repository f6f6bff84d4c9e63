"""Token refresh through the supervisor: it grows no state however often it is
done, comes at most once per half of a token's life, and ending the invocation
refuses every token it was ever given and frees its room."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from capabilities import KeyRing, LaneOp, RefreshTooEarly, TokenRefusal, TokenRefused, TokenService
from tests.supervisor_fixtures import NODE, Rig, builtin, open_rig

TTL = 60


class Clock:
    """The token service's wall clock, moved by hand."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def clocked_tokens(tmp_path: Path, room: int) -> tuple[Clock, TokenService]:
    clock = Clock()
    keys = KeyRing.open(tmp_path / "keys")
    return clock, TokenService(NODE, keys, ttl=TTL, clock=clock, max_live_tokens=room)


async def submit_one(rig: Rig, invocation_id: str) -> tuple[str, str]:
    """Submit CPU work that runs until cancelled; its one (lane, token)."""
    accepted = await rig.sup.submit(builtin(invocation_id, seconds=1000))
    ((lane, token),) = accepted.tokens.items()
    return lane, token


def refused_as(rig: Rig, lane_id: str, token: str) -> TokenRefusal | None:
    try:
        rig.sup.validator.validate(token, lane_id=lane_id, op=LaneOp.EXECUTE)
    except TokenRefused as refused:
        return refused.reason
    return None


async def test_many_refreshes_grow_nothing_and_the_ended_invocation_frees_its_room(
    tmp_path: Path,
) -> None:
    clock, tokens = clocked_tokens(tmp_path, room=2)
    async with open_rig(tmp_path, tokens=tokens) as rig:
        lane, token = await submit_one(rig, "refresher")
        given = [token]
        for _ in range(50):
            clock.now += TTL / 2
            token = rig.sup.refresh_token(lane, token).token
            given.append(token)
            assert (tokens.live_tokens, len(tokens.live), tokens.live.invocations()) == (1, 1, 1)
        # Only the newest token is authority; the one it replaced is revoked
        # though still within its life, and older ones are refused too.
        assert refused_as(rig, lane, token) is None
        assert refused_as(rig, lane, given[-2]) is TokenRefusal.REVOKED
        assert None not in {refused_as(rig, lane, old) for old in given[:-1]}

        await rig.sup.cancel("refresher")
        assert refused_as(rig, lane, token) is TokenRefusal.REVOKED
        assert (tokens.live_tokens, len(tokens.live), tokens.live.invocations()) == (0, 0, 0)
        # The refreshes left nothing behind: new work gets all the room there is.
        for name in ("next-1", "next-2"):
            await submit_one(rig, name)
        assert tokens.full_reason() is not None


async def test_a_refresh_before_half_the_token_life_is_refused_with_when_to_retry(
    tmp_path: Path,
) -> None:
    clock, tokens = clocked_tokens(tmp_path, room=8)
    async with open_rig(tmp_path, tokens=tokens) as rig:
        lane, token = await submit_one(rig, "early")
        iat = rig.sup.validator.validate(token, lane_id=lane, op=LaneOp.EXECUTE).iat.timestamp()
        clock.now = iat
        with pytest.raises(RefreshTooEarly) as early:
            rig.sup.refresh_token(lane, token)
        assert early.value.retry_after == TTL // 2
        clock.now = iat + TTL / 2 - 0.5
        with pytest.raises(RefreshTooEarly) as almost:
            rig.sup.refresh_token(lane, token)
        assert almost.value.retry_after == 1
        # Refused refreshes changed nothing: the token still works and is still current.
        assert refused_as(rig, lane, token) is None and tokens.live_tokens == 1
        clock.now = iat + TTL / 2
        fresh = rig.sup.refresh_token(lane, token)
        assert refused_as(rig, lane, fresh.token) is None
        assert refused_as(rig, lane, token) is TokenRefusal.REVOKED
