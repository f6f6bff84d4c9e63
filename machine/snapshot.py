"""The NodeSnapshot wire type and `build_snapshot`, which fills it in O(devices + lanes).

A versioned, immutable document (msgspec Structs: frozen, kw_only,
forbid_unknown_fields, snake_case). It carries ids, facts, health and
amounts only: never a credential, a token or a driver handle. Reservations
are not listed; the ledger keeps running totals, so the cost of a snapshot
does not grow with the number of reservations.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

import msgspec

from machine.health import HealthState, HealthTracker
from machine.inventory import (
    GpuDevice,
    Inventory,
    MemoryInfo,
    MigInstance,
    MigReading,
    Probe,
)
from machine.lanes import Isolation, Lane, LaneBackend, LaneKind
from machine.ledger import Ledger, ResourceAmounts

__all__ = [
    "SCHEMA_VERSION",
    "Amounts",
    "CapacitySection",
    "CpuSection",
    "DeviceSection",
    "HostBackedVram",
    "LaneSection",
    "MemorySection",
    "MigSection",
    "NodeSnapshot",
    "VramAmounts",
    "build_snapshot",
    "rfc3339",
]

SCHEMA_VERSION = 1


class _Wire(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class CpuSection(_Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    logical_cores: int
    physical_cores: int | None
    model: str
    numa_nodes: int | None
    cgroup_limit_millis: int | None


class MemorySection(_Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    total_bytes: int
    available_bytes: int
    cgroup_limit_bytes: int | None


class MigSection(_Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    mig_uuid: str
    profile: str
    memory_total_bytes: int
    # Fields added in schema 1 after its release carry defaults, so older documents decode.
    gpu_instance_id: int | None = None
    # From the latest good reading; absent when unsupported or unread.
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    utilization_gpu_percent: float | None = None
    utilization_memory_percent: float | None = None
    # The instance's own health (machine/health.py: its own XIDs, its GPU's resets);
    # its lane's health is the worse of this and its GPU's. Absent in older documents.
    health: HealthState | None = None
    health_reasons: tuple[str, ...] = ()


class DeviceSection(_Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    device_id: str
    kind: str = "gpu"
    model: str
    pci_bus_id: str | None
    memory_total_bytes: int
    memory_used_bytes: int | None
    compute_capability: str | None
    mig_enabled: bool
    mig_instances: tuple[MigSection, ...]
    health: HealthState
    health_reasons: tuple[str, ...]
    # Telemetry from the latest good reading; absent when unsupported or unread.
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_volatile_uncorrected: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    memory_free_bytes: int | None = None
    utilization_gpu_percent: float | None = None
    utilization_memory_percent: float | None = None
    sm_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None
    ecc_volatile_corrected: int | None = None
    ecc_aggregate_corrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    # Row remapping (Ampere and later): rows remapped for correctable and for
    # uncorrectable errors, and whether a remapping failed.
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_failed: bool | None = None
    # Energy consumed since the driver was loaded, in millijoules, and PCIe replays.
    total_energy_mj: int | None = None
    pcie_replay_count: int | None = None
    # XID events seen since the daemon started and the latest code (0: none yet);
    # absent when the driver cannot deliver XID events for this device.
    xid_errors: int | None = None
    last_xid: int | None = None
    # N of /dev/nvidiaN.
    minor_number: int | None = None


class HostBackedVram(_Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A simulated lane's VRAM is host memory. `granted_bytes` (the lane's `vram_bytes`)
    is less than `declared_bytes` (the sim file's) when the host cannot hold every
    simulated lane's declared size: the snapshot's notes then say by how much."""

    declared_bytes: int
    granted_bytes: int


