"""What a reservation is: the request, the grant per lane, and the typed refusal."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import msgspec

from machine.lanes import Isolation, LaneKind, Requirement

__all__ = [
    "LaneGrant",
    "RefusalReason",
    "Reservation",
    "ReservationRefused",
    "ReservationRequest",
]


class RefusalReason(enum.StrEnum):
    INSUFFICIENT_CPU = "insufficient_cpu"
    INSUFFICIENT_MEMORY = "insufficient_memory"
    INSUFFICIENT_VRAM = "insufficient_vram"
    INSUFFICIENT_GPUS = "insufficient_gpus"
    NO_LANE = "no_lane"
    LANE_UNHEALTHY = "lane_unhealthy"
    LANE_DRAINED = "lane_drained"
    ISOLATION_UNSUPPORTED = "isolation_unsupported"
    DUPLICATE_RESERVATION = "duplicate_reservation"
    INVALID_REQUEST = "invalid_request"


class ReservationRefused(Exception):
    """The ledger refused a request; nothing was reserved. The caller's request is at fault."""

    def __init__(self, reason: RefusalReason, details: Mapping[str, Any] | None = None) -> None:
        self.reason = reason
        self.details: dict[str, Any] = dict(details or {})
        super().__init__(f"{reason.value}: {self.details}" if self.details else reason.value)


class ReservationRequest(msgspec.Struct, frozen=True, kw_only=True):
    reservation_id: str  # the invocation id
    cpu_millis: int = 0
    memory_bytes: int = 0
    requirement: Requirement = Requirement.AUTO
    isolation: Isolation = Isolation.SHARED
    # VRAM wanted on each granted lane for `shared` (and a floor for `partitioned`).
    vram_bytes: int = 0
    gpus: int = 1
    # Pin the grant to one lane (the scheduler chose it); None lets the ledger choose.
    lane_id: str | None = None
    # Journaled with the reservation (see Reservation.request_digest).
    request_digest: str = ""
    # Held for a holder outside the node (see Reservation.standing).
    standing: bool = False


class LaneGrant(msgspec.Struct, frozen=True, kw_only=True):
    lane_id: str
    kind: LaneKind
    device_id: str
    # What CUDA_VISIBLE_DEVICES names (GPU or MIG uuid); None for the CPU pool.
    visible_uuid: str | None
    vram_bytes: int = 0
    exclusive: bool = False


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    reservation_id: str
    cpu_millis: int
    memory_bytes: int
    lanes: tuple[LaneGrant, ...]
    isolation: Isolation
    requirement: Requirement
    # What was asked, as a digest: a restart remembers the invocation it ended by it.
    request_digest: str = ""
    # Held for a holder outside the node (a Kubernetes claim's pods), not for one of
    # its invocations: a restart keeps it, and only its holder's release ends it.
    standing: bool = False

    @property
    def visible_devices(self) -> tuple[str, ...]:
        """The uuids for CUDA_VISIBLE_DEVICES (visibility, not isolation); () for CPU work."""
        return tuple(g.visible_uuid for g in self.lanes if g.visible_uuid is not None)
