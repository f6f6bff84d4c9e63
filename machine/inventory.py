"""What discovery found on this machine, as plain immutable data.

Every discovery backend (psutil host facts, NVML, the simulator) produces these
types; nothing here does I/O. Device readings taken after discovery arrive as
`Probe`s through a `DeviceSource`, which the health tracker classifies.

The types are internal (not wire types): `machine.snapshot` turns them into the
NodeSnapshot. They never hold a driver handle; NVML handles stay inside the
NVML backend.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol

import msgspec

__all__ = [
    "CpuInfo",
    "DeviceSource",
    "GpuDevice",
    "Inventory",
    "MemoryInfo",
    "MigInstance",
    "MigReading",
    "Probe",
    "ProbeStatus",
]


class CpuInfo(msgspec.Struct, frozen=True, kw_only=True):
    """CPU facts; `capacity_millis` is already the smaller of host and cgroup."""

    logical_cores: int
    physical_cores: int | None
    model: str
    numa_nodes: int | None
    capacity_millis: int
    # The cgroup v2 quota in millis when one applies (cpu.max), else None.
    cgroup_limit_millis: int | None = None


class MemoryInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Memory facts; `available_bytes` is the kernel's MemAvailable (cache is not "used")."""

    total_bytes: int
    available_bytes: int
    capacity_bytes: int
    cgroup_limit_bytes: int | None = None


class MigInstance(msgspec.Struct, frozen=True, kw_only=True):
    uuid: str
    # The profile, as dcgm-exporter's GPU_I_PROFILE names it ("1g.18gb"; NVML's
    # own name for the instance is "<GPU name> MIG 1g.18gb").
    name: str
    memory_total_bytes: int
    memory_used_bytes: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


class GpuDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One physical GPU. Fields the device does not support are None."""

    uuid: str
    name: str
    pci_bus_id: str | None
    memory_total_bytes: int
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    compute_capability: str | None = None
    mig_enabled: bool = False
    mig_instances: tuple[MigInstance, ...] = ()
    # N of the device node /dev/nvidiaN (NVML's minor number; the index when simulated).
    minor_number: int | None = None


class MigReading(msgspec.Struct, frozen=True, kw_only=True):
    """One reading of one MIG instance; None where the driver does not say."""

    uuid: str
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    utilization_gpu_percent: float | None = None
    utilization_memory_percent: float | None = None
    # XID codes the driver attributed to this instance since the previous probe
    # (its GPU and compute instance ids); XIDs for the whole GPU are the Probe's.
    xids: tuple[int, ...] = ()


class ProbeStatus(enum.StrEnum):
    OK = "ok"
    # The reading failed: the device's state is not known (never "healthy").
    FAILED = "failed"
    # The driver says the device is gone (fell off the bus, GPU is lost).
    LOST = "lost"


class Probe(msgspec.Struct, frozen=True, kw_only=True):
    """One reading of one device's telemetry. A field the device does not support
    (NVMLError_NotSupported) is None: absent, never a made-up zero."""

    device_id: str
    status: ProbeStatus
    error: str | None = None
    # XID codes seen since the previous probe, in arrival order.
    xids: tuple[int, ...] = ()
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_volatile_uncorrected: int | None = None
    retired_pages_pending: bool | None = None
    # A row remapping is pending (a reset applies it) or has failed.
    remapped_rows_pending: bool | None = None
    # A row remapping failed: permanent, the GPU needs service.
    remapped_rows_failed: bool | None = None
    # Rows remapped for correctable and for uncorrectable memory errors (Ampere and later).
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    utilization_gpu_percent: float | None = None
    utilization_memory_percent: float | None = None
    sm_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None
    ecc_volatile_corrected: int | None = None
    ecc_aggregate_corrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    # Energy the GPU consumed since the driver was loaded, in millijoules (Volta and later).
    total_energy_mj: int | None = None
    # PCIe replays (link-level retries) since the driver was loaded.
    pcie_replay_count: int | None = None
    # XID events seen since the source opened, and the code of the latest one;
    # None when the backend cannot deliver XID events for this device.
    xid_count: int | None = None
    last_xid: int | None = None
    mig: tuple[MigReading, ...] = ()
    # Set by a backend that knows its own threshold (the simulator, NVML slowdown temp).
    over_temperature: bool = False
    # The backend saw the device reset since the previous probe (the simulator's
    # `reset` event). NVML has no such reading; health infers a reset from the
    # volatile ECC count going down or from a lost device coming back.
    reset: bool = False
    # Fields the driver refused to read (an error other than NotSupported), each
    # "field: the driver's reason"; those fields are None, the rest were read.
    unread: tuple[str, ...] = ()


class DeviceSource(Protocol):
    """Where fresh device readings come from after discovery."""

    async def probe(self) -> list[Probe]:
        """One reading per discovered device; never raises for a device fault."""
        ...

    async def rediscover(self) -> set[str]:
        """Device ids that are visible and readable again (to bring back lost devices)."""
        ...

    async def aclose(self) -> None: ...


class Inventory(msgspec.Struct, frozen=True, kw_only=True):
    """The result of one discovery: host facts, GPUs, and why it may be incomplete."""

    backend: str  # "nvml", "sim" or "none"
    cpu: CpuInfo
    memory: MemoryInfo
    gpus: tuple[GpuDevice, ...] = ()
    driver_version: str | None = None
    cuda_version: str | None = None
    readiness_reasons: tuple[str, ...] = ()
    # Observations that do not block readiness (e.g. XID events unsupported on a device).
    notes: tuple[str, ...] = ()
    # First reading of each GPU, taken during discovery; seeds the health tracker.
    probes: tuple[Probe, ...] = ()
    # Not serialised: the live source of later readings (None without devices).
    source: DeviceSource | None = None
    # Not serialised: reads host memory afresh (each health probe calls it).
    host_memory: Callable[[], MemoryInfo] | None = None
    # Simulated devices: their VRAM is host memory, and all lanes together may
    # hold at most this much (machine/sim_vram.py). None: devices hold their own.
    vram_limit_bytes: int | None = None

    def gpu(self, device_id: str) -> GpuDevice | None:
        for gpu in self.gpus:
            if gpu.uuid == device_id:
                return gpu
        return None
