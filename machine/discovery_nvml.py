"""NVIDIA GPUs through NVML (the `pynvml` module of nvidia-ml-py).

Every NVML call runs in a worker thread (`trio.to_thread.run_sync`, one at a
time through a CapacityLimiter of 1, `abandon_on_cancel=True`) under a
deadline: a hung driver cannot stall the event loop, and a reading that times
out makes its devices `failed` (health `unknown`), never healthy. Fields a
device does not support (NVMLError_NotSupported) are None, each on its own:
one unsupported field never hides the others. NVML missing or
failing to initialise is reported as `NvmlUnavailable`, which discovery turns
into "no GPU lanes" plus a readiness reason. The module is a parameter so
tests pass a fake.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import trio

from machine.inventory import GpuDevice, MigInstance, MigReading, Probe, ProbeStatus

__all__ = ["NvmlSource", "NvmlUnavailable", "open_nvml"]

T = TypeVar("T")
# Bound the work one probe does on a storm of events; the rest wait for the next probe.
MAX_EVENTS_PER_PROBE = 64


class NvmlUnavailable(Exception):
    """NVML could not be loaded or initialised (a local condition, not a device fault)."""


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class _Sync:
    """The blocking half: plain NVML calls, run only inside the worker thread."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.handles: dict[str, Any] = {}
        # MIG instance handles of each GPU in MIG mode, by GPU uuid: [(mig uuid, handle)].
        self.mig_handles: dict[str, list[tuple[str, Any]]] = {}
        self.slowdown_c: dict[str, float | None] = {}
        self.event_set: Any = None
        # GPUs registered for XID events; counts and last code since NVML opened.
        self.xid_devices: set[str] = set()
        self.xid_count: dict[str, int] = {}
        self.last_xid: dict[str, int] = {}

    def opt(self, fn: Callable[..., T], *args: Any) -> T | None:
        """Call `fn`; None when the device does not support it."""
        try:
            return fn(*args)
        except self.nvml.NVMLError_NotSupported:
            return None

    def init(self) -> tuple[list[GpuDevice], str | None, str | None, list[str]]:
        nv = self.nvml
        nv.nvmlInit()
        driver = self.opt(nv.nvmlSystemGetDriverVersion)
        cuda_raw = self.opt(nv.nvmlSystemGetCudaDriverVersion)
        cuda = f"{cuda_raw // 1000}.{cuda_raw % 1000 // 10}" if cuda_raw else None
        notes: list[str] = []
        try:
            self.event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            notes.append(f"nvml_events_unavailable: {exc}")
        gpus = []
        for index in range(nv.nvmlDeviceGetCount()):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nv.nvmlDeviceGetUUID(handle))
            except nv.NVMLError as exc:
                notes.append(f"gpu_unreadable: index {index}: {exc}")
                continue
            self.handles[uuid] = handle
            gpus.append(self.describe(uuid, handle))
            if self.event_set is not None:
                try:
                    nv.nvmlDeviceRegisterEvents(
                        handle, nv.nvmlEventTypeXidCriticalError, self.event_set
                    )
                except nv.NVMLError as exc:
                    notes.append(f"xid_events_unavailable: {uuid}: {exc}")
                else:
                    self.xid_devices.add(uuid)
        return gpus, _text(driver) if driver is not None else None, cuda, notes

    def describe(self, uuid: str, handle: Any) -> GpuDevice:
        nv = self.nvml
        try:
            name = _text(nv.nvmlDeviceGetName(handle))
            pci = self.opt(nv.nvmlDeviceGetPciInfo, handle)
            mem = nv.nvmlDeviceGetMemoryInfo(handle)
            cc = self.opt(nv.nvmlDeviceGetCudaComputeCapability, handle)
            mig_mode = self.opt(nv.nvmlDeviceGetMigMode, handle)
            self.slowdown_c[uuid] = self.opt(
                nv.nvmlDeviceGetTemperatureThreshold, handle, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
            )
        except nv.NVMLError:
            # Known by uuid but unreadable: listed with no capacity; its probe says why.
            return GpuDevice(uuid=uuid, name="unknown", pci_bus_id=None, memory_total_bytes=0)
        mig_enabled = mig_mode is not None and mig_mode[0] == nv.NVML_DEVICE_MIG_ENABLE
        return GpuDevice(
            uuid=uuid,
            name=name,
            pci_bus_id=_text(pci.busId) if pci is not None else None,
            memory_total_bytes=int(mem.total),
            memory_used_bytes=int(mem.used),
            memory_free_bytes=int(mem.free),
            compute_capability=f"{cc[0]}.{cc[1]}" if cc is not None else None,
            mig_enabled=mig_enabled,
            mig_instances=self.mig_instances(uuid, handle) if mig_enabled else (),
            minor_number=self.opt(nv.nvmlDeviceGetMinorNumber, handle),
        )

    def mig_instances(self, uuid: str, handle: Any) -> tuple[MigInstance, ...]:
        nv = self.nvml
        found = []
        handles = self.mig_handles[uuid] = []
        for index in range(nv.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
            except nv.NVMLError_NotFound:
                continue  # an empty slot
            mem = nv.nvmlDeviceGetMemoryInfo(mig)
            handles.append((_text(nv.nvmlDeviceGetUUID(mig)), mig))
            found.append(
                MigInstance(
                    uuid=_text(nv.nvmlDeviceGetUUID(mig)),
                    name=_text(self.opt(nv.nvmlDeviceGetName, mig) or "mig"),
                    memory_total_bytes=int(mem.total),
                    memory_used_bytes=int(mem.used),
                    gpu_instance_id=self.opt(nv.nvmlDeviceGetGpuInstanceId, mig),
                    compute_instance_id=self.opt(nv.nvmlDeviceGetComputeInstanceId, mig),
                )
            )
        return tuple(found)

    def drain_xids(self) -> dict[str, list[int]]:
        nv = self.nvml
        xids: dict[str, list[int]] = {}
        if self.event_set is None:
            return xids
        for _ in range(MAX_EVENTS_PER_PROBE):
            try:
                data = nv.nvmlEventSetWait_v2(self.event_set, 0)
            except nv.NVMLError_Timeout:
                break
            if not data.eventType & nv.nvmlEventTypeXidCriticalError:
                continue
            try:
                uuid = _text(nv.nvmlDeviceGetUUID(data.device))
            except nv.NVMLError:
                continue
            xids.setdefault(uuid, []).append(int(data.eventData))
            self.xid_count[uuid] = self.xid_count.get(uuid, 0) + 1
            self.last_xid[uuid] = int(data.eventData)
        return xids

    def ecc(self, handle: Any, kind: int, counter: int) -> int | None:
        count = self.opt(self.nvml.nvmlDeviceGetTotalEccErrors, handle, kind, counter)
        return int(count) if count is not None else None

    def memory(self, handle: Any) -> tuple[int | None, int | None]:
        mem = self.opt(self.nvml.nvmlDeviceGetMemoryInfo, handle)
        return (int(mem.used), int(mem.free)) if mem is not None else (None, None)

    def utilization(self, handle: Any) -> tuple[float | None, float | None]:
        rates = self.opt(self.nvml.nvmlDeviceGetUtilizationRates, handle)
        return (float(rates.gpu), float(rates.memory)) if rates is not None else (None, None)

    def mig_reading(self, uuid: str, handle: Any) -> MigReading:
        nv = self.nvml
        try:
            used, free = self.memory(handle)
            util_gpu, util_memory = self.utilization(handle)  # unsupported on most MIG setups
        except nv.NVMLError_GpuIsLost:
            raise
        except nv.NVMLError:
            # An instance that went away says nothing about its GPU's health: no reading.
            return MigReading(uuid=uuid)
        return MigReading(
            uuid=uuid,
            memory_used_bytes=used,
            memory_free_bytes=free,
            utilization_gpu_percent=util_gpu,
            utilization_memory_percent=util_memory,
        )

    def read(self, uuid: str, xids: list[int]) -> Probe:
        nv = self.nvml
        handle = self.handles[uuid]
        uncorrected, corrected = (
            nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
        )
        volatile, aggregate = nv.NVML_VOLATILE_ECC, nv.NVML_AGGREGATE_ECC
        try:
            temp = self.opt(nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU)
            power_mw = self.opt(nv.nvmlDeviceGetPowerUsage, handle)
            ecc = self.ecc(handle, uncorrected, volatile)
            retired = self.opt(nv.nvmlDeviceGetRetiredPagesPendingStatus, handle)
            remapped = self.opt(nv.nvmlDeviceGetRemappedRows, handle)
            used, free = self.memory(handle)
            util_gpu, util_memory = self.utilization(handle)
            sm_clock = self.opt(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM)
            mem_clock = self.opt(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_MEM)
            ecc_counts = (
                self.ecc(handle, corrected, volatile),
                self.ecc(handle, corrected, aggregate),
                self.ecc(handle, uncorrected, aggregate),
            )
            migs = tuple(self.mig_reading(m, h) for m, h in self.mig_handles.get(uuid, ()))
        except nv.NVMLError_GpuIsLost as exc:
            return Probe(device_id=uuid, status=ProbeStatus.LOST, error=str(exc), xids=tuple(xids))
        except nv.NVMLError as exc:
            return Probe(
                device_id=uuid, status=ProbeStatus.FAILED, error=str(exc), xids=tuple(xids)
            )
        slowdown = self.slowdown_c.get(uuid)
        events = uuid in self.xid_devices
        return Probe(
            device_id=uuid,
            status=ProbeStatus.OK,
            xids=tuple(xids),
            temperature_c=float(temp) if temp is not None else None,
            power_w=power_mw / 1000 if power_mw is not None else None,
            ecc_volatile_uncorrected=ecc,
            retired_pages_pending=(retired == nv.NVML_FEATURE_ENABLED)
            if retired is not None
            else None,
            remapped_rows_pending=bool(remapped[2] or remapped[3])
            if remapped is not None
            else None,
            memory_used_bytes=used,
            memory_free_bytes=free,
            utilization_gpu_percent=util_gpu,
            utilization_memory_percent=util_memory,
            sm_clock_mhz=int(sm_clock) if sm_clock is not None else None,
            memory_clock_mhz=int(mem_clock) if mem_clock is not None else None,
            ecc_volatile_corrected=ecc_counts[0],
            ecc_aggregate_corrected=ecc_counts[1],
            ecc_aggregate_uncorrected=ecc_counts[2],
            xid_count=self.xid_count.get(uuid, 0) if events else None,
            last_xid=self.last_xid.get(uuid, 0) if events else None,
            mig=migs,
            over_temperature=temp is not None and slowdown is not None and temp >= slowdown,
        )

    def probe(self) -> list[Probe]:
        try:
            xids = self.drain_xids()
        except self.nvml.NVMLError:
            xids = {}
        return [self.read(uuid, xids.get(uuid, [])) for uuid in self.handles]

    def rediscover(self) -> set[str]:
        nv = self.nvml
        visible = set()
        for uuid in self.handles:
            try:
                handle = nv.nvmlDeviceGetHandleByUUID(uuid)
                nv.nvmlDeviceGetMemoryInfo(handle)
                if uuid in self.mig_handles:  # a reset GPU hands out new MIG handles
                    self.mig_instances(uuid, handle)
            except nv.NVMLError:
                continue
            self.handles[uuid] = handle
            visible.add(uuid)
        return visible

    def close(self) -> None:
        nv = self.nvml
        try:
            if self.event_set is not None:
                nv.nvmlEventSetFree(self.event_set)
        finally:
            nv.nvmlShutdown()


class NvmlSource:
    """A DeviceSource over NVML. Build it with `open_nvml`."""

    def __init__(self, nvml: Any, *, call_timeout: float) -> None:
        self._sync = _Sync(nvml)
        self._timeout = call_timeout
        self._limiter = trio.CapacityLimiter(1)
        self._closed = False

    async def _call(self, fn: Callable[[], T]) -> T:
        with trio.fail_after(self._timeout):
            return await trio.to_thread.run_sync(fn, limiter=self._limiter, abandon_on_cancel=True)

    async def probe(self) -> list[Probe]:
        try:
            return await self._call(self._sync.probe)
        except trio.TooSlowError:
            return [
                Probe(device_id=uuid, status=ProbeStatus.FAILED, error="nvml_timeout")
                for uuid in self._sync.handles
            ]

    async def rediscover(self) -> set[str]:
        try:
            return await self._call(self._sync.rediscover)
        except trio.TooSlowError:
            return set()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Shielded with a deadline: closing must not hang shutdown, nor be skipped by it.
        with trio.move_on_after(self._timeout, shield=True):
            try:
                await trio.to_thread.run_sync(
                    self._sync.close, limiter=self._limiter, abandon_on_cancel=True
                )
            except self._sync.nvml.NVMLError:
                pass


async def open_nvml(
    nvml: Any, *, call_timeout: float = 5.0
) -> tuple[NvmlSource, list[GpuDevice], str | None, str | None, list[str], list[Probe]]:
    """Initialise NVML and read every GPU once.

    Returns (source, gpus, driver_version, cuda_version, notes, first probes).
    Raises NvmlUnavailable when NVML cannot be loaded or initialised.
    """
    source = NvmlSource(nvml, call_timeout=call_timeout)
    try:
        gpus, driver, cuda, notes = await source._call(source._sync.init)
    except trio.TooSlowError as exc:
        raise NvmlUnavailable("nvmlInit timed out") from exc
    except Exception as exc:  # a missing library raises OSError-like errors too
        await source.aclose()  # undo a half-done init; errors here are swallowed by aclose
        raise NvmlUnavailable(f"{type(exc).__name__}: {exc}") from exc
    probes = await source.probe()
    return source, gpus, driver, cuda, notes, probes
