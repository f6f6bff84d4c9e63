"""Whose token it is: a guest's token works only for its guest's uid, whichever way it
came (the edge passes the uid the kernel named, or None where it could not)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from capabilities import LaneOp, TokenRefusal, TokenRefused
from tests.supervisor_fixtures import GiB, Rig, gpu_builtin, only_lane, open_rig

GUEST_UID = 200007


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


async def _guests_token(rig: Rig) -> tuple[str, str]:
    lane, token = only_lane(await rig.sup.submit(gpu_builtin("guest", vram_bytes=GiB)))
    rig.sup._live["guest"].uid = GUEST_UID  # as its guest's start sets it
    return lane, token


async def test_a_guests_token_works_for_its_guests_uid(rig: Rig) -> None:
    lane, token = await _guests_token(rig)
    rig.sup.check_holder(lane, token, LaneOp.MEMORY_RESERVE, GUEST_UID)


@pytest.mark.parametrize(
    ("peer_uid", "said"),
    [
        (GUEST_UID + 1, "by uid 200008"),  # another tenant's guest
        (0, "by uid 0"),  # root is no exception
        (os.geteuid(), f"by uid {os.geteuid()}"),  # nor the daemon's own user
        (None, "whose uid is not known"),  # another host, a failed lookup: closed
    ],
)
async def test_a_guests_token_is_refused_from_any_other_or_an_unknown_uid(
    rig: Rig, peer_uid: int | None, said: str
) -> None:
    lane, token = await _guests_token(rig)
    with pytest.raises(TokenRefused) as refused:
        rig.sup.check_holder(lane, token, LaneOp.MEMORY_RESERVE, peer_uid)
    assert refused.value.reason is TokenRefusal.WRONG_HOLDER
    assert said in refused.value.detail


async def test_a_builtins_token_is_a_bearer_token(rig: Rig) -> None:
    lane, token = only_lane(await rig.sup.submit(gpu_builtin("builtin", vram_bytes=GiB)))
    for peer_uid in (None, 0, GUEST_UID):
        rig.sup.check_holder(lane, token, LaneOp.MEMORY_RESERVE, peer_uid)
