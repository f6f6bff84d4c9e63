"""Ended invocations as the journal remembers them, so an id never runs twice.

The journal keeps, per ended invocation, a digest of its request and its final
status (without the output text, which is not kept), for the idempotency
window (`--idempotency-window`, on disk: `machine/ended_index.py`). After a
restart a resubmission with the same request answers that status; another
request under the id is a conflict, as it is before a restart.
"""

from __future__ import annotations

import datetime
import hashlib
import time

import msgspec

from machine.journal import EndedRecord
from machine.lanes import Isolation, Requirement
from machine.reservation import Reservation
from machine.snapshot import rfc3339
from supervisor.invocation import Invocation, duration_between
from supervisor.wire import (
    GrantedLane,
    InvocationRequest,
    InvocationState,
    InvocationStatus,
    SubmitResponse,
)

__all__ = [
    "ended_record",
    "recorded_status",
    "recorded_submit_response",
    "request_digest",
    "restart_ended_record",
]


# How a request's last field encodes when it has no labels.
_NO_LABELS = b',"labels":{}}'


def request_digest(request: InvocationRequest) -> str:
    """SHA-256 of the request in a canonical encoding (dict keys sorted at every level).
    Without labels, the encoding leaves the (empty) field out: a request hashes as it
    did before labels existed, so its id stays idempotent across the upgrade."""
    raw = msgspec.json.encode(request, order="deterministic")
    if not request.labels:
        if not raw.endswith(_NO_LABELS):  # `labels` is no longer the last field
            raise AssertionError("InvocationRequest.labels must stay its last field")
        raw = raw[: -len(_NO_LABELS)] + b"}"
    return hashlib.sha256(raw).hexdigest()


def ended_record(inv: Invocation, final: InvocationStatus) -> tuple[EndedRecord, InvocationStatus]:
    """The record of `inv` as it will be once its `final` status is recorded (written
    before that, so nobody sees the terminal state unremembered), and the status the
    record holds: `final` without the output text, which the journal does not keep."""
    status = final
    if final.stdout_tail or final.stderr_tail:
        status = msgspec.structs.replace(final, stdout_tail="", stderr_tail="")
    reservation = inv.reservation
    record = EndedRecord(
        invocation_id=inv.id,
        # Its reservation carries the digest taken at admission: not hashed again.
        request_digest=reservation.request_digest
        if reservation is not None and reservation.request_digest
        else request_digest(inv.request),
        ended_at=time.time(),
        outcome=msgspec.json.encode(status),
    )
    return record, status


def restart_ended_record(reservation: Reservation) -> EndedRecord:
    """An invocation the previous daemon left running ended with it (reconcile released
    it): remembered as failed with reason `node_restarted`, under its request's digest."""
    ended_at = rfc3339(datetime.datetime.now(datetime.UTC))
    status = InvocationStatus(
        id=reservation.reservation_id,
        state=InvocationState.failed,
        reason="node_restarted",
        requirement=reservation.requirement,
        isolation=reservation.isolation,
        lanes=[
            GrantedLane(lane_id=g.lane_id, kind=g.kind.value, vram_bytes=g.vram_bytes)
            for g in reservation.lanes
        ],
        submitted_at=ended_at,  # not journaled; the end is what the restart knows
        ended_at=ended_at,
    )
    return EndedRecord(
        invocation_id=reservation.reservation_id,
        request_digest=reservation.request_digest,
        ended_at=time.time(),
        outcome=msgspec.json.encode(status),
    )


def recorded_status(record: EndedRecord) -> InvocationStatus:
    """The status `record` holds. One written before statuses had a duration gets it
    from its start and end, where it started (its command and resources stay unknown)."""
    try:
        status = msgspec.json.decode(record.outcome, type=InvocationStatus)
    except msgspec.DecodeError:
        # Written in another shape (another version): the id is still taken.
        ended = rfc3339(datetime.datetime.fromtimestamp(record.ended_at, datetime.UTC))
        return InvocationStatus(
            id=record.invocation_id,
            state=InvocationState.failed,
            reason="recorded_outcome_unreadable",
            requirement=Requirement.AUTO,
            isolation=Isolation.SHARED,
            lanes=[],
            submitted_at=ended,
            ended_at=ended,
        )
    if status.duration_s is None and status.started_at and status.ended_at:
        duration = duration_between(status.started_at, status.ended_at)
        status = msgspec.structs.replace(status, duration_s=duration)
    return status


def recorded_submit_response(record: EndedRecord) -> SubmitResponse:
    """The answer to a resubmission: its recorded state and lanes; its tokens are long
    revoked (and were signed by a key retired at the restart), so none."""
    status = recorded_status(record)
    return SubmitResponse(id=status.id, state=status.state, lanes=status.lanes, tokens={})
