"""Standing holds (a Kubernetes claim's lanes) in the supervisor: held in the ledger as
standing reservations with a token per lane, refused with a reason and nothing held,
bound to their own socket, refreshed whatever their token file does, released whole,
and back with fresh tokens after a restart."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio

from capabilities import KeyRing, LaneOp, RefreshTooEarly, TokenRefusal, TokenRefused, TokenService
from machine.lanes import lane_id_for
from supervisor.hold import Hold, HoldGrant, hold_subject
from supervisor.standing_holds import HoldRefused
from tests.fakes.clock import FakeClock
from tests.supervisor_fixtures import NODE, Rig, gpu_builtin, only_lane, open_rig

GPU = lane_id_for("GPU-5e1d0a3c-0000-4000-8000-5157a0000001")
MIG = lane_id_for("MIG-5e1d0a3c-0000-4000-8000-5157a0020001")
CLAIM, OTHER = "c0ffee00-0000-4000-8000-000000000001", "c0ffee00-0000-4000-8000-000000000002"


def standing(rig: Rig) -> dict[str, object]:
    return {k: r for k, r in rig.machine.ledger.reservations().items() if r.standing}


async def test_a_hold_reserves_its_lanes_once_and_its_release_frees_them(tmp_path: Path) -> None:
    async with open_rig(tmp_path) as rig:
        holds = rig.sup.holds
        grants = [HoldGrant(lane_id=GPU), HoldGrant(lane_id=MIG)]
        hold, new = await holds.hold(CLAIM, grants)
        assert new and hold.lane_ids == (GPU, MIG)
        assert sorted(standing(rig)) == [f"claim:{CLAIM}/0", f"claim:{CLAIM}/1"]
        assert rig.machine.ledger.is_exclusive(GPU) and rig.machine.ledger.is_exclusive(MIG)
        for lane, token in hold.tokens.items():
            claims = rig.sup.validator.validate(token, lane_id=lane, op=LaneOp.EXECUTE)
            assert claims.sub == hold_subject(CLAIM)
        again, new = await holds.hold(CLAIM, grants)  # a repeated Prepare
        assert again is hold and not new
        with pytest.raises(HoldRefused) as changed:
            await holds.hold(CLAIM, grants[:1])
        assert changed.value.reason == "hold_changed"
        old = dict(hold.tokens)
        assert await holds.release(CLAIM) is True
        assert standing(rig) == {} and holds.holds == {}
        assert rig.machine.ledger.capacity() == rig.baseline
        with pytest.raises(TokenRefused) as revoked:
            rig.sup.validator.validate(old[GPU], lane_id=GPU, op=LaneOp.EXECUTE)
        assert revoked.value.reason is TokenRefusal.REVOKED
        assert await holds.release(CLAIM) is False  # kubelet repeats Unprepare


async def test_a_lane_someone_holds_is_refused_and_nothing_of_the_claim_is_held(
    tmp_path: Path,
) -> None:
    async with open_rig(tmp_path) as rig:
        holds = rig.sup.holds
        await holds.hold(CLAIM, [HoldGrant(lane_id=MIG)])
        with pytest.raises(HoldRefused) as held:
            # Its first lane is free, its second is the other claim's.
            await holds.hold(OTHER, [HoldGrant(lane_id=GPU), HoldGrant(lane_id=MIG)])
        assert held.value.reason == "lane_held"
        assert sorted(standing(rig)) == [f"claim:{CLAIM}/0"]
        assert not rig.machine.ledger.is_exclusive(GPU)
        # An invocation's GPU is no claim's either.
        await rig.sup.submit(gpu_builtin("busy", seconds=30))
        with pytest.raises(HoldRefused) as busy:
            await holds.hold(OTHER, [HoldGrant(lane_id=GPU)])
        assert busy.value.reason == "lane_held"
        with pytest.raises(HoldRefused) as mig:
            await holds.hold(OTHER, [HoldGrant(lane_id=lane_id_for("no-such-gpu"))])
        assert mig.value.reason == "unknown_lane"


async def test_a_holds_tokens_work_on_its_own_socket_alone(tmp_path: Path) -> None:
    async with open_rig(tmp_path) as rig:
        hold, _ = await rig.sup.holds.hold(CLAIM, [HoldGrant(lane_id=MIG)])
        token, own = hold.tokens[MIG], hold_subject(CLAIM)
        rig.sup.check_holder(MIG, token, LaneOp.EXECUTE, 0, own)
        for bound in (None, hold_subject(OTHER)):  # the node's own sockets, another claim's
            with pytest.raises(TokenRefused) as refused:
                rig.sup.check_holder(MIG, token, LaneOp.EXECUTE, 0, bound)
            assert refused.value.reason is TokenRefusal.WRONG_HOLDER
        # An invocation's token is refused on a claim's socket.
        lane, guest_token = only_lane(await rig.sup.submit(gpu_builtin("guest", seconds=30)))
        with pytest.raises(TokenRefused):
            rig.sup.check_holder(lane, guest_token, LaneOp.EXECUTE, 0, own)


async def test_tokens_are_refreshed_even_where_their_file_cannot_be_written(
    tmp_path: Path,
) -> None:
    async with open_rig(tmp_path) as rig:
        holds = rig.sup.holds
        hold, _ = await holds.hold(CLAIM, [HoldGrant(lane_id=MIG)])
        written: list[str] = []

        def pods_folder_broken(found: Hold) -> None:
            written.append(found.tokens[MIG])
            raise IsADirectoryError("a pod made a folder of its token file")

        holds.on_tokens = pods_folder_broken
        first = hold.tokens[MIG]
        hold.minted_at = 0.0  # minted long ago: past half its life
        async with trio.open_nursery() as nursery:
            nursery.start_soon(holds.keep_fresh)
            with trio.fail_after(10):
                while not written:  # noqa: ASYNC110 - its first round, at once
                    await trio.sleep(0.01)
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()  # it ran on past the failed write
        assert written == [hold.tokens[MIG]] and written[0] != first
        holds.tokens_changed(hold)  # a holder's refresh: the same write, the same shrug


async def test_a_restart_keeps_the_hold_with_fresh_tokens(tmp_path: Path) -> None:
    async with open_rig(tmp_path) as rig:
        hold, _ = await rig.sup.holds.hold(CLAIM, [HoldGrant(lane_id=GPU)])
        before = hold.tokens[GPU]
    async with open_rig(tmp_path) as rig:
        again = rig.sup.holds.get(CLAIM)
        assert again is not None and again.lane_ids == (GPU,)
        assert again.tokens[GPU] != before
        rig.sup.validator.validate(again.tokens[GPU], lane_id=GPU, op=LaneOp.EXECUTE)
        assert rig.machine.ledger.is_exclusive(GPU)
        # A node started without its DRA driver says what it keeps (a readiness note).
        assert (
            rig.sup.holds.unserved()
            == f"claims held with nothing to serve or release them: {CLAIM}"
        )
        assert await rig.sup.holds.release(CLAIM)
        assert rig.sup.holds.unserved() is None


async def test_holds_are_bounded_and_a_claim_past_the_bound_holds_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("supervisor.standing_holds.MAX_HOLDS", 1)
    async with open_rig(tmp_path) as rig:
        holds = rig.sup.holds
        await holds.hold(CLAIM, [HoldGrant(lane_id=MIG)])
        with pytest.raises(HoldRefused) as full:
            await holds.hold(OTHER, [HoldGrant(lane_id=GPU)])
        assert full.value.reason == "too_many_claims"
        assert not rig.machine.ledger.is_exclusive(GPU)
        assert (await holds.hold(CLAIM, [HoldGrant(lane_id=MIG)]))[1] is False  # a repeat


async def test_a_holds_holder_trades_its_token_as_a_guest_does_and_its_file_follows(
    tmp_path: Path,
) -> None:
    clock = FakeClock(time.time())
    tokens = TokenService(NODE, KeyRing.open(tmp_path / "state"), ttl=600, clock=clock)
    async with open_rig(tmp_path, tokens=tokens) as rig:
        hold, _ = await rig.sup.holds.hold(CLAIM, [HoldGrant(lane_id=MIG)])
        written: list[str] = []
        rig.sup.holds.on_tokens = lambda found: written.append(found.tokens[MIG])
        first = hold.tokens[MIG]
        with pytest.raises(RefreshTooEarly):  # at most once per half of its life
            rig.sup.refresh_token(MIG, first)
        clock.now += 301
        fresh = rig.sup.refresh_token(MIG, first)
        assert hold.tokens[MIG] == fresh.token == written[-1] != first
        assert fresh.claims.sub == hold_subject(CLAIM) and fresh.claims.aud == MIG
        with pytest.raises(TokenRefused):  # traded in: the old one is no authority
            rig.sup.validator.validate(first, lane_id=MIG, op=LaneOp.EXECUTE)
        with pytest.raises(TokenRefused):  # nor can it be traded again
            rig.sup.refresh_token(MIG, first)


async def test_a_release_the_journal_refuses_keeps_the_hold_working_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_rig(tmp_path) as rig:
        holds = rig.sup.holds
        hold, _ = await holds.hold(CLAIM, [HoldGrant(lane_id=GPU), HoldGrant(lane_id=MIG)])
        commit = rig.machine.group_commit.commit

        async def refused(*_records: object, **_kw: object) -> None:
            raise OSError(5, "injected")

        monkeypatch.setattr(rig.machine.group_commit, "commit", refused)
        with pytest.raises(HoldRefused) as journal:
            await holds.release(CLAIM)
        assert journal.value.reason == "journal_unavailable"
        # Still held whole, and its pods go on: fresh tokens for both lanes.
        assert holds.get(CLAIM) is hold and len(hold.reservations) == 2
        assert sorted(standing(rig)) == [f"claim:{CLAIM}/0", f"claim:{CLAIM}/1"]
        for lane in (GPU, MIG):
            rig.sup.validator.validate(hold.tokens[lane], lane_id=lane, op=LaneOp.EXECUTE)
        monkeypatch.setattr(rig.machine.group_commit, "commit", commit)
        assert await holds.release(CLAIM) and standing(rig) == {}
