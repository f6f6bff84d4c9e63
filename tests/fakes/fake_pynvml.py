"""A fake `pynvml` module: the subset machine.discovery_nvml uses, driven by plain data.

Tests build `FakeNvml([FakeGpu(...), ...])` and pass it as `pynvml_module`.
A GPU can be marked lost (every call raises NVMLError_GpuIsLost), have fields
that raise NVMLError_NotSupported or NVMLError_Unknown, and XID events can be
queued on the event set. Every call records the thread it ran on.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any


class NVMLError(Exception):
    value = 999

    def __str__(self) -> str:
        return type(self).__name__


class NVMLError_Uninitialized(NVMLError):
    value = 1


class NVMLError_NotSupported(NVMLError):
    value = 3


class NVMLError_NotFound(NVMLError):
    value = 6


class NVMLError_Timeout(NVMLError):
    value = 10


class NVMLError_DriverNotLoaded(NVMLError):
    value = 9


class NVMLError_LibraryNotFound(NVMLError):
    value = 12


class NVMLError_GpuIsLost(NVMLError):
    value = 15


class NVMLError_Unknown(NVMLError):
    value = 999


@dataclasses.dataclass
class FakeMig:
    uuid: str
    name: str
    memory_total: int
    memory_used: int = 0
    gpu_instance_id: int = 1
    compute_instance_id: int = 0
    parent: FakeGpu | None = None
    # The instance was destroyed: calls on its handle raise NVMLError_NotFound.
    gone: bool = False


@dataclasses.dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA Fake A100 40GB"
    memory_total: int = 40 << 30
    memory_used: int = 1 << 30
    pci_bus_id: str = "00000000:01:00.0"
    compute_capability: tuple[int, int] = (8, 0)
    minor: int = 0
    mig_enabled: bool = False
    migs: list[FakeMig] = dataclasses.field(default_factory=list)
    mig_slots: int = 7
    temperature: int = 40
    slowdown_temperature: int = 90
    power_mw: int = 70_000
    utilization_gpu: int = 35
    utilization_memory: int = 20
    sm_clock: int = 1410
    mem_clock: int = 1215
    ecc_uncorrected: int = 0
    ecc_corrected: int = 0
    ecc_aggregate_uncorrected: int = 0
    ecc_aggregate_corrected: int = 0
    retired_pending: int = 0
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    lost: bool = False
    unsupported: set[str] = dataclasses.field(default_factory=set)
    failing: set[str] = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        for mig in self.migs:
            mig.parent = self


@dataclasses.dataclass
class _Memory:
    total: int
    used: int
    free: int


@dataclasses.dataclass
class _Pci:
    busId: str


@dataclasses.dataclass
class _Utilization:
    gpu: int
    memory: int


@dataclasses.dataclass
class _EventData:
    device: Any
    eventType: int
    eventData: int
    gpuInstanceId: int = 0
    computeInstanceId: int = 0


class FakeNvml:
    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_Timeout = NVMLError_Timeout
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_Unknown = NVMLError_Unknown
    NVMLError_Uninitialized = NVMLError_Uninitialized

    NVML_TEMPERATURE_GPU = 0
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_AGGREGATE_ECC = 1
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_DEVICE_MIG_DISABLE = 0
    NVML_FEATURE_ENABLED = 1
    nvmlEventTypeXidCriticalError = 8
    nvmlEventTypeDoubleBitEccError = 2

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        init_error: Exception | None = None,
        driver_version: str = "550.54.15",
        cuda_version: int = 12040,
        events_supported: bool = True,
    ) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.driver_version = driver_version
        self.cuda_version = cuda_version
        self.events_supported = events_supported
        self.events: list[_EventData] = []
        self.initialised = False
        self.shutdowns = 0
        self.threads: set[str] = set()
        self.calls: list[str] = []

    # -- test controls -----------------------------------------------------------
    def push_xid(self, uuid: str, xid: int) -> None:
        gpu = next(g for g in self.gpus if g.uuid == uuid)
        self.events.append(_EventData(gpu, self.nvmlEventTypeXidCriticalError, xid))

    def _enter(self, name: str, handle: Any = None) -> FakeGpu | None:
        self.threads.add(threading.current_thread().name)
        self.calls.append(name)
        if name != "nvmlInit" and not self.initialised:
            raise NVMLError_Uninitialized()
        if isinstance(handle, FakeMig) and handle.gone:
            raise NVMLError_NotFound()
        gpu = handle.parent if isinstance(handle, FakeMig) else handle
        if isinstance(gpu, FakeGpu):
            if gpu.lost:
                raise NVMLError_GpuIsLost()
            if name in gpu.unsupported:
                raise NVMLError_NotSupported()
            if name in gpu.failing:
                raise NVMLError_Unknown()
            return gpu
        return None

    # -- system ------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_error is not None:
            raise self.init_error
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialised = False
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.cuda_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._enter("nvmlDeviceGetHandleByIndex")
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        self._enter("nvmlDeviceGetHandleByUUID")
        for gpu in self.gpus:
            if gpu.uuid == uuid and not gpu.lost:
                return gpu
        raise NVMLError_NotFound()

    # -- device ------------------------------------------------------------------
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        self._enter("nvmlDeviceGetUUID", handle)
        return str(handle.uuid)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        self._enter("nvmlDeviceGetName", handle)
        return str(handle.name)

    def nvmlDeviceGetPciInfo(self, handle: FakeGpu) -> _Pci:
        self._enter("nvmlDeviceGetPciInfo", handle)
        return _Pci(busId=handle.pci_bus_id)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> _Memory:
        self._enter("nvmlDeviceGetMemoryInfo", handle)
        total, used = handle.memory_total, handle.memory_used
        return _Memory(total=total, used=used, free=total - used)

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeGpu) -> tuple[int, int]:
        self._enter("nvmlDeviceGetCudaComputeCapability", handle)
        return handle.compute_capability

    def nvmlDeviceGetMinorNumber(self, handle: FakeGpu) -> int:
        self._enter("nvmlDeviceGetMinorNumber", handle)
        return handle.minor

    def nvmlDeviceGetMigMode(self, handle: FakeGpu) -> tuple[int, int]:
        self._enter("nvmlDeviceGetMigMode", handle)
        mode = self.NVML_DEVICE_MIG_ENABLE if handle.mig_enabled else self.NVML_DEVICE_MIG_DISABLE
        return mode, mode

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeGpu) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount", handle)
        return handle.mig_slots

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeGpu, index: int) -> FakeMig:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        # Occupied slots first, the rest empty (NVML raises NotFound for an empty slot).
        if index < len(handle.migs):
            return handle.migs[index]
        raise NVMLError_NotFound()

    def nvmlDeviceGetGpuInstanceId(self, handle: FakeMig) -> int:
        self._enter("nvmlDeviceGetGpuInstanceId", handle)
        return handle.gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, handle: FakeMig) -> int:
        self._enter("nvmlDeviceGetComputeInstanceId", handle)
        return handle.compute_instance_id

    def nvmlDeviceGetTemperature(self, handle: FakeGpu, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperature", handle)
        return handle.temperature

    def nvmlDeviceGetTemperatureThreshold(self, handle: FakeGpu, kind: int) -> int:
        self._enter("nvmlDeviceGetTemperatureThreshold", handle)
        return handle.slowdown_temperature

    def nvmlDeviceGetPowerUsage(self, handle: FakeGpu) -> int:
        self._enter("nvmlDeviceGetPowerUsage", handle)
        return handle.power_mw

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeGpu, kind: int, counter: int) -> int:
        self._enter("nvmlDeviceGetTotalEccErrors", handle)
        if kind == self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            volatile = counter == self.NVML_VOLATILE_ECC
            return handle.ecc_uncorrected if volatile else handle.ecc_aggregate_uncorrected
        if counter == self.NVML_VOLATILE_ECC:
            return handle.ecc_corrected
        return handle.ecc_aggregate_corrected

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> _Utilization:
        self._enter("nvmlDeviceGetUtilizationRates", handle)
        if isinstance(handle, FakeMig):
            raise NVMLError_NotSupported()  # as NVML answers for a MIG instance
        return _Utilization(gpu=handle.utilization_gpu, memory=handle.utilization_memory)

    def nvmlDeviceGetClockInfo(self, handle: FakeGpu, clock: int) -> int:
        self._enter("nvmlDeviceGetClockInfo", handle)
        return handle.sm_clock if clock == self.NVML_CLOCK_SM else handle.mem_clock

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: FakeGpu) -> int:
        self._enter("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        return handle.retired_pending

    def nvmlDeviceGetRemappedRows(self, handle: FakeGpu) -> tuple[int, int, int, int]:
        self._enter("nvmlDeviceGetRemappedRows", handle)
        return handle.remapped_rows

    # -- events ------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> str:
        self._enter("nvmlEventSetCreate")
        if not self.events_supported:
            raise NVMLError_NotSupported()
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: FakeGpu, types: int, event_set: str) -> None:
        self._enter("nvmlDeviceRegisterEvents", handle)

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> _EventData:
        self._enter("nvmlEventSetWait_v2")
        if not self.events:
            raise NVMLError_Timeout()
        return self.events.pop(0)

    def nvmlEventSetFree(self, event_set: str) -> None:
        self._enter("nvmlEventSetFree")


def gpu_and_mig(**gpu_a: Any) -> FakeNvml:
    """GPU-a (80 GiB, 1 GiB used; `gpu_a` overrides its fields) and GPU-b in MIG mode
    with MIG-b1 (3g.20gb, GPU instance 2, 3 GiB used) and MIG-b2 (1g.5gb, instance 9)."""
    gib = 1 << 30
    fields = {"name": "NVIDIA A100 80GB", "memory_total": 80 * gib, "memory_used": gib, **gpu_a}
    migs = [
        FakeMig("MIG-b1", "3g.20gb", 20 * gib, memory_used=3 * gib, gpu_instance_id=2),
        FakeMig("MIG-b2", "1g.5gb", 5 * gib, gpu_instance_id=9),
    ]
    b = FakeGpu(uuid="GPU-b", pci_bus_id="00000000:02:00.0", minor=1, mig_enabled=True, migs=migs)
    return FakeNvml([FakeGpu(uuid="GPU-a", **fields), b])
