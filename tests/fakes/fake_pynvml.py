"""A fake `pynvml` module: the real module's API over plain data, for tests.

Tests build `FakeNvml([FakeGpu(...), ...])` and pass it as `pynvml_module`.
It answers as nvidia-ml-py does against a real driver, where that is known,
so a test cannot pass on behaviour the hardware never shows:

- errors are the real module's classes, built as it builds them
  (`pynvml.NVMLError(code)` picks the subclass), so `str()` is the driver's
  text ("GPU is lost") and they are unhashable; constants are the real ones;
- `nvmlInit`/`nvmlShutdown` are reference counted;
- a MIG instance's name is "<GPU name> MIG <profile>"; utilization is
  NotSupported on a MIG instance and on a GPU in MIG mode; power,
  temperature, energy, PCIe replays and remapped rows are NotSupported on a
  MIG instance (they are the GPU's);
- retired pages are NotSupported unless a test sets them (Ampere and later
  remap rows instead); the MIG mode is a list `[current, pending]`;
- `nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2)` answers with the
  v2 struct (`reserved` apart; v1 counts it in `used`);
- sensors, thresholds, clocks and ECC kinds outside the real constants are
  InvalidArgument;
- XID events arrive on the event sets their GPU is registered in, with
  `gpuInstanceId`/`computeInstanceId` 0xFFFFFFFF for a whole-GPU event and
  the instance's ids for a MIG instance's; a reset (`reset_gpu`) loses the
  registrations, as a real reset does.

Knobs, per GPU: `lost` (every call on it and its MIG instances raises
GpuIsLost), and for calls on its own handle `unsupported` (calls that raise
NotSupported), `failing` (calls that raise Unknown), `errors` (call -> any
NVML error code; "*" for every call), `delays` (call ->
seconds it takes), `hangs` (calls that block until `FakeNvml.release()`),
`mig_memory_refused` (memory info on the GPU in MIG mode needs privileges the
caller lacks: NoPermission). Per MIG instance: `gone` (destroyed: NotFound on
every call on its handle) and `errors`. On the module: `init_error`,
`events_supported`, `fail_wait(code, after=n)` (the event wait raises `code`
after n more events). Every call records its name and the thread it ran on.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pynvml

# The real classes, named here for tests that raise or catch them.
NVMLError = pynvml.NVMLError
NVMLError_Uninitialized = pynvml.NVMLError_Uninitialized
NVMLError_NotSupported = pynvml.NVMLError_NotSupported
NVMLError_NotFound = pynvml.NVMLError_NotFound
NVMLError_NoPermission = pynvml.NVMLError_NoPermission
NVMLError_Timeout = pynvml.NVMLError_Timeout
NVMLError_DriverNotLoaded = pynvml.NVMLError_DriverNotLoaded
NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
NVMLError_Unknown = pynvml.NVMLError_Unknown

# gpuInstanceId / computeInstanceId of an event that concerns the whole GPU.
GPU_SCOPE = 0xFFFFFFFF
# A hung call gives up after this long, so a test that forgets `release` ends.
HANG_LIMIT = 30.0
XID = pynvml.nvmlEventTypeXidCriticalError
SUPPORTED_EVENTS = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
)


def nvml_error(code: int) -> pynvml.NVMLError:
    """The exception the real module raises for an NVML return code."""
    return pynvml.NVMLError(code)


@dataclasses.dataclass(eq=False)
class FakeMig:
    uuid: str
    profile: str  # e.g. "3g.20gb": NVML names the instance "<GPU name> MIG <profile>"
    memory_total: int
    memory_used: int = 0
    gpu_instance_id: int = 1
    compute_instance_id: int = 0
    parent: FakeGpu | None = None
    # The instance was destroyed: calls on its handle raise NVMLError_NotFound.
    gone: bool = False
    # call -> NVML error code raised for this instance's handle only.
    errors: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False)
class FakeGpu:
    uuid: str
    name: str = "NVIDIA Fake A100 40GB"
    memory_total: int = 40 << 30
    memory_used: int = 1 << 30
    # Kept by the driver and firmware: v2 reports it apart, v1 counts it in `used`.
    memory_reserved: int = 0
    pci_bus_id: str = "00000000:01:00.0"
    compute_capability: tuple[int, int] = (8, 0)
    minor: int = 0
    mig_enabled: bool = False
    # The mode after the next reset; None: the current one.
    mig_pending: bool | None = None
    migs: list[FakeMig] = dataclasses.field(default_factory=list)
    mig_slots: int = 7
    # Aggregate memory info of a GPU in MIG mode needs privileges: NoPermission.
    mig_memory_refused: bool = False
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
    # None: NotSupported, as on Ampere and later (rows are remapped instead).
    retired_pending: int | None = None
    # (correctable, uncorrectable, pending, failure), as nvmlDeviceGetRemappedRows answers.
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    # Since the driver loaded; NVML counts it in millijoules (Volta and later).
    energy_mj: int = 5_000_000
    pcie_replays: int = 0
    lost: bool = False
    unsupported: set[str] = dataclasses.field(default_factory=set)
    failing: set[str] = dataclasses.field(default_factory=set)
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    delays: dict[str, float] = dataclasses.field(default_factory=dict)
    hangs: set[str] = dataclasses.field(default_factory=set)
    # Bumped by a reset: event registrations made before it are gone.
    generation: int = 0

    def __post_init__(self) -> None:
        for mig in self.migs:
            mig.parent = self


@dataclasses.dataclass
class _EventData:
    """c_nvmlEventData_t's fields (its `device` is a handle, so not the ctypes struct)."""

    device: Any
    eventType: int
    eventData: int
    gpuInstanceId: int = GPU_SCOPE
    computeInstanceId: int = GPU_SCOPE


