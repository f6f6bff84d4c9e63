"""The capacity ledger: pure accounting of CPU, memory, GPUs and VRAM (no I/O).

Per resource: capacity, reserved (kept back for the system: reserved CPU
millis, reserved memory, VRAM headroom per lane plus the CUDA context of the
lane's own host), allocated (the sum of live reservations) and allocatable =
capacity - reserved - allocated, never negative. A lane that is unhealthy,
unknown, lost or drained adds nothing to allocatable. A request is granted all
or nothing; refusals carry a typed reason. Totals are kept incrementally so
reading capacity costs O(lanes), whatever the number of reservations.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from machine.health import ALLOCATABLE_STATES, HealthState
from machine.lanes import Lane, LaneKind
from machine.placement import place
from machine.reservation import (
    LaneGrant,
    RefusalReason,
    Reservation,
    ReservationRefused,
    ReservationRequest,
)

__all__ = [
    "CapacityView",
    "LaneGrant",
    "LaneUsage",
    "Ledger",
    "RefusalReason",
    "Reservation",
    "ReservationRefused",
    "ReservationRequest",
    "ResourceAmounts",
]


# From the best health to the worst: a MIG lane shows the worse of its GPU's and
# its instance's.
_SEVERITY = (
    HealthState.HEALTHY,
    HealthState.SUSPECT,
    HealthState.UNKNOWN,
    HealthState.UNHEALTHY,
    HealthState.LOST,
)


class ResourceAmounts(msgspec.Struct, frozen=True, kw_only=True):
    capacity: int
    reserved: int
    allocated: int
    allocatable: int


class LaneUsage(msgspec.Struct, frozen=True, kw_only=True):
    lane_id: str
    device_id: str
    vram: ResourceAmounts
    holders: int
    exclusive: bool
    available: bool  # healthy enough and not drained


class CapacityView(msgspec.Struct, frozen=True, kw_only=True):
    cpu_millis: ResourceAmounts
    memory_bytes: ResourceAmounts
    gpus: ResourceAmounts
    lanes: tuple[LaneUsage, ...]


def _amounts(capacity: int, reserved: int, allocated: int, usable: bool = True) -> ResourceAmounts:
    free = capacity - reserved - allocated if usable else 0
    return ResourceAmounts(
        capacity=capacity, reserved=reserved, allocated=allocated, allocatable=max(0, free)
    )


class Ledger:
    """Live reservations over a fixed set of lanes; every method is synchronous and pure."""

    def __init__(
        self,
        *,
        lanes: Iterable[Lane],
        cpu_capacity_millis: int,
        memory_capacity_bytes: int,
        reserved_cpu_millis: int = 0,
        reserved_memory_bytes: int = 0,
        vram_headroom_bytes: int = 0,
        device_health: Mapping[str, HealthState] | None = None,
    ) -> None:
        if min(reserved_cpu_millis, reserved_memory_bytes, vram_headroom_bytes) < 0:
            raise ValueError("reserved amounts must not be negative")
        self._lanes: dict[str, Lane] = {lane.lane_id: lane for lane in lanes}
        self.cpu_capacity = max(0, cpu_capacity_millis)
        self.memory_capacity = max(0, memory_capacity_bytes)
        self.cpu_reserved = min(reserved_cpu_millis, self.cpu_capacity)
        self.memory_reserved = min(reserved_memory_bytes, self.memory_capacity)
        self.vram_headroom = vram_headroom_bytes
        # Health by device (a GPU, or a MIG instance by its uuid), and each instance's
        # reasons while it is not healthy; a lane's health is derived from them.
        self._device_health: dict[str, HealthState] = dict(device_health or {})
        self._instance_reasons: dict[str, tuple[str, ...]] = {}
        self._health: dict[str, HealthState] = {}
        for lane in self._lanes.values():
            self._health[lane.lane_id] = self._derived_health(lane)
        self._drained: set[str] = set()
        # Lanes with a fault of their own that takes them out of allocatable.
        self._faulted: set[str] = set()
        # Each lane's faults of its own, by cause: (why, whether it stays allocatable).
        self._faults: dict[str, dict[str, tuple[str, bool]]] = {}
        self._reservations: dict[str, Reservation] = {}
        self._cpu_allocated = 0
        self._memory_allocated = 0
        self._vram_allocated = dict.fromkeys(self._lanes, 0)
        self._holders = dict.fromkeys(self._lanes, 0)
        self._exclusive: set[str] = set()
        # Device memory each lane's own host (its sentinel) holds for itself, as its
        # hello reported it: its CUDA context. Kept back with the headroom.
        self._host_reserved: dict[str, int] = {}

    # -- lanes: health and drain -------------------------------------------------
    def lanes(self) -> tuple[Lane, ...]:
        return tuple(self._lanes.values())

    def lane(self, lane_id: str) -> Lane | None:
        return self._lanes.get(lane_id)

    def set_device_health(
        self, device_id: str, state: HealthState, reasons: Iterable[str] = ()
    ) -> None:
        """Apply a device's health to its lanes. A GPU's reaches all its lanes (a MIG
        GPU's fault hits every instance); a MIG instance's (`device_id` its uuid) only
        its own lane, whose health is the worse of its GPU's and its instance's, and
        whose `lane_fault` names the instance's `reasons` while it is not healthy."""
        self._device_health[device_id] = state
        self._instance_reasons[device_id] = tuple(reasons)
        for lane in self._lanes.values():
            if lane.kind is not LaneKind.CPU and device_id in (lane.device_id, lane.visible_uuid):
                self._health[lane.lane_id] = self._derived_health(lane)

    def _derived_health(self, lane: Lane) -> HealthState:
        if lane.kind is LaneKind.CPU:
            return self._device_health.get(lane.device_id, HealthState.HEALTHY)
        gpu = self._device_health.get(lane.device_id, HealthState.UNKNOWN)
        if lane.kind is not LaneKind.MIG or lane.visible_uuid is None:
            return gpu
        instance = self._device_health.get(lane.visible_uuid, HealthState.HEALTHY)
        return max(gpu, instance, key=_SEVERITY.index)

    def _instance_problem(self, lane: Lane) -> str | None:
        """Why the lane's MIG instance (not its GPU) is not healthy, or None."""
        uuid = lane.visible_uuid
        if lane.kind is not LaneKind.MIG or uuid is None:
            return None
        if self._device_health.get(uuid, HealthState.HEALTHY) is HealthState.HEALTHY:
            return None
        return "; ".join(self._instance_reasons.get(uuid, ())) or None

    def lane_health(self, lane_id: str) -> HealthState:
        if lane_id in self._faulted:
            return HealthState.UNHEALTHY
        return self._health.get(lane_id, HealthState.UNKNOWN)

    def fault_lane(
        self,
        lane_id: str,
        reason: str = "lane_faulted",
        *,
        cause: str = "lane",
        allocatable: bool = False,
    ) -> None:
        """A fault of the lane's own (not its device's), from `cause`: the lane is
        shown unhealthy with `reason` and leaves allocatable, unless `allocatable`
        (the CPU pool, whose processes and builtins never use what faulted: its
        lane host). Each cause is cleared on its own."""
        self._require_lane(lane_id)
        self._faults.setdefault(lane_id, {})[cause] = (reason, allocatable)
        self._count_faults(lane_id)

    def clear_lane_fault(self, lane_id: str, cause: str | None = None) -> None:
        """Clear the fault from `cause` (every cause when None)."""
        self._require_lane(lane_id)
        faults = self._faults.get(lane_id, {})
        if cause is None:
            faults.clear()
        else:
            faults.pop(cause, None)
        self._count_faults(lane_id)

    def lane_health_shown(self, lane_id: str) -> HealthState:
        """The health a snapshot shows: `lane_health`, but unhealthy while the lane has
        a fault of its own even where it stays allocatable (the CPU pool, for its
        processes and builtins), so a scheduler sees its lane work is out."""
        return HealthState.UNHEALTHY if lane_id in self._faults else self.lane_health(lane_id)

    def lane_fault(self, lane_id: str) -> str | None:
        """Why the lane has a fault of its own, or None: the snapshot shows such a
        lane unhealthy with this reason, even where it stays allocatable. A MIG
        lane's instance that is not healthy (a fatal XID in that instance alone) is
        the lane's own too: its reasons are named here, its GPU's on the device."""
        faults = self._faults.get(lane_id)
        reasons = [reason for reason, _ in faults.values()] if faults else []
        lane = self._lanes.get(lane_id)
        instance = self._instance_problem(lane) if lane is not None else None
        if instance is not None:
            reasons.append(instance)
        return "; ".join(reasons) if reasons else None

    def _count_faults(self, lane_id: str) -> None:
        faults = self._faults.get(lane_id, {})
        if not faults:
            self._faults.pop(lane_id, None)
        if any(not allocatable for _, allocatable in faults.values()):
            self._faulted.add(lane_id)
        else:
            self._faulted.discard(lane_id)

    def drain(self, lane_id: str) -> None:
        self._require_lane(lane_id)
        self._drained.add(lane_id)

    def resume(self, lane_id: str) -> None:
        self._require_lane(lane_id)
        self._drained.discard(lane_id)

    def is_drained(self, lane_id: str) -> bool:
        return lane_id in self._drained

    def _require_lane(self, lane_id: str) -> Lane:
        lane = self._lanes.get(lane_id)
        if lane is None:
            raise ReservationRefused(RefusalReason.NO_LANE, {"lane_id": lane_id})
        return lane

    def _available(self, lane_id: str) -> bool:
        return (
            lane_id not in self._drained
            and lane_id not in self._faulted
            and self._health[lane_id] in ALLOCATABLE_STATES
        )

    def set_host_reserved(self, lane_id: str, nbytes: int) -> None:
        """The device memory the lane's own host holds for itself (its CUDA context,
        as its latest hello measured it; 0: none): reserved on the lane beside the
        headroom, so what is allocatable is what the device can still give."""
        self._require_lane(lane_id)
        if nbytes > 0:
            self._host_reserved[lane_id] = nbytes
        else:
            self._host_reserved.pop(lane_id, None)

    def host_reserved(self, lane_id: str) -> int:
        return self._host_reserved.get(lane_id, 0)

    def _vram_reserved(self, lane: Lane) -> int:
        kept = self.vram_headroom + self._host_reserved.get(lane.lane_id, 0)
        return min(kept, lane.vram_bytes)

    def _vram_free(self, lane: Lane) -> int:
        reserved = self._vram_reserved(lane)
        return max(0, lane.vram_bytes - reserved - self._vram_allocated[lane.lane_id])

    # -- reservations ------------------------------------------------------------
    def reservations(self) -> dict[str, Reservation]:
        return dict(self._reservations)

    def get(self, reservation_id: str) -> Reservation | None:
        return self._reservations.get(reservation_id)

    def __len__(self) -> int:
        return len(self._reservations)

    def reserve(self, request: ReservationRequest) -> Reservation:
        """Grant everything asked for, or raise ReservationRefused and change nothing."""
        if request.reservation_id in self._reservations:
            raise ReservationRefused(
                RefusalReason.DUPLICATE_RESERVATION, {"reservation_id": request.reservation_id}
            )
        if (
            min(request.cpu_millis, request.memory_bytes, request.vram_bytes) < 0
            or request.gpus < 1
        ):
            raise ReservationRefused(RefusalReason.INVALID_REQUEST, {"field": "amounts"})
        cpu_free = self.cpu_capacity - self.cpu_reserved - self._cpu_allocated
        if request.cpu_millis > cpu_free:
            raise ReservationRefused(
                RefusalReason.INSUFFICIENT_CPU,
                {"requested": request.cpu_millis, "allocatable": max(0, cpu_free)},
            )
        mem_free = self.memory_capacity - self.memory_reserved - self._memory_allocated
        if request.memory_bytes > mem_free:
            raise ReservationRefused(
                RefusalReason.INSUFFICIENT_MEMORY,
                {"requested": request.memory_bytes, "allocatable": max(0, mem_free)},
            )
        grants = place(self, request)
        reservation = Reservation(
            reservation_id=request.reservation_id,
            cpu_millis=request.cpu_millis,
            memory_bytes=request.memory_bytes,
            lanes=grants,
            isolation=request.isolation,
            requirement=request.requirement,
            request_digest=request.request_digest,
            standing=request.standing,
        )
        self._apply(reservation)
        return reservation

    def adopt(self, reservation: Reservation) -> None:
        """Take back a reservation recorded before a restart, as it was (no placement).

        It may exceed today's capacity (a device went away); allocatable clamps at 0.
        """
        if reservation.reservation_id in self._reservations:
            raise ReservationRefused(
                RefusalReason.DUPLICATE_RESERVATION,
                {"reservation_id": reservation.reservation_id},
            )
        self._apply(reservation)

    def release(self, reservation_id: str) -> Reservation | None:
        """Release by id; idempotent (a second release returns None and changes nothing)."""
        reservation = self._reservations.pop(reservation_id, None)
        if reservation is None:
            return None
        self._cpu_allocated -= reservation.cpu_millis
        self._memory_allocated -= reservation.memory_bytes
        for grant in reservation.lanes:
            if grant.lane_id in self._holders:
                self._vram_allocated[grant.lane_id] -= grant.vram_bytes
                self._holders[grant.lane_id] -= 1
                if grant.exclusive:
                    self._exclusive.discard(grant.lane_id)
        return reservation

    def _apply(self, reservation: Reservation) -> None:
        self._reservations[reservation.reservation_id] = reservation
        self._cpu_allocated += reservation.cpu_millis
        self._memory_allocated += reservation.memory_bytes
        for grant in reservation.lanes:
            # A lane that disappeared since the journal was written is not tracked.
            if grant.lane_id in self._holders:
                self._vram_allocated[grant.lane_id] += grant.vram_bytes
                self._holders[grant.lane_id] += 1
                if grant.exclusive:
                    self._exclusive.add(grant.lane_id)

    # -- reading -----------------------------------------------------------------
    def holders(self, lane_id: str) -> int:
        return self._holders.get(lane_id, 0)

    def is_exclusive(self, lane_id: str) -> bool:
        return lane_id in self._exclusive

    def vram_free(self, lane_id: str) -> int:
        return self._vram_free(self._lanes[lane_id])

    def available(self, lane_id: str) -> bool:
        return self._available(lane_id)

    def capacity(self) -> CapacityView:
        """Capacity, reserved, allocated and allocatable per resource, in O(lanes)."""
        usages = []
        gpu_total = gpu_busy = gpu_free = 0
        for lane in self._lanes.values():
            if lane.kind is LaneKind.CPU:
                continue
            lid = lane.lane_id
            available = self._available(lid)
            holders = self._holders[lid]
            usages.append(
                LaneUsage(
                    lane_id=lid,
                    device_id=lane.device_id,
                    vram=_amounts(
                        lane.vram_bytes,
                        self._vram_reserved(lane),
                        self._vram_allocated[lid],
                        available,
                    ),
                    holders=holders,
                    exclusive=lid in self._exclusive,
                    available=available,
                )
            )
            gpu_total += 1
            gpu_busy += 1 if holders else 0
            gpu_free += 1 if available and not holders else 0
        # `gpus` counts lanes: allocated = lanes with any holder; allocatable = wholly free.
        gpus = ResourceAmounts(
            capacity=gpu_total, reserved=0, allocated=gpu_busy, allocatable=gpu_free
        )
        return CapacityView(
            cpu_millis=_amounts(self.cpu_capacity, self.cpu_reserved, self._cpu_allocated),
            memory_bytes=_amounts(
                self.memory_capacity, self.memory_reserved, self._memory_allocated
            ),
            gpus=gpus,
            lanes=tuple(usages),
        )