class LaneSection(_Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    lane_id: str
    kind: LaneKind
    device_id: str
    mig_uuid: str | None
    accepts: tuple[Isolation, ...]
    health: HealthState
    drained: bool
    vram_bytes: int
    # Why the lane is unhealthy for a fault of its own (its lane host failed too
    # often), absent otherwise; the device's reasons are the device's.
    health_reason: str | None = None
    # Simulated GPU and MIG lanes only; absent for real devices and the CPU pool.
    host_backed_vram: HostBackedVram | None = None
    # Where the lane's work runs: `cupy` (CUDA, on a real GPU or MIG instance) or
    # `numpy` (host memory: the CPU pool, simulated lanes). A `cupy` lane never falls
    # back to host memory: without CUDA it is unhealthy with a `health_reason`
    # starting `cuda_unavailable:`. (Absent only in documents from before this field.)
    backend: LaneBackend | None = None


class Amounts(_Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    capacity: int
    reserved: int
    allocated: int
    allocatable: int


class VramAmounts(_Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    device_id: str
    lane_id: str
    capacity: int
    reserved: int
    allocated: int
    allocatable: int


class CapacitySection(_Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    cpu_millis: Amounts
    memory_bytes: Amounts
    gpus: Amounts
    vram_bytes: tuple[VramAmounts, ...]


class NodeSnapshot(_Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    schema_version: int
    node_id: str
    sequence: int
    observed_at: str  # RFC 3339, UTC
    backend: str
    driver_version: str | None
    cuda_version: str | None
    cpu: CpuSection
    memory: MemorySection
    devices: tuple[DeviceSection, ...]
    lanes: tuple[LaneSection, ...]
    capacity: CapacitySection
    readiness_reasons: tuple[str, ...]
    notes: tuple[str, ...] = ()
    # An operator drained the whole node: it admits no new work (running work goes on).
    drained: bool = False


def rfc3339(moment: datetime.datetime) -> str:
    """UTC, second precision with milliseconds, "Z" suffix."""
    utc = moment.astimezone(datetime.UTC)
    return utc.strftime("%Y-%m-%dT%H:%M:%S.") + f"{utc.microsecond // 1000:03d}Z"


def _amounts(a: ResourceAmounts) -> Amounts:
    return Amounts(
        capacity=a.capacity, reserved=a.reserved, allocated=a.allocated, allocatable=a.allocatable
    )


# Reading fields the snapshot carries under the same name, from the latest good probe.
_DEVICE_READINGS = (
    "temperature_c",
    "power_w",
    "ecc_volatile_uncorrected",
    "retired_pages_pending",
    "remapped_rows_pending",
    "memory_used_bytes",
    "memory_free_bytes",
    "utilization_gpu_percent",
    "utilization_memory_percent",
    "sm_clock_mhz",
    "memory_clock_mhz",
    "ecc_volatile_corrected",
    "ecc_aggregate_corrected",
    "ecc_aggregate_uncorrected",
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
    "remapped_rows_failed",
    "total_energy_mj",
    "pcie_replay_count",
    "last_xid",
)
_MIG_READINGS = (
    "memory_used_bytes",
    "memory_free_bytes",
    "utilization_gpu_percent",
    "utilization_memory_percent",
)


def _readings(reading: Probe | MigReading | None, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(reading, name) for name in names} if reading is not None else {}


def _mig(mig: MigInstance, reading: MigReading | None, health: HealthTracker) -> MigSection:
    h = health.health(mig.uuid)
    return MigSection(
        mig_uuid=mig.uuid,
        profile=mig.name,
        memory_total_bytes=mig.memory_total_bytes,
        gpu_instance_id=mig.gpu_instance_id,
        health=h.state,
        health_reasons=h.reasons,
        **{"memory_used_bytes": mig.memory_used_bytes, **_readings(reading, _MIG_READINGS)},
    )


def _device(gpu: GpuDevice, health: HealthTracker) -> DeviceSection:
    h = health.health(gpu.uuid)
    last = health.last_reading(gpu.uuid)
    migs = {m.uuid: m for m in last.mig} if last else {}
    # Until a probe reads memory, discovery's figures stand.
    found = {"memory_used_bytes": gpu.memory_used_bytes, "memory_free_bytes": gpu.memory_free_bytes}
    return DeviceSection(
        device_id=gpu.uuid,
        model=gpu.name,
        pci_bus_id=gpu.pci_bus_id,
        memory_total_bytes=gpu.memory_total_bytes,
        compute_capability=gpu.compute_capability,
        mig_enabled=gpu.mig_enabled,
        mig_instances=tuple(_mig(m, migs.get(m.uuid), health) for m in gpu.mig_instances),
        health=h.state,
        health_reasons=h.reasons,
        xid_errors=last.xid_count if last else None,
        minor_number=gpu.minor_number,
        **{**found, **_readings(last, _DEVICE_READINGS)},
    )


def _host_backed(lane: Lane) -> HostBackedVram | None:
    if lane.declared_vram_bytes is None:
        return None
    return HostBackedVram(declared_bytes=lane.declared_vram_bytes, granted_bytes=lane.vram_bytes)


def build_snapshot(
    *,
    node_id: str,
    sequence: int,
    inventory: Inventory,
    health: HealthTracker,
    ledger: Ledger,
    observed_at: datetime.datetime | None = None,
    readiness_reasons: Iterable[str] = (),
    notes: Iterable[str] = (),
    memory: MemoryInfo | None = None,
    drained: bool = False,
) -> NodeSnapshot:
    """Assemble a NodeSnapshot; extra `readiness_reasons` (e.g. journal recovery) are appended.
    `memory` is the latest host memory reading (discovery's when None)."""
    view = ledger.capacity()
    lanes = tuple(
        LaneSection(
            lane_id=lane.lane_id,
            kind=lane.kind,
            device_id=lane.device_id,
            mig_uuid=lane.visible_uuid if lane.kind is LaneKind.MIG else None,
            accepts=tuple(sorted(lane.accepts)),
            health=ledger.lane_health_shown(lane.lane_id),
            drained=ledger.is_drained(lane.lane_id),
            vram_bytes=lane.vram_bytes,
            health_reason=ledger.lane_fault(lane.lane_id),
            host_backed_vram=_host_backed(lane),
            backend=lane.array_backend,
        )
        for lane in ledger.lanes()
    )
    cpu, mem = inventory.cpu, memory or inventory.memory
    return NodeSnapshot(
        schema_version=SCHEMA_VERSION,
        node_id=node_id,
        sequence=sequence,
        observed_at=rfc3339(observed_at or datetime.datetime.now(datetime.UTC)),
        backend=inventory.backend,
        driver_version=inventory.driver_version,
        cuda_version=inventory.cuda_version,
        cpu=CpuSection(
            logical_cores=cpu.logical_cores,
            physical_cores=cpu.physical_cores,
            model=cpu.model,
            numa_nodes=cpu.numa_nodes,
            cgroup_limit_millis=cpu.cgroup_limit_millis,
        ),
        memory=MemorySection(
            total_bytes=mem.total_bytes,
            available_bytes=mem.available_bytes,
            cgroup_limit_bytes=mem.cgroup_limit_bytes,
        ),
        devices=tuple(_device(gpu, health) for gpu in inventory.gpus),
        lanes=lanes,
        capacity=CapacitySection(
            cpu_millis=_amounts(view.cpu_millis),
            memory_bytes=_amounts(view.memory_bytes),
            gpus=_amounts(view.gpus),
            vram_bytes=tuple(
                VramAmounts(
                    device_id=u.device_id,
                    lane_id=u.lane_id,
                    capacity=u.vram.capacity,
                    reserved=u.vram.reserved,
                    allocated=u.vram.allocated,
                    allocatable=u.vram.allocatable,
                )
                for u in view.lanes
            ),
        ),
        readiness_reasons=(*inventory.readiness_reasons, *readiness_reasons),
        notes=(*inventory.notes, *notes),
        drained=drained,
    )
