"""Standing holds: lanes held for a holder outside the node (a Kubernetes claim's pods)
rather than for one of its invocations, with lane work through their own tokens.

A hold is standing reservations in the ledger and the journal (one per lane,
`machine.reservation.Reservation.standing`): the node's own invocations never get
what a hold has, a restart keeps it, and only `release` ends it. Its subject,
`claim:<uid>`, is its tokens' `sub` and its reservations' prefix (`claim:<uid>/<n>`);
no invocation id has a colon, so neither ever names the other.

Its tokens, one per lane, have no deadline but live `--token-ttl` (900 s by default,
an hour at most):
the node mints fresh ones at half life, and at every start for the holds the journal
kept (no token outlives the daemon that minted it), and hands each set to
`on_tokens` (the claim's token file). A hold's tokens work only from its own
socket (`supervisor.lane_routing`: the request's socket must be the hold's).

Lane work of a hold runs in lane sessions as an invocation's does; its hosts are
charged to the node's own cgroup (the pods' resources are their own cgroups', the
lane's buffers are bounded by the lane owner).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import trio

from capabilities import Isolation as TokenIsolation
from capabilities.errors import CapabilityError
from machine.journal_errors import JournalError
from machine.lanes import Isolation, LaneKind, Requirement
from machine.reservation import Reservation, ReservationRefused, ReservationRequest
from supervisor.hold import HOLD_PREFIX, Hold, HoldGrant, hold_subject, subject_of
from supervisor.lane_session import CLOSE_SECONDS
from supervisor.state import SupervisorState
from supervisor.submission import GPU_OPS

__all__ = ["MAX_HOLDS", "HoldRefused", "StandingHolds"]

log = logging.getLogger(__name__)

# Claims held at once: as many as the node serves sockets for (api.hold_sockets).
MAX_HOLDS = 1024


class HoldRefused(Exception):
    """Why a hold was not made or ended; `reason` is a short code, and nothing changed."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class StandingHolds:
    def __init__(self, state: SupervisorState) -> None:
        self._state = state
        self.on_tokens: Callable[[Hold], None] = lambda _hold: None
        self._lock = trio.Lock()  # one hold or release at a time: each is a few commits

    @property
    def holds(self) -> dict[str, Hold]:
        return self._state.holds

    def get(self, claim_uid: str) -> Hold | None:
        return self.holds.get(hold_subject(claim_uid))

    def unserved(self) -> str | None:
        """Where nothing serves the holds (a node started without its DRA driver):
        what they keep, for the operator to see; None when there are none."""
        if not self.holds:
            return None
        held = ", ".join(sorted(h.claim_uid for h in self.holds.values()))
        return f"claims held with nothing to serve or release them: {held}"[:500]

    def restore(self) -> None:
        """The holds the journal kept (reconcile left standing reservations held),
        each with fresh tokens."""
        found: dict[str, list[Reservation]] = {}
        for reservation in self._state.machine.ledger.reservations().values():
            if reservation.standing and reservation.reservation_id.startswith(HOLD_PREFIX):
                found.setdefault(subject_of(reservation.reservation_id), []).append(reservation)
        for subject, reservations in found.items():
            reservations.sort(key=lambda r: int(r.reservation_id.rpartition("/")[2]))
            hold = Hold(claim_uid=subject[len(HOLD_PREFIX) :], reservations=tuple(reservations))
            try:
                self._mint(hold)
            except CapabilityError as exc:  # kept held; its next refresh tries again
                log.error("claim %s: no tokens after the restart: %s", hold.claim_uid, exc)
            self.holds[subject] = hold

    async def hold(self, claim_uid: str, grants: Sequence[HoldGrant]) -> tuple[Hold, bool]:
        """The claim's hold, and whether this call made it (False: held already, as
        asked: a repeated Prepare). HoldRefused, with nothing held, otherwise."""
        if not grants or len({g.lane_id for g in grants}) != len(grants):
            raise HoldRefused("invalid_request", "one grant per lane, at least one")
        async with self._lock:
            held = self.get(claim_uid)
            if held is None and len(self.holds) >= MAX_HOLDS:
                raise HoldRefused("too_many_claims", f"{MAX_HOLDS} claims are held already")
            if held is not None:
                if held.grants() != tuple(grants):
                    raise HoldRefused("hold_changed", "the claim is held with other lanes")
                if not held.tokens:  # its last minting failed: try again now
                    self._mint_or_refuse(held)
                return held, False
            hold = Hold(claim_uid=claim_uid, reservations=())
            try:
                for index, grant in enumerate(grants):
                    reservation = await self._reserve(hold, index, grant)
                    hold.reservations = (*hold.reservations, reservation)
                self._mint_or_refuse(hold)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await self._undo(hold)
                raise
            self.holds[hold.subject] = hold
            self._state.on_change()
            return hold, True

    async def release(self, claim_uid: str) -> bool:
        """End the claim's hold: its tokens revoked first, its lane sessions ended, then
        its reservations released and journaled. False when it held nothing (repeats
        are fine). HoldRefused when the journal could not record it: still held."""
        async with self._lock:
            hold = self.get(claim_uid)
            if hold is None:
                return False
            self._state.tokens.revoke_invocation(hold.subject)
            hold.tokens.clear()
            with trio.CancelScope(shield=True):
                await self._end_sessions(hold)
                try:
                    for reservation in reversed(hold.reservations):
                        await self._state.machine.release(reservation.reservation_id)
                        hold.reservations = hold.reservations[:-1]
                except (OSError, JournalError, trio.TooSlowError) as exc:
                    with contextlib.suppress(CapabilityError):  # its next refresh retries
                        self._mint(hold)  # still held: it keeps working until released
                    raise HoldRefused("journal_unavailable", str(exc)) from None
            del self.holds[hold.subject]
            self._state.on_change()
            return True

    def tokens_changed(self, hold: Hold) -> None:
        """One of its tokens was traded for a fresh one (a refresh by its holder)."""
        self._announce(hold)

    def _announce(self, hold: Hold) -> None:
        # Where its holder reads them (a folder its pods can write in): a failure there
        # is the holder's to see, never the node's to fall over.
        try:
            self.on_tokens(hold)
        except OSError as exc:
            log.error("claim %s: its tokens not written: %s", hold.claim_uid, exc)

    async def keep_fresh(self) -> None:
        """Mint each hold's tokens again at half their life, for as long as it runs."""
        while True:
            half = self._state.tokens.ttl / 2
            now = time.time()
            for hold in list(self.holds.values()):
                if now - hold.minted_at >= half:
                    try:
                        self._mint(hold)
                    except CapabilityError as exc:
                        log.error("claim %s: tokens not refreshed: %s", hold.claim_uid, exc)
            await trio.sleep(max(1.0, half / 4))

    # -- the steps ------------------------------------------------------------------
    async def _reserve(self, hold: Hold, index: int, grant: HoldGrant) -> Reservation:
        ledger = self._state.machine.ledger
        lane = ledger.lane(grant.lane_id)
        if lane is None or not lane.is_gpu:
            raise HoldRefused("unknown_lane", f"no device lane {grant.lane_id}")
        if ledger.is_exclusive(grant.lane_id) or (grant.whole and ledger.holders(grant.lane_id)):
            raise HoldRefused("lane_held", f"{grant.lane_id} is held by other work")
        if grant.whole:
            isolation = Isolation.PARTITIONED if lane.kind is LaneKind.MIG else Isolation.DEDICATED
        else:
            isolation = Isolation.SANDBOX  # a part of its memory, through its lane host only
        request = ReservationRequest(
            reservation_id=f"{hold.subject}/{index}",
            requirement=Requirement.GPU,
            isolation=isolation,
            vram_bytes=0 if grant.whole else grant.vram_bytes,
            lane_id=grant.lane_id,
            standing=True,
        )
        try:
            return await self._state.machine.reserve(request)
        except ReservationRefused as refused:
            raise HoldRefused(refused.reason.value, f"{grant.lane_id}: {refused}") from None
        except (OSError, JournalError, trio.TooSlowError) as exc:
            raise HoldRefused("journal_unavailable", str(exc)) from None

    def _mint(self, hold: Hold) -> None:
        tokens = self._state.tokens
        fresh: dict[str, str] = {}
        for reservation in hold.reservations:
            grant = reservation.lanes[0]
            fresh[grant.lane_id] = tokens.mint(
                invocation_id=hold.subject,
                lane_id=grant.lane_id,
                ops=GPU_OPS,
                vram_bytes=grant.vram_bytes,
                isolation=TokenIsolation(reservation.isolation.value),
                deadline=None,
            ).token
        hold.tokens = fresh
        hold.minted_at = time.time()
        self._announce(hold)

    def _mint_or_refuse(self, hold: Hold) -> None:
        try:
            self._mint(hold)
        except CapabilityError as exc:
            raise HoldRefused("token_unavailable", str(exc)) from None

    async def _end_sessions(self, hold: Hold) -> None:
        with trio.move_on_after(CLOSE_SECONDS + 1):
            for lane_id in hold.lane_ids:
                owner = self._state.owners.get(lane_id)
                if owner is not None and owner.holds(hold.subject):
                    await owner.free_invocation(hold.subject)

    async def _undo(self, hold: Hold) -> None:
        """What a hold that could not be made reserved, released again; one whose release
        the journal refuses stays held (with what it still has: Unprepare ends it)."""
        self._state.tokens.revoke_invocation(hold.subject)
        hold.tokens.clear()
        while hold.reservations:
            try:
                await self._state.machine.release(hold.reservations[-1].reservation_id)
            except (OSError, JournalError, trio.TooSlowError) as exc:
                log.error("claim %s: a reservation left held: %s", hold.claim_uid, exc)
                self.holds[hold.subject] = hold
                self._state.on_change()
                return
            hold.reservations = hold.reservations[:-1]
