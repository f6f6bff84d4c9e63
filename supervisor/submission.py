"""Submission: an invocation is admitted (checked, reserved and journaled, its tokens
minted) and handed to its actor; a resubmission answers what the first one got."""

from __future__ import annotations

import time

import trio

from capabilities import Isolation as TokenIsolation
from capabilities import LaneOp
from capabilities.errors import CapabilityError
from machine.journal import JournalError
from machine.lanes import Isolation, LaneKind, Requirement
from machine.ledger import ReservationRefused, ReservationRequest
from machine.model import JOURNAL_RETRY_INTERVAL
from supervisor.admission import (
    AdmissionRefused,
    check_cwd,
    check_network,
    check_request,
    from_reservation_refusal,
    id_conflict,
)
from supervisor.endings import Endings
from supervisor.health_coupling import FAILED_STATES
from supervisor.invocation import Invocation, utc_now
from supervisor.remembered import recorded_submit_response, request_digest
from supervisor.state import SupervisorState
from supervisor.wire import (
    EventKind,
    InvocationRequest,
    InvocationState,
    NodeEvent,
    ProcessWork,
    SubmitResponse,
)

__all__ = ["Submission"]

GPU_OPS = frozenset(LaneOp)  # reserve, release, write, read, execute
CPU_OPS = frozenset({LaneOp.EXECUTE})
EXCLUSIVE = frozenset({Isolation.DEDICATED, Isolation.PARTITIONED})


class Submission:
    def __init__(self, state: SupervisorState, endings: Endings) -> None:
        self._state = state
        self._endings = endings

    async def submit(self, request: InvocationRequest) -> SubmitResponse:
        state = self._state
        existing = state.live.get(request.id) or state.ended.get(request.id)
        if existing is not None:
            return await self._resubmitted(existing, request)
        try:
            record = state.machine.ended_invocation(request.id)
        except JournalError as exc:  # whether the id ended cannot be told: never run it
            raise AdmissionRefused(
                503, "journal_unavailable", str(exc), retry_after=JOURNAL_RETRY_INTERVAL
            ) from None
        if record is not None:  # ended before a restart, or forgotten from memory since
            if record.request_digest != request_digest(request):
                raise id_conflict(request.id)
            return recorded_submit_response(record)
        if not state.accepting or state.nursery is None:
            raise AdmissionRefused(503, "shutting_down", "the node is not admitting work")
        if state.drained:
            self._announce_refusal(request.id, "node_draining")
            raise AdmissionRefused(
                503, "node_draining", "the node is drained: it admits no new work"
            )
        if (full := state.machine.journal.reserve_problem) is not None:
            self._announce_refusal(request.id, "journal_unavailable")
            raise AdmissionRefused(
                503, "journal_unavailable", full, retry_after=JOURNAL_RETRY_INTERVAL
            )
        if state.machine.idempotency_room() <= len(state.live):
            # Each live invocation's id will need room too; none is forgotten to make it.
            self._announce_refusal(request.id, "idempotency_full")
            raise AdmissionRefused(
                503,
                "idempotency_full",
                "the node remembers as many ended ids as it may for the idempotency window "
                "(--idempotency-max-ids): new work waits until the oldest leave it",
                retry_after=state.machine.seconds_until_idempotency_room(),
            )
        if state.waiting >= state.max_queued:
            self._announce_refusal(request.id, "queue_full")
            raise AdmissionRefused(
                429, "queue_full", "too many invocations are waiting", retry_after=1.0
            )
        try:
            check_request(request)
            if isinstance(request.work, ProcessWork) and state.guests.refusal is not None:
                # Fail closed: this node cannot confine a guest (the reason is on /readyz).
                raise AdmissionRefused(503, "guests_unconfinable", state.guests.refusal)
            if isinstance(request.work, ProcessWork) and request.work.cwd is not None:
                check_cwd(state.guests, request.work.cwd)
            if isinstance(request.work, ProcessWork):
                check_network(state.guests, request.work)
        except AdmissionRefused as refused:
            self._announce_refusal(request.id, refused.reason)
            raise
        inv = Invocation(
            request, trio.CancelScope(deadline=trio.current_time() + request.timeout_s)
        )
        state.live[inv.id] = inv  # claims the id while the reservation is journaled
        state.waiting += 1
        try:
            await self._admit(inv)
            if self._stopped() or not state.accepting:  # stopped while this was journaled
                with trio.CancelScope(shield=True):
                    self._endings.revoke(inv)
                    await state.machine.release(inv.id)
                raise AdmissionRefused(503, "shutting_down", "the node is not admitting work")
        except BaseException as exc:
            del state.live[inv.id]
            state.waiting -= 1
            inv.end_admission()
            inv.finished.set()  # a cancel that arrived during admission answers now
            reason = exc.reason if isinstance(exc, AdmissionRefused) else "admission_failed"
            self._announce_refusal(inv.id, reason)
            raise
        inv.end_admission()
        if inv.reservation is not None and any(
            state.machine.ledger.lane_health(g.lane_id) in FAILED_STATES
            for g in inv.reservation.lanes
        ):
            # A fault reached the lane while the grant was being journaled, before
            # on_health/lane_faulted could see the reservation: it must not run there.
            inv.cancel("lane_unhealthy")
        if state.logs is not None:
            inv.logs = state.logs.begin(inv.id)  # followers may ask for its logs from now on
        state.nursery.start_soon(self._endings.actor, inv)
        self._endings.announce(inv, inv.submitted_at)
        return inv.submit_response()

    def _stopped(self) -> bool:
        return self._state.nursery is None

    async def _resubmitted(self, inv: Invocation, request: InvocationRequest) -> SubmitResponse:
        if request != inv.request:  # by value: key order in a dict does not matter
            raise id_conflict(request.id)
        with trio.fail_after(self._state.cleanup_deadline):
            await inv.admission_ended()
        if inv.id not in self._state.live and inv.id not in self._state.ended:
            raise AdmissionRefused(409, "admission_failed", "the first submission was refused")
        return inv.submit_response()

    async def _admit(self, inv: Invocation) -> None:
        machine = self._state.machine
        request = inv.request
        resources = request.resources
        requirement = request.requirement
        asks_device = resources.gpus or resources.vram_bytes or request.isolation in EXCLUSIVE
        if requirement is Requirement.AUTO and not asks_device:
            requirement = Requirement.CPU  # asks for no device: it gets none
        try:
            inv.reservation = await machine.reserve(
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
                minted = self._state.tokens.mint(
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
                self._endings.revoke(inv)
                await machine.release(inv.id)
            raise AdmissionRefused(503, "token_unavailable", str(exc)) from None

    def _announce_refusal(self, invocation_id: str, reason: str) -> None:
        self._state.events.publish(
            NodeEvent(
                kind=EventKind.admission,
                at=utc_now(),
                to_state=InvocationState.rejected.value,
                reasons=[f"{invocation_id}: {reason}"],
            )
        )