@dataclasses.dataclass(eq=False)
class _EventSet:
    # (GPU, its generation when registered, event types)
    registered: list[tuple[FakeGpu, int, int]] = dataclasses.field(default_factory=list)
    queue: list[_EventData] = dataclasses.field(default_factory=list)
    freed: bool = False

    def holds(self, gpu: FakeGpu, types: int = XID) -> bool:
        return any(
            g is gpu and gen == gpu.generation and t & types for g, gen, t in self.registered
        )


@dataclasses.dataclass
class _WaitFault:
    code: int
    after: int
    gpu: FakeGpu | None


class FakeNvml:
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
        self.event_sets: list[_EventSet] = []
        self.shutdowns = 0
        self.threads: set[str] = set()
        self.calls: list[str] = []
        self._inits = 0
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._wait_faults: list[_WaitFault] = []

    def __getattr__(self, name: str) -> Any:
        """The real module's constants and exception classes (never its functions)."""
        value = getattr(pynvml, name)
        if name.startswith(("NVML_", "nvmlEventType", "nvmlMemory_v")) and isinstance(value, int):
            return value
        if isinstance(value, type) and issubclass(value, pynvml.NVMLError):
            return value
        raise AttributeError(name)

    # -- test controls -----------------------------------------------------------
    @property
    def initialised(self) -> bool:
        return self._inits > 0

    @initialised.setter
    def initialised(self, value: bool) -> None:
        """False: as if NVML were shut down underneath (every call is Uninitialized)."""
        self._inits = max(self._inits, 1) if value else 0

    def gpu(self, uuid: str) -> FakeGpu:
        return next(g for g in self.gpus if g.uuid == uuid)

    def push_xid(self, uuid: str, xid: int) -> int:
        """An XID on a GPU, or on a MIG instance (by its uuid: the event names its parent
        GPU and the instance's GPU and compute instance ids). Queued on every event set
        the GPU is registered in; returns how many (0: lost, as on real hardware)."""
        mig = next((m for g in self.gpus for m in g.migs if m.uuid == uuid), None)
        if mig is not None and mig.parent is not None:
            gpu, gi, ci = mig.parent, mig.gpu_instance_id, mig.compute_instance_id
        else:
            gpu, gi, ci = self.gpu(uuid), GPU_SCOPE, GPU_SCOPE
        with self._lock:
            sets = [s for s in self.event_sets if not s.freed and s.holds(gpu)]
            for event_set in sets:
                event_set.queue.append(_EventData(gpu, XID, xid, gi, ci))
        return len(sets)

    def fail_wait(self, code: int, *, after: int = 0, uuid: str | None = None) -> None:
        """The next event wait (on a set holding `uuid`'s GPU, when given) raises `code`
        once `after` more events have come out of it."""
        gpu = self.gpu(uuid) if uuid is not None else None
        with self._lock:
            self._wait_faults.append(_WaitFault(code, after, gpu))

    def reset_gpu(self, uuid: str) -> None:
        """A GPU reset: readable again, volatile ECC counts cleared, event registrations lost."""
        gpu = self.gpu(uuid)
        gpu.lost = False
        gpu.generation += 1
        gpu.ecc_uncorrected = gpu.ecc_corrected = 0

    def release(self) -> None:
        """Let every hung call (`hangs`) return."""
        self._released.set()

    # -- the machinery -----------------------------------------------------------
    def _enter(self, name: str, handle: Any = None) -> FakeGpu | None:
        self.threads.add(threading.current_thread().name)
        self.calls.append(name)
        if name != "nvmlInit" and self._inits == 0:
            raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)
        mig = handle if isinstance(handle, FakeMig) else None
        gpu = mig.parent if mig is not None else handle
        if not isinstance(gpu, FakeGpu):
            return None
        if name in gpu.hangs:
            self._released.wait(HANG_LIMIT)
        if name in gpu.delays:
            time.sleep(gpu.delays[name])
        if mig is not None:
            if mig.gone:
                raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
            if name in mig.errors:
                raise nvml_error(mig.errors[name])
        if gpu.lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if mig is not None:
            return gpu  # the GPU's own knobs below are for calls on its own handle
        code = gpu.errors.get(name, gpu.errors.get("*"))
        if code is not None:
            raise nvml_error(code)
        if name in gpu.unsupported:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if name in gpu.failing:
            raise nvml_error(pynvml.NVML_ERROR_UNKNOWN)
        return gpu

    @staticmethod
    def _gpu_only(handle: Any) -> None:
        if isinstance(handle, FakeMig):
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    # -- system ------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_error is not None:
            raise self.init_error
        self._inits += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self._inits -= 1
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
        if not 0 <= index < len(self.gpus):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        if gpu.lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        self._enter("nvmlDeviceGetHandleByUUID")
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                if gpu.lost:
                    raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
                return gpu
        raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)

    # -- device facts ------------------------------------------------------------
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        self._enter("nvmlDeviceGetUUID", handle)
        return str(handle.uuid)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        gpu = self._enter("nvmlDeviceGetName", handle)
        if isinstance(handle, FakeMig) and gpu is not None:
            return f"{gpu.name} MIG {handle.profile}"
        return str(handle.name)

    def nvmlDeviceGetPciInfo(self, handle: Any) -> pynvml.nvmlPciInfo_t:
        gpu = self._enter("nvmlDeviceGetPciInfo", handle)
        assert gpu is not None
        info = pynvml.nvmlPciInfo_t()
        info.busId = gpu.pci_bus_id.encode()
        return info

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        call = "nvmlDeviceGetMemoryInfo_v2" if version else "nvmlDeviceGetMemoryInfo"
        gpu = self._enter(call, handle)
        assert gpu is not None
        if version and version != pynvml.nvmlMemory_v2:
            raise nvml_error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if isinstance(handle, FakeMig):
            total, used, reserved = handle.memory_total, handle.memory_used, 0
        elif gpu.mig_enabled and gpu.mig_memory_refused:
            raise nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)
        else:
            total, used, reserved = gpu.memory_total, gpu.memory_used, gpu.memory_reserved
        free = total - used - reserved
        if not version:
            v1 = pynvml.c_nvmlMemory_t()
            v1.total, v1.free, v1.used = total, free, used + reserved
            return v1
        v2 = pynvml.c_nvmlMemory_v2_t()
        v2.version, v2.total, v2.reserved = version, total, reserved
        v2.free, v2.used = free, used
        return v2

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        gpu = self._enter("nvmlDeviceGetCudaComputeCapability", handle)
        assert gpu is not None
        return gpu.compute_capability

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        gpu = self._enter("nvmlDeviceGetMinorNumber", handle)
        assert gpu is not None
        return gpu.minor

    def nvmlDeviceGetAttributes(self, device: Any) -> pynvml.c_nvmlDeviceAttributes:
        gpu = self._enter("nvmlDeviceGetAttributes", device)
        assert gpu is not None
        attributes = pynvml.c_nvmlDeviceAttributes()
        total = device.memory_total
        attributes.memorySizeMB = total >> 20
        return attributes

    # -- MIG ---------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        gpu = self._enter("nvmlDeviceGetMigMode", device)
        assert gpu is not None
        current = gpu.mig_enabled
        pending = current if gpu.mig_pending is None else gpu.mig_pending
        mode = {True: pynvml.NVML_DEVICE_MIG_ENABLE, False: pynvml.NVML_DEVICE_MIG_DISABLE}
        return [mode[current], mode[pending]]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        gpu = self._enter("nvmlDeviceGetMaxMigDeviceCount", device)
        assert gpu is not None
        return gpu.mig_slots if gpu.mig_enabled else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> FakeMig:
        gpu = self._enter("nvmlDeviceGetMigDeviceHandleByIndex", device)
        assert gpu is not None
        if not gpu.mig_enabled or not 0 <= index < gpu.mig_slots:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        # Occupied slots first, the rest empty (NVML raises NotFound for an empty slot).
        if index < len(gpu.migs):
            return gpu.migs[index]
        raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> int:
        self._enter("nvmlDeviceIsMigDeviceHandle", device)
        return int(isinstance(device, FakeMig))

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> FakeGpu:
        gpu = self._enter("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", migDevice)
        if not isinstance(migDevice, FakeMig) or gpu is None:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu

    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        self._enter("nvmlDeviceGetGpuInstanceId", device)
        if not isinstance(device, FakeMig):
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return device.gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        self._enter("nvmlDeviceGetComputeInstanceId", device)
        if not isinstance(device, FakeMig):
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return device.compute_instance_id

    # -- readings ----------------------------------------------------------------
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        gpu = self._enter("nvmlDeviceGetTemperature", handle)
        assert gpu is not None
        self._gpu_only(handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temperature

    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: int) -> int:
        gpu = self._enter("nvmlDeviceGetTemperatureThreshold", handle)
        assert gpu is not None
        self._gpu_only(handle)
        if threshold == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
            return gpu.slowdown_temperature
        if threshold == pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN:
            return gpu.slowdown_temperature + 5
        raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        gpu = self._enter("nvmlDeviceGetPowerUsage", handle)
        assert gpu is not None
        self._gpu_only(handle)
        return gpu.power_mw

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        gpu = self._enter("nvmlDeviceGetTotalEccErrors", handle)
        assert gpu is not None
        kinds = (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
        counters = (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC)
        if errorType not in kinds or counterType not in counters:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        volatile = counterType == pynvml.NVML_VOLATILE_ECC
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return gpu.ecc_uncorrected if volatile else gpu.ecc_aggregate_uncorrected
        return gpu.ecc_corrected if volatile else gpu.ecc_aggregate_corrected

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> pynvml.c_nvmlUtilization_t:
        gpu = self._enter("nvmlDeviceGetUtilizationRates", handle)
        assert gpu is not None
        if isinstance(handle, FakeMig) or gpu.mig_enabled:
            # NVML has no utilization for a MIG instance, nor for a GPU in MIG mode.
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        rates = pynvml.c_nvmlUtilization_t()
        rates.gpu, rates.memory = gpu.utilization_gpu, gpu.utilization_memory
        return rates

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:  # `type`: the real name
        gpu = self._enter("nvmlDeviceGetClockInfo", handle)
        assert gpu is not None
        if type == pynvml.NVML_CLOCK_MEM:
            return gpu.mem_clock
        if type in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS, pynvml.NVML_CLOCK_VIDEO):
            return gpu.sm_clock
        raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        gpu = self._enter("nvmlDeviceGetRetiredPagesPendingStatus", device)
        assert gpu is not None
        if gpu.retired_pending is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.retired_pending

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        gpu = self._enter("nvmlDeviceGetRemappedRows", device)
        assert gpu is not None
        self._gpu_only(device)
        return gpu.remapped_rows

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        gpu = self._enter("nvmlDeviceGetTotalEnergyConsumption", handle)
        assert gpu is not None
        self._gpu_only(handle)
        return gpu.energy_mj

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        gpu = self._enter("nvmlDeviceGetPcieReplayCounter", handle)
        assert gpu is not None
        self._gpu_only(handle)
        return gpu.pcie_replays

    # -- events ------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> _EventSet:
        self._enter("nvmlEventSetCreate")
        if not self.events_supported:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        event_set = _EventSet()
        with self._lock:
            self.event_sets.append(event_set)
        return event_set

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetSupportedEventTypes", handle)
        self._gpu_only(handle)
        return SUPPORTED_EVENTS

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: _EventSet) -> None:
        gpu = self._enter("nvmlDeviceRegisterEvents", handle)
        assert gpu is not None
        self._gpu_only(handle)
        if eventSet.freed or eventTypes & ~SUPPORTED_EVENTS:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            eventSet.registered.append((gpu, gpu.generation, eventTypes))

    def nvmlEventSetWait_v2(self, eventSet: _EventSet, timeoutms: int) -> _EventData:
        self._enter("nvmlEventSetWait_v2")
        with self._lock:
            if eventSet.freed:
                raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            fault = next(
                (
                    f
                    for f in self._wait_faults
                    if f.gpu is None or any(g is f.gpu for g, _, _ in eventSet.registered)
                ),
                None,
            )
            if fault is not None and fault.after <= 0:
                self._wait_faults.remove(fault)
                raise nvml_error(fault.code)
            if not eventSet.queue:
                raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)
            if fault is not None:
                fault.after -= 1
            return eventSet.queue.pop(0)

    def nvmlEventSetFree(self, eventSet: _EventSet) -> None:
        self._enter("nvmlEventSetFree")
        with self._lock:
            if eventSet.freed:
                raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            eventSet.freed = True


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
