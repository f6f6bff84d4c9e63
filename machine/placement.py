"""Which lanes a request gets: the isolation rules, kept apart from the arithmetic.

- `dedicated`: whole GPU lanes nobody else holds; all their VRAM (less headroom).
- `shared`: packs VRAM on one GPU (best fit), next to other shared work.
- `partitioned`: a whole MIG instance, nothing else.
- `sandbox`: the CPU pool, or VRAM on a GPU lane served by its lane owner; never
  device visibility (the grant names no uuid for CUDA_VISIBLE_DEVICES).
- requirement `auto`: a GPU lane when one fits, else the CPU pool.
Pure: reads the ledger, changes nothing.
"""

from __future__ import annotations

from typing import Protocol

from machine.lanes import Isolation, Lane, LaneKind, Requirement
from machine.reservation import (
    LaneGrant,
    RefusalReason,
    ReservationRefused,
    ReservationRequest,
)

__all__ = ["LedgerView", "place"]


class LedgerView(Protocol):
    """What placement reads of the ledger (the ledger calls placement, not the reverse)."""

    def lanes(self) -> tuple[Lane, ...]: ...
    def lane(self, lane_id: str) -> Lane | None: ...
    def is_drained(self, lane_id: str) -> bool: ...
    def available(self, lane_id: str) -> bool: ...
    def holders(self, lane_id: str) -> int: ...
    def is_exclusive(self, lane_id: str) -> bool: ...
    def vram_free(self, lane_id: str) -> int: ...


_EXCLUSIVE = frozenset({Isolation.DEDICATED, Isolation.PARTITIONED})


def place(ledger: LedgerView, request: ReservationRequest) -> tuple[LaneGrant, ...]:
    if request.requirement is Requirement.CPU:
        return (_cpu_grant(ledger, request),)
    if request.requirement is Requirement.GPU:
        return _gpu_grants(ledger, request)
    try:
        return _gpu_grants(ledger, request)
    except ReservationRefused as gpu_refusal:
        if request.isolation in _EXCLUSIVE or request.lane_id is not None:
            raise  # the CPU pool cannot give what was asked for
        try:
            # VRAM is what the work needs *if* it runs on a GPU; on the CPU it needs none.
            return (_cpu_grant(ledger, request, ignore_vram=True),)
        except ReservationRefused:
            raise gpu_refusal from None


def _cpu_grant(
    ledger: LedgerView, request: ReservationRequest, *, ignore_vram: bool = False
) -> LaneGrant:
    cpu = next((lane for lane in ledger.lanes() if lane.kind is LaneKind.CPU), None)
    if cpu is None or (request.lane_id is not None and request.lane_id != cpu.lane_id):
        raise ReservationRefused(RefusalReason.NO_LANE, {"requirement": "cpu"})
    if request.isolation not in cpu.accepts:
        raise ReservationRefused(
            RefusalReason.ISOLATION_UNSUPPORTED,
            {"isolation": request.isolation.value, "lane_kind": "cpu"},
        )
    if request.vram_bytes and not ignore_vram:
        raise ReservationRefused(RefusalReason.INVALID_REQUEST, {"field": "vram_bytes"})
    if ledger.is_drained(cpu.lane_id):
        raise ReservationRefused(RefusalReason.LANE_DRAINED, {"lane_id": cpu.lane_id})
    if not ledger.available(cpu.lane_id):
        raise ReservationRefused(RefusalReason.LANE_UNHEALTHY, {"lane_id": cpu.lane_id})
    return LaneGrant(lane_id=cpu.lane_id, kind=cpu.kind, device_id=cpu.device_id, visible_uuid=None)


def _candidates(ledger: LedgerView, request: ReservationRequest) -> list[Lane]:
    iso = request.isolation
    if request.lane_id is not None:
        lane = ledger.lane(request.lane_id)
        if lane is None or not lane.is_gpu:
            raise ReservationRefused(RefusalReason.NO_LANE, {"lane_id": request.lane_id})
        if iso not in lane.accepts:
            raise ReservationRefused(
                RefusalReason.ISOLATION_UNSUPPORTED,
                {"isolation": iso.value, "lane_id": lane.lane_id},
            )
        lanes = [lane]
    else:
        lanes = [lane for lane in ledger.lanes() if lane.is_gpu and iso in lane.accepts]
    if not lanes:
        raise ReservationRefused(RefusalReason.NO_LANE, {"isolation": iso.value})
    undrained = [lane for lane in lanes if not ledger.is_drained(lane.lane_id)]
    if not undrained:
        raise ReservationRefused(RefusalReason.LANE_DRAINED, {"isolation": iso.value})
    usable = [lane for lane in undrained if ledger.available(lane.lane_id)]
    if len(usable) < min(request.gpus, len(undrained)) or not usable:
        raise ReservationRefused(
            RefusalReason.LANE_UNHEALTHY,
            {"isolation": iso.value, "usable": len(usable), "requested": request.gpus},
        )
    return usable


def _gpu_grants(ledger: LedgerView, request: ReservationRequest) -> tuple[LaneGrant, ...]:
    iso = request.isolation
    lanes = _candidates(ledger, request)
    exclusive = iso in _EXCLUSIVE
    if exclusive:
        open_lanes = [lane for lane in lanes if ledger.holders(lane.lane_id) == 0]
    else:
        open_lanes = [lane for lane in lanes if not ledger.is_exclusive(lane.lane_id)]
    if len(open_lanes) < request.gpus:
        raise ReservationRefused(
            RefusalReason.INSUFFICIENT_GPUS, {"requested": request.gpus, "free": len(open_lanes)}
        )
    fitting = [lane for lane in open_lanes if ledger.vram_free(lane.lane_id) >= request.vram_bytes]
    if len(fitting) < request.gpus:
        best = max((ledger.vram_free(lane.lane_id) for lane in open_lanes), default=0)
        raise ReservationRefused(
            RefusalReason.INSUFFICIENT_VRAM,
            {"requested": request.vram_bytes, "largest_allocatable": best},
        )
    # Best fit packs shared work tightly and keeps whole GPUs free for dedicated work;
    # ties break on lane id so placement is deterministic.
    fitting.sort(
        key=lambda lane: (
            ledger.holders(lane.lane_id) == 0,
            ledger.vram_free(lane.lane_id),
            lane.lane_id,
        )
    )
    chosen = fitting[: request.gpus]
    return tuple(
        LaneGrant(
            lane_id=lane.lane_id,
            kind=lane.kind,
            device_id=lane.device_id,
            visible_uuid=None if iso is Isolation.SANDBOX else lane.visible_uuid,
            vram_bytes=ledger.vram_free(lane.lane_id) if exclusive else request.vram_bytes,
            exclusive=exclusive,
        )
        for lane in chosen
    )
