"""The supervisor: admits invocations, runs each as an ephemeral actor, owns the lanes.

Each invocation runs in the supervisor's nursery under its own cancel scope
with its deadline. Whatever ends it, cleanup runs shielded with its own
deadline (when only the journal is awaited, the journal's commit is that
shield and deadline), in this order: the process group is already gone (the executor
ends it), lane state it held is freed, its tokens are revoked, its
reservation is released and journaled -- and only then is the terminal
state recorded and announced.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable

import trio

from capabilities import (
    Claims,
    LaneOp,
    LaneValidator,
    MintedToken,
    TokenRefusal,
    TokenRefused,
    TokenService,
)
from capabilities import Isolation as TokenIsolation
from capabilities.errors import CapabilityError, MintError, RevocationFull
from machine import Machine
from machine.health import HealthState, HealthTransition
from machine.journal import JournalError
from machine.lanes import Isolation, Lane, LaneKind, Requirement
from machine.ledger import ReservationRefused, ReservationRequest
from machine.model import JOURNAL_RETRY_INTERVAL
from supervisor.admission import AdmissionRefused, check_request, from_reservation_refusal
from supervisor.events import EventHub
from supervisor.guests import GuestPolicy
from supervisor.history import History
from supervisor.invocation import Invocation, utc_now
from supervisor.lane_owner import LaneOwner, LaneWorkError
from supervisor.lane_work import Download, LaneDevice, LaneJob, LaneWorkReply
from supervisor.lifecycle import TERMINAL, Ending, next_state
from supervisor.listing import Listed, ListQuery, page
from supervisor.logstore import LogStore
from supervisor.process import ConfinementFailed, ProcessStuck
from supervisor.remembered import (
    ended_record,
    recorded_status,
    recorded_submit_response,
    request_digest,
    restart_ended_record,
)
from supervisor.runner import RunEnv, run_work
from supervisor.wire import (
    EventKind,
    InvocationList,
    InvocationRequest,
    InvocationState,
    InvocationStatus,
    NodeEvent,
    ProcessWork,
    SubmitResponse,
)

__all__ = ["Supervisor", "UnknownInvocation"]

log = logging.getLogger(__name__)
GPU_OPS = frozenset(LaneOp)  # reserve, release, write, read, execute
CPU_OPS = frozenset({LaneOp.EXECUTE})
FAILED_STATES = frozenset({HealthState.UNHEALTHY, HealthState.LOST})
EXCLUSIVE = frozenset({Isolation.DEDICATED, Isolation.PARTITIONED})
_PROBLEM_CHARS = 200  # of a restarting host's last failure, per lane, in /readyz


class UnknownInvocation(KeyError):
    pass


def _same(status: InvocationStatus) -> InvocationStatus:
    return status


class Supervisor:
    def __init__(
        self,
        machine: Machine,
        tokens: TokenService,
        events: EventHub[NodeEvent],
        lane_hosts: Callable[[Lane], LaneDevice],
        *,
        max_queued: int,
        max_running: int,
        node_url: str = "",
        kill_grace: float = 5.0,
        cleanup_deadline: float = 30.0,
        lane_work_deadline: float = 120.0,
        lane_host_start_wait: float = 60.0,
        retain_ended: int = 1024,
        on_change: Callable[[], None] = lambda: None,
        guests: GuestPolicy | None = None,
        logs: LogStore | None = None,
        on_lane_host_call: Callable[[str, float], None] = lambda _op, _seconds: None,
    ) -> None:
        self.machine = machine
        # Every invocation's stdout and stderr on disk; None keeps only the status's tail.
        self.logs = logs
        # Tests of the supervisor's own logic run guests unconfined; the daemon confines.
        self.guests = guests or GuestPolicy.unconfined(machine.journal.path.parent)
        self.tokens = tokens
        self.validator: LaneValidator = tokens.validator()
        self.events = events
        self.node_url = node_url
        self.max_queued = max_queued
        self.max_running = max_running
        self.kill_grace = kill_grace
        self.cleanup_deadline = cleanup_deadline
        self.lane_work_deadline = lane_work_deadline
        self.lane_host_start_wait = lane_host_start_wait
        self._retain = retain_ended
        self._on_change = on_change
        self._slots = trio.Semaphore(max_running)
        self._live: dict[str, Invocation] = {}
        self._waiting = 0  # live invocations in `queued` (admitted or being admitted)
        self._ended: OrderedDict[str, Invocation] = OrderedDict()
        # Invocations ended since start, by final state: only ever grows (unlike `_ended`).
        self._ended_totals: dict[InvocationState, int] = {}
        # Every ending the journal remembers (from before a restart too), for the list.
        self._history = History(machine.replay.ended.values())
        self.accepting = True
        # An operator's whole-node drain: kept in memory only (a restart forgets it).
        self.drained = False
        self._nursery: trio.Nursery | None = None
        self._env = RunEnv(
            machine=machine, node_url=node_url, kill_grace=kill_grace, guests=self.guests
        )
        self.owners = {
            lane.lane_id: LaneOwner(
                lane,
                self.validator,
                lane_hosts,
                is_live=lambda sub: sub in self._live,
                usable=machine.ledger.available,
                on_fault=self._lane_faulted,
                on_host_failed=self._lane_host_failed,
                on_host_call=on_lane_host_call,
            )
            for lane in machine.ledger.lanes()
        }

    # -- running ------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for owner in self.owners.values():
                    nursery.start_soon(owner.run)
                await self._remember_restart_endings()
                # Ready once every lane's host has answered its hello (or failed to, and
                # is being restarted: lane_hosts_problem says so); each start is bounded.
                with trio.move_on_after(self.lane_host_start_wait):
                    for owner in self.owners.values():
                        await owner.first_start.wait()
                task_status.started()
                await trio.sleep_forever()
        finally:
            # A closed nursery takes no actor: refuse before reserving, never after.
            self.accepting = False
            self._nursery = None

    async def shutdown(self, grace: float) -> None:
        """Stop admitting; give running work `grace` seconds, then cancel the rest and
        wait (bounded) until everything is released."""
        self.accepting = False
        with trio.move_on_after(grace):
            for inv in list(self._live.values()):
                await inv.finished.wait()
        for inv in list(self._live.values()):
            self._cancel(inv, "shutdown")
        with trio.move_on_after(self.cleanup_deadline + self.kill_grace):
            for inv in list(self._live.values()):
                await inv.finished.wait()

    def _run_env(self) -> RunEnv:
        env = self._env
        if (env.node_url, env.kill_grace, env.guests) != (
            self.node_url,
            self.kill_grace,
            self.guests,
        ):  # changed since the last invocation: built again (rarely: settings are fixed)
            env = self._env = RunEnv(
                machine=self.machine,
                node_url=self.node_url,
                kill_grace=self.kill_grace,
                guests=self.guests,
            )
        return env

    def background(self, task: Callable[[], Awaitable[None]]) -> None:
        """Run `task` in the supervisor's nursery (bookkeeping beside an invocation)."""
        assert self._nursery is not None
        self._nursery.start_soon(task)

    # -- reading ------------------------------------------------------------------------
    def get(self, invocation_id: str) -> InvocationStatus:
        inv = self._live.get(invocation_id) or self._ended.get(invocation_id)
        if inv is not None:
            return inv.status()
        record = self.machine.ended_invocation(invocation_id)
        if record is None:
            raise UnknownInvocation(invocation_id)
        return recorded_status(record)  # ended before a restart (or long ago)

    def until_ended(self, invocation_id: str) -> trio.Event | None:
        """Set once the invocation has ended and released everything; None when it is not
        live (already ended, or unknown)."""
        inv = self._live.get(invocation_id)
        return None if inv is None else inv.finished

    def list(self) -> list[InvocationStatus]:
        return [inv.status() for inv in (*self._live.values(), *self._ended.values())]

    def list_page(self, query: ListQuery) -> InvocationList:
        """One page of the invocations `get` answers for, newest first (see listing.py):
        live ones, those ended since the start, and those the journal remembers."""
        here = (*self._live.values(), *self._ended.values())
        known = {inv.id for inv in here}
        listed = [Listed((inv.submitted_at, inv.id), inv.state, inv.status) for inv in here]
        listed.extend(
            Listed((status.submitted_at, status.id), status.state, functools.partial(_same, status))
            for status in self._history.statuses()
            if status.id not in known
        )
        return page(listed, query)

    def ended_totals(self) -> dict[InvocationState, int]:
        """How many invocations ended since start, by final state (never decreases)."""
        return dict(self._ended_totals)

    def counts(self) -> dict[InvocationState, int]:
        counts = dict.fromkeys(InvocationState, 0)
        for inv in (*self._live.values(), *self._ended.values()):
            counts[inv.state] += 1
        return counts

    # -- admission ----------------------------------------------------------------------
    async def submit(self, request: InvocationRequest) -> SubmitResponse:
        existing = self._live.get(request.id) or self._ended.get(request.id)
        if existing is not None:
            return await self._resubmitted(existing, request)
        record = self.machine.ended_invocation(request.id)
        if record is not None:  # ended before a restart, or forgotten from memory since
            if record.request_digest != request_digest(request):
                raise self._id_conflict(request.id)
            return recorded_submit_response(record)
        if not self.accepting or self._nursery is None:
            raise AdmissionRefused(503, "shutting_down", "the node is not admitting work")
        if self.drained:
            self._announce_refusal(request.id, "node_draining")
            raise AdmissionRefused(
                503, "node_draining", "the node is drained: it admits no new work"
            )
        if self._waiting >= self.max_queued:
            self._announce_refusal(request.id, "queue_full")
            raise AdmissionRefused(
                429, "queue_full", "too many invocations are waiting", retry_after=1.0
            )
        try:
            check_request(request)
            if isinstance(request.work, ProcessWork) and self.guests.refusal is not None:
                # Fail closed: this node cannot confine a guest (the reason is on /readyz).
                raise AdmissionRefused(503, "guests_unconfinable", self.guests.refusal)
        except AdmissionRefused as refused:
            self._announce_refusal(request.id, refused.reason)
            raise
        inv = Invocation(
            request, trio.CancelScope(deadline=trio.current_time() + request.timeout_s)
        )
        self._live[inv.id] = inv  # claims the id while the reservation is journaled
        self._waiting += 1
        try:
            await self._admit(inv)
            if self._stopped() or not self.accepting:  # stopped while this was journaled
                with trio.CancelScope(shield=True):
                    self._revoke(inv)
                    await self.machine.release(inv.id)
                raise AdmissionRefused(503, "shutting_down", "the node is not admitting work")
        except BaseException as exc:
            del self._live[inv.id]
            self._waiting -= 1
            inv.end_admission()
            inv.finished.set()  # a cancel that arrived during admission answers now
            reason = exc.reason if isinstance(exc, AdmissionRefused) else "admission_failed"
            self._announce_refusal(inv.id, reason)
            raise
        inv.end_admission()
        if inv.reservation is not None and any(
            self.machine.ledger.lane_health(g.lane_id) in FAILED_STATES
            for g in inv.reservation.lanes
        ):
            # A fault reached the lane while the grant was being journaled, before
            # on_health/_lane_faulted could see the reservation: it must not run there.
            self._cancel(inv, "lane_unhealthy")
        if self.logs is not None:
            inv.logs = self.logs.begin(inv.id)  # followers may ask for its logs from now on
        self._nursery.start_soon(self._actor, inv)
        self._announce(inv, inv.submitted_at)
        return inv.submit_response()

    def _stopped(self) -> bool:
        return self._nursery is None

    async def _resubmitted(self, inv: Invocation, request: InvocationRequest) -> SubmitResponse:
        if request != inv.request:  # by value: key order in a dict does not matter
            raise self._id_conflict(request.id)
        with trio.fail_after(self.cleanup_deadline):
            await inv.admission_ended()
        if inv.id not in self._live and inv.id not in self._ended:
            raise AdmissionRefused(409, "admission_failed", "the first submission was refused")
        return inv.submit_response()

    @staticmethod
    def _id_conflict(invocation_id: str) -> AdmissionRefused:
        return AdmissionRefused(
            409, "id_conflict", f"invocation {invocation_id} exists with a different request"
        )

    async def _admit(self, inv: Invocation) -> None:
        request = inv.request
        resources = request.resources
        requirement = request.requirement
        asks_device = resources.gpus or resources.vram_bytes or request.isolation in EXCLUSIVE
        if requirement is Requirement.AUTO and not asks_device:
            requirement = Requirement.CPU  # asks for no device: it gets none
        try:
            inv.reservation = await self.machine.reserve(
                ReservationRequest(
                    reservation_id=inv.id,
                    cpu_millis=resources.cpu_millis,
                    memory_bytes=resources.memory_bytes,
                    requirement=requirement,
                    isolation=request.isolation,
                    vram_bytes=resources.vram_bytes,
                    gpus=max(1, resources.gpus),
                    request_digest=request_digest(request),
                )
            )
        except ReservationRefused as refusal:
            raise from_reservation_refusal(refusal) from None
        except (OSError, JournalError, trio.TooSlowError) as exc:
            # Nothing was reserved (the machine gave it back); the node's fault, say so.
            raise AdmissionRefused(
                503,
                "journal_unavailable",
                f"the reservation could not be journaled: {exc}",
                retry_after=JOURNAL_RETRY_INTERVAL,
            ) from None
        deadline = inv.wall_deadline = time.time() + request.timeout_s
        try:
            for grant in inv.reservation.lanes:
                minted = self.tokens.mint(
                    invocation_id=inv.id,
                    lane_id=grant.lane_id,
                    ops=CPU_OPS if grant.kind is LaneKind.CPU else GPU_OPS,
                    vram_bytes=grant.vram_bytes,
                    isolation=TokenIsolation(request.isolation.value),
                    deadline=deadline,
                )
                inv.tokens[grant.lane_id] = minted.token
        except CapabilityError as exc:
            with trio.CancelScope(shield=True):
                self._revoke(inv)
                await self.machine.release(inv.id)
            raise AdmissionRefused(503, "token_unavailable", str(exc)) from None

    # -- cancelling ---------------------------------------------------------------------
    async def cancel(self, invocation_id: str) -> InvocationStatus:
        """Cancel and answer only once everything the invocation held is released."""
        inv = self._live.get(invocation_id)
        if inv is None:
            return self.get(invocation_id)
        self._cancel(inv, "cancel_requested")
        with trio.fail_after(self.cleanup_deadline + self.kill_grace + 5):
            await inv.finished.wait()
        if inv.state not in TERMINAL:  # its admission failed: it never existed
            raise UnknownInvocation(invocation_id)
        return inv.status()

    def _cancel(self, inv: Invocation, reason: str) -> None:
        if inv.cancel_reason is None:
            inv.cancel_reason = reason
        inv.scope.cancel()

    def on_health(self, event: HealthTransition) -> None:
        """Health coupling: work on a failed device is cancelled with `lane_unhealthy`."""
        if event.to_state in FAILED_STATES:
            for inv in list(self._live.values()):
                if inv.reservation and any(
                    g.device_id == event.device_id for g in inv.reservation.lanes
                ):
                    self._cancel(inv, "lane_unhealthy")
        self.events.publish(
            NodeEvent(
                kind=EventKind.health,
                at=utc_now(),
                device_id=event.device_id,
                from_state=event.from_state.value,
                to_state=event.to_state.value,
                reasons=list(event.reasons),
            )
        )
        self._on_change()

    def _lane_faulted(self, lane_id: str) -> None:
        self.machine.ledger.fault_lane(lane_id)
        for inv in list(self._live.values()):
            if inv.reservation and any(g.lane_id == lane_id for g in inv.reservation.lanes):
                self._cancel(inv, "lane_unhealthy")
        self.events.publish(
            NodeEvent(kind=EventKind.lane, at=utc_now(), lane_id=lane_id, to_state="unhealthy")
        )
        self._on_change()

    def lane_hosts_problem(self) -> str | None:
        """Lanes whose host has not answered its hello yet, or not again since it
        failed: the node is not ready while one is on its way (for /readyz)."""
        waiting = [
            f"{lane_id} ({owner.host_status}{': ' if owner.host_problem else ''}"
            f"{owner.host_problem[:_PROBLEM_CHARS]})"
            for lane_id, owner in sorted(self.owners.items())
            if owner.host_status in ("starting", "restarting")
        ]
        return "waiting for lane hosts: " + "; ".join(waiting) if waiting else None

    def faulted_lanes(self) -> str | None:
        """Lanes whose host failed too often and are out of service (a note: the
        other lanes still serve)."""
        faulted = sorted(lane_id for lane_id, owner in self.owners.items() if owner.faulted)
        return "lane hosts failed too often: " + ", ".join(faulted) if faulted else None

    def _lane_host_failed(self, lane_id: str, holders: Iterable[str]) -> None:
        """A lane host died with their buffers: nothing they computed there is left."""
        for sub in holders:
            inv = self._live.get(sub)
            if inv is not None:
                self._cancel(inv, "lane_host_failed")
        self.events.publish(
            NodeEvent(kind=EventKind.lane, at=utc_now(), lane_id=lane_id, to_state="host_restarted")
        )

    # -- the actor ----------------------------------------------------------------------
    async def _actor(self, inv: Invocation) -> None:
        ending: Ending | None = None
        try:
            with inv.scope:
                if inv.logs is not None:
                    await inv.logs.create()
                await self._take_slot()
                try:
                    self._waiting -= 1
                    inv.advance(Ending.start)
                    self._announce(inv, inv.started_at)
                    inv.exit_code = await run_work(self._run_env(), inv)
                finally:
                    self._slots.release()
                ending = Ending.succeed if inv.exit_code == 0 else Ending.fail
                inv.reason = None if inv.exit_code == 0 else inv.failure_reason()
        except ProcessStuck as exc:
            ending, inv.reason, inv.stuck = Ending.fail, f"process_stuck: {exc}", True
        except ConfinementFailed as exc:
            ending, inv.reason = Ending.fail, f"confinement_failed: {exc}"[:500]
        except Exception as exc:
            ending, inv.reason = Ending.fail, f"{type(exc).__name__}: {exc}"[:500]
        except BaseException:
            ending, inv.reason = Ending.cancel, inv.cancel_reason or "shutdown"
            raise
        finally:
            if ending is None:  # the scope caught a cancel: a request, a fault or the deadline
                ending = Ending.cancel if inv.cancel_reason else Ending.timeout
                inv.reason = inv.cancel_reason or "deadline_exceeded"
            ended_at = utc_now()
            final = await self._clean_up(inv, next_state(inv.state, ending), ended_at)
            if inv.state is InvocationState.queued:  # ended before it ran
                self._waiting -= 1
            inv.advance(ending, at=ended_at)
            self._retire(inv)
            self._announce(inv, ended_at, final)
            inv.finished.set()

    async def _take_slot(self) -> None:
        """A run slot: at once when one is free (the actor has just been scheduled, it
        needs no further turn), else wait in line; a cancel before it counts either way."""
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            await self._slots.acquire()

    async def _clean_up(
        self, inv: Invocation, state: InvocationState, ended_at: str
    ) -> InvocationStatus | None:
        """Free what `inv` holds and journal its ending, shielded and bounded; returns
        its final status (None when the cleanup overran its deadline)."""
        grants = inv.reservation.lanes if inv.reservation else ()
        self._revoke(inv)  # first: none of its queued lane work runs any more
        owners = [
            owner
            for grant in grants
            if (owner := self.owners.get(grant.lane_id)) is not None and owner.holds(inv.id)
        ]
        if inv.logs is None and not owners:
            # Only the journal is awaited, and its commit is shielded and bounded by the
            # journal's own deadline: no cancel scope of ours is needed around it.
            return await self._release(inv, state, ended_at)
        final = None
        with trio.move_on_after(self.cleanup_deadline, shield=True) as cleanup:
            if inv.logs is not None:
                await inv.logs.close()  # complete: its followers end, its cut is final
            for owner in owners:
                await owner.free_invocation(inv.id)
            final = await self._release(inv, state, ended_at)
        if cleanup.cancelled_caught:
            log.error("cleanup of %s overran %ss", inv.id, self.cleanup_deadline)
        return final

    async def _release(
        self, inv: Invocation, state: InvocationState, ended_at: str
    ) -> InvocationStatus:
        """Give back its reservation and journal its ending (Machine.end: shielded, under
        the journal's deadline); returns its final status."""
        grants = inv.reservation.lanes if inv.reservation else ()
        if inv.stuck:
            # A process that survived SIGKILL still holds its devices: keep the
            # reservation (a restart's reconcile keeps it too) and fault its GPU lanes.
            log.error("%s: process %s survived SIGKILL; its resources stay held", inv.id, inv.pid)
            for grant in grants:
                if grant.kind is not LaneKind.CPU:
                    self._lane_faulted(grant.lane_id)
        # The release, the process's end and how it ended (so its id does not run
        # again after a restart) are journaled in one write: one fsync before the
        # terminal state is recorded (and before DELETE answers).
        final = inv.status(state=state, ended_at=ended_at)
        record, remembered = ended_record(inv, final)
        if await self.machine.end(inv.id, pid=inv.pid, outcome=record, keep=inv.stuck):
            self._history.add(record, remembered)
        return final

    async def _remember_restart_endings(self) -> None:
        """What the previous daemon left running ended with it: remember each, so a
        resubmission answers `failed: node_restarted` instead of running it again."""
        recovery, replay = self.machine.recovery, self.machine.replay
        for reservation_id in recovery.released if recovery is not None else ():
            reservation = replay.reservations.get(reservation_id)
            if reservation is None or not reservation.request_digest:
                continue  # journaled before digests were: nothing to compare a retry with
            if self.machine.ended_invocation(reservation_id) is not None:
                continue
            record = restart_ended_record(reservation)
            try:
                await self.machine.invocation_ended(record)
            except Exception as exc:  # the node still starts; the id may run again
                log.error("journal of the restart ending of %s failed: %s", reservation_id, exc)
            else:
                self._history.add(record)

    def _revoke(self, inv: Invocation) -> None:
        # Forgets the invocation's tokens: it frees room and can never fail for lack of it.
        self.tokens.revoke_invocation(inv.id)

    def _retire(self, inv: Invocation) -> None:
        self._live.pop(inv.id, None)
        self._ended[inv.id] = inv
        self._ended_totals[inv.state] = self._ended_totals.get(inv.state, 0) + 1
        while len(self._ended) > self._retain:
            self._ended.popitem(last=False)

    def _announce(
        self, inv: Invocation, at: str | None, status: InvocationStatus | None = None
    ) -> None:
        """Publish its state, stamped when it changed (`at`, the time in its status);
        `status` when it is already built."""
        self.events.publish(
            NodeEvent(
                kind=EventKind.invocation, at=at or utc_now(), invocation=status or inv.status()
            )
        )
        self._on_change()

    def _announce_refusal(self, invocation_id: str, reason: str) -> None:
        self.events.publish(
            NodeEvent(
                kind=EventKind.admission,
                at=utc_now(),
                to_state=InvocationState.rejected.value,
                reasons=[f"{invocation_id}: {reason}"],
            )
        )

    # -- lane work ----------------------------------------------------------------------
    def _owner(self, lane_id: str) -> LaneOwner:
        owner = self.owners.get(lane_id)
        if owner is None:
            raise LaneWorkError(404, "unknown_lane", "no such lane")
        return owner

    def lane_caller(self, lane_id: str, token: str) -> Claims:
        """Whose token this is, if it is authority on the lane for any op; the edge
        asks before it reads a request's body (TokenRefused otherwise)."""
        return self._owner(lane_id).identify(token)

    async def lane_work(self, lane_id: str, token: str, work: LaneJob) -> LaneWorkReply:
        owner = self._owner(lane_id)
        with trio.fail_after(self.lane_work_deadline):
            return await owner.request(token, work)

    async def lane_download(self, lane_id: str, token: str, work: Download) -> bytes:
        owner = self._owner(lane_id)
        with trio.fail_after(self.lane_work_deadline):
            return await owner.download(token, work)

    def check_holder(self, lane_id: str, token: str, op: LaneOp, peer_uid: int) -> None:
        """On the guests' socket, a guest's token works only for that guest's uid:
        a token copied out of its sandbox is refused wherever else it turns up."""
        claims = self.validator.validate(token, lane_id=lane_id, op=op)
        inv = self._live.get(claims.sub)
        if inv is not None and inv.uid is not None and inv.uid != peer_uid:
            raise TokenRefused(
                TokenRefusal.WRONG_HOLDER, f"presented by uid {peer_uid}, not its guest's"
            )

    def refresh_token(self, lane_id: str, token: str) -> MintedToken:
        """A fresh token with the same scope for a live invocation; the old one is revoked.

        Tokens live at most `--token-ttl` (an hour at most); work that runs longer
        trades its still-valid token for a new one, up to its own deadline, once
        the token has used half its life (RefreshTooEarly before that). The new
        token replaces the old one: refreshing adds no state.
        """
        claims = self.validator.validate(token, lane_id=lane_id, op=LaneOp.EXECUTE)
        inv = self._live.get(claims.sub)
        if inv is None or inv.tokens.get(lane_id) != token:
            # Ended, or this token was already traded in for a newer one.
            raise LaneWorkError(409, "token_not_current", "not the invocation's current token")
        try:
            minted = self.tokens.refresh(claims, deadline=inv.wall_deadline)
        except (MintError, RevocationFull) as exc:
            raise LaneWorkError(503, "token_unavailable", str(exc)) from None
        inv.tokens[lane_id] = minted.token
        return minted

    def drain_reason(self) -> str | None:
        """Why readiness is blocked while the node is drained (None when it is not)."""
        return "node_draining: drained by an operator; no new work" if self.drained else None

    def set_node_drained(self, drained: bool) -> None:
        """Cordon the whole node (no new admissions; running work finishes) or lift it.
        Idempotent: a repeat changes nothing and announces nothing."""
        if drained == self.drained:
            return
        self.drained = drained
        self.events.publish(
            NodeEvent(
                kind=EventKind.node,
                at=utc_now(),
                to_state="drained" if drained else "resumed",
            )
        )
        self._on_change()

    def set_drained(self, lane_id: str, drained: bool) -> None:
        """Cordon a lane (no new admissions; running work finishes) or lift it."""
        if drained:
            self.machine.ledger.drain(lane_id)
        else:
            self.machine.ledger.resume(lane_id)
        self.events.publish(
            NodeEvent(
                kind=EventKind.lane,
                at=utc_now(),
                lane_id=lane_id,
                to_state="drained" if drained else "resumed",
            )
        )
        self._on_change()
