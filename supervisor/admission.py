"""Admission: checking a submission before anything is allocated, and why it was refused.

Every refusal is an `AdmissionRefused` with a snake_case `reason` and the
honest HTTP status: 429 (with Retry-After) for load, 409 for a conflict with
current state (capacity, a reused id), 422 for a request that can never be
met, 503 while the node is shutting down.
"""

from __future__ import annotations

from typing import Any

from machine.lanes import Isolation
from machine.ledger import RefusalReason, ReservationRefused
from supervisor.builtins import BuiltinArgumentError, check_builtin
from supervisor.guests import GuestPolicy
from supervisor.process import InvalidProcessRequest, validate_argv, validate_env
from supervisor.wire import (
    INVOCATION_ID,
    LABEL_KEY,
    BuiltinWork,
    GuestNetwork,
    InvocationRequest,
    ProcessWork,
)

__all__ = [
    "AdmissionRefused",
    "check_cwd",
    "check_labels",
    "check_network",
    "check_request",
    "from_reservation_refusal",
    "id_conflict",
]

# Capacity that may free up soon is a conflict with the present, not a bad request.
_CONFLICTS = {
    RefusalReason.INSUFFICIENT_CPU,
    RefusalReason.INSUFFICIENT_MEMORY,
    RefusalReason.INSUFFICIENT_VRAM,
    RefusalReason.INSUFFICIENT_GPUS,
    RefusalReason.LANE_UNHEALTHY,
    RefusalReason.LANE_DRAINED,
    RefusalReason.DUPLICATE_RESERVATION,
}


class AdmissionRefused(Exception):
    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        details: dict[str, Any] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.details = details or {}
        self.retry_after = retry_after


def check_request(request: InvocationRequest) -> None:
    """Refuse what cannot run, before a reservation or a token exists."""
    # The wire pattern's `$` also matches before a final newline; ids reach logs,
    # events and cgroup names, so the whole id must match.
    if not INVOCATION_ID.fullmatch(request.id):
        raise AdmissionRefused(422, "invalid_request", "id: not a valid invocation id")
    check_labels(request.labels)
    work = request.work
    try:
        if isinstance(work, ProcessWork):
            validate_argv(work.argv)
            validate_env(work.env)
            if work.cwd is not None and ("\0" in work.cwd or not work.cwd.startswith("/")):
                raise InvalidProcessRequest("cwd", "must be an absolute path")
            if work.network is GuestNetwork.HOST and request.isolation is Isolation.SANDBOX:
                raise InvalidProcessRequest("network", "a sandbox guest never has the host's")
            # A limit of 0 would mean "no limit": every process gets both enforced.
            if request.resources.cpu_millis < 1 or request.resources.memory_bytes < 1:
                raise InvalidProcessRequest(
                    "resources", "process work needs cpu_millis and memory_bytes above 0"
                )
        else:
            assert isinstance(work, BuiltinWork)
            check_builtin(work.name, work.args)
    except (InvalidProcessRequest, BuiltinArgumentError) as exc:
        raise AdmissionRefused(422, "invalid_request", str(exc)) from None
    if request.resources.gpus > 1 and request.requirement.value == "cpu":
        raise AdmissionRefused(422, "invalid_request", "a cpu invocation asks for no GPUs")


def check_labels(labels: dict[str, str]) -> None:
    """What the wire's bounds let through and a list or a terminal should not show: a
    key with a final newline (the wire pattern's `$` matches before one), a value with
    a control character. 422 `invalid_request` naming the label."""
    for key, value in labels.items():
        if not LABEL_KEY.fullmatch(key):
            raise AdmissionRefused(
                422, "invalid_request", f"labels: {key!r} is not a label key", {"field": "labels"}
            )
        if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in value):
            raise AdmissionRefused(
                422,
                "invalid_request",
                f"labels.{key}: a label value holds no control characters",
                {"field": f"labels.{key}"},
            )


def check_cwd(guests: GuestPolicy, cwd: str) -> None:
    """A cwd that would cover the sandbox or reach the node's secrets, or that really
    lies under none of the node's cwd roots: 422 `invalid_cwd`, before a reservation
    exists (the guest's start checks the folder it opens again)."""
    try:
        guests.check_cwd(cwd)
    except InvalidProcessRequest as exc:
        raise AdmissionRefused(422, "invalid_cwd", str(exc), {"field": "cwd"}) from None


def check_network(guests: GuestPolicy, work: ProcessWork) -> None:
    """The host's network only where the operator allows it: 422 `host_network_not_allowed`,
    before a reservation exists. Every other guest has a network namespace of its own."""
    if work.network is GuestNetwork.HOST and not guests.host_network:
        raise AdmissionRefused(
            422,
            "host_network_not_allowed",
            "work.network: this node gives no guest the host's network "
            "(its operator has not given --guest-host-network)",
            {"field": "work.network"},
        )


def from_reservation_refusal(refusal: ReservationRefused) -> AdmissionRefused:
    status = 409 if refusal.reason in _CONFLICTS else 422
    return AdmissionRefused(
        status,
        refusal.reason.value,
        f"reservation refused: {refusal.reason.value}",
        refusal.details,
    )


def id_conflict(invocation_id: str) -> AdmissionRefused:
    return AdmissionRefused(
        409, "id_conflict", f"invocation {invocation_id} exists with a different request"
    )
