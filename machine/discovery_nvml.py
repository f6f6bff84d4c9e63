"""NVIDIA GPUs through NVML (the `pynvml` module of nvidia-ml-py).

Every NVML call runs off the event loop, under a deadline, in a thread of the
GPU it concerns (machine/kept_thread.py: a kept thread per GPU, and one for
NVML's own calls): a hung driver call times out only its GPU's reading, which
is then `failed` (health `unknown`, never healthy), while every other GPU goes
on being read; that GPU's next readings wait behind the stuck call and time
out too, until it returns. What NVML says is read in three parts, each guarded
on its own: discovery per GPU, per field and per MIG instance
(machine/nvml_gpu.py), readings per field (machine/nvml_reading.py), and XID
events from an event set per GPU (machine/nvml_events.py). A GPU that fell
off the bus and is back is found by `rediscover`, which takes its handle, its
MIG instances' handles and its XID registration afresh (a reset drops them).
NVML missing or failing to initialise is reported as `NvmlUnavailable`, which
discovery turns into "no GPU lanes" plus a readiness reason. The module is a
parameter so tests pass a fake.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from machine.inventory import GpuDevice, Probe, ProbeStatus
from machine.kept_thread import KeptThread
from machine.nvml_events import XidWatch
from machine.nvml_fields import device_level, text
from machine.nvml_gpu import GpuHandle, describe, scan_migs
from machine.nvml_reading import read_gpu

__all__ = ["NvmlSource", "NvmlUnavailable", "open_nvml"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class NvmlUnavailable(Exception):
    """NVML could not be loaded or initialised (a local condition, not a device fault)."""


@dataclasses.dataclass(eq=False)
class _Device:
    gpu: GpuHandle
    watch: XidWatch
    thread: KeptThread
    mig_enabled: bool = False
    # A reading said it is lost: `rediscover` must find it again (and re-register it).
    lost: bool = False
    unread: tuple[str, ...] = ()


def _supported(nv: Any, fn: Callable[[], T]) -> T | None:
    try:
        return fn()
    except nv.NVMLError_NotSupported:
        return None


def _answers(nv: Any, handle: Any) -> bool:
    """The device answers (a refusal, NoPermission in MIG mode, is an answer)."""
    try:
        nv.nvmlDeviceGetMemoryInfo(handle)
    except nv.NVMLError as exc:
        return not device_level(nv, exc)
    return True


class NvmlSource:
    """A DeviceSource over NVML. Build it with `open_nvml`."""

    def __init__(self, nvml: Any, *, call_timeout: float) -> None:
        self._nv = nvml
        self._timeout = call_timeout
        self._system = KeptThread("nvml")
        self._devices: dict[str, _Device] = {}
        self._closed = False

    async def _run(self, thread: KeptThread, fn: Callable[[], T]) -> T:
        with trio.fail_after(self._timeout):
            return await thread.run(fn)

    # -- discovery ---------------------------------------------------------------
    async def _open(self) -> tuple[list[GpuDevice], str | None, str | None, list[str]]:
        found, driver, cuda, notes = await self._run(self._system, self._init)
        for uuid, handle in found:  # in NVML's order
            thread = KeptThread(f"nvml {uuid}")
            device = _Device(GpuHandle(uuid=uuid, handle=handle), XidWatch(self._nv), thread)
            self._devices[uuid] = device
        described: dict[str, tuple[GpuDevice, list[str]]] = {}
        async with trio.open_nursery() as nursery:
            for device in self._devices.values():
                nursery.start_soon(self._describe, device, described)
        gpus = []
        for uuid in self._devices:
            gpu, gpu_notes = described[uuid]
            gpus.append(gpu)
            notes += gpu_notes
        return gpus, driver, cuda, notes

    def _init(self) -> tuple[list[tuple[str, Any]], str | None, str | None, list[str]]:
        nv = self._nv
        nv.nvmlInit()
        driver = _supported(nv, nv.nvmlSystemGetDriverVersion)
        cuda_raw = _supported(nv, nv.nvmlSystemGetCudaDriverVersion)
        cuda = f"{cuda_raw // 1000}.{cuda_raw % 1000 // 10}" if cuda_raw else None
        notes: list[str] = []
        found = []
        for index in range(nv.nvmlDeviceGetCount()):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                found.append((text(nv.nvmlDeviceGetUUID(handle)), handle))
            except nv.NVMLError as exc:
                notes.append(f"gpu_unreadable: index {index}: {exc}")
        return found, text(driver) if driver is not None else None, cuda, notes

    async def _describe(self, device: _Device, out: dict[str, tuple[GpuDevice, list[str]]]) -> None:
        uuid = device.gpu.uuid
        notes: list[str] = []
        try:
            gpu = await self._run(
                device.thread, functools.partial(self._describe_sync, device, notes)
            )
        except trio.TooSlowError:
            notes.append(f"gpu_unreadable: {uuid}: nvml_timeout")
            gpu = GpuDevice(uuid=uuid, name="unknown", pci_bus_id=None, memory_total_bytes=0)
        out[uuid] = (gpu, list(notes))

    def _describe_sync(self, device: _Device, notes: list[str]) -> GpuDevice:
        uuid, handle = device.gpu.uuid, device.gpu.handle
        gpu, device.gpu = describe(self._nv, uuid, handle, notes)
        device.mig_enabled = gpu.mig_enabled
        refused = device.watch.open(handle)
        if refused is not None:
            # XID counts then read None (unmonitored); health goes on other signals.
            notes.append(f"xid_events_unavailable: {uuid}: {refused}")
        return gpu

    # -- readings ----------------------------------------------------------------
    async def probe(self) -> list[Probe]:
        probes: dict[str, Probe] = {}
        async with trio.open_nursery() as nursery:
            for device in self._devices.values():
                nursery.start_soon(self._probe_one, device, probes)
        return [probes[uuid] for uuid in self._devices]

    async def _probe_one(self, device: _Device, out: dict[str, Probe]) -> None:
        uuid = device.gpu.uuid
        read = functools.partial(read_gpu, self._nv, device.gpu, device.watch)
        try:
            probe = await self._run(device.thread, read)
        except trio.TooSlowError:
            probe = Probe(device_id=uuid, status=ProbeStatus.FAILED, error="nvml_timeout")
        if probe.status is ProbeStatus.LOST:
            device.lost = True
        elif probe.status is ProbeStatus.OK and probe.unread != device.unread:
            device.unread = probe.unread
            if probe.unread:
                log.warning("GPU %s: NVML refused %s", uuid, "; ".join(probe.unread))
        out[uuid] = probe

    async def rediscover(self) -> set[str]:
        """Devices readable again: the ones never lost, and lost ones found again."""
        visible = {uuid for uuid, device in self._devices.items() if not device.lost}
        async with trio.open_nursery() as nursery:
            for device in self._devices.values():
                if device.lost:
                    nursery.start_soon(self._rediscover_one, device, visible)
        return visible

    async def _rediscover_one(self, device: _Device, visible: set[str]) -> None:
        try:
            back = await self._run(device.thread, functools.partial(self._found_again, device))
        except trio.TooSlowError:
            return
        if back:
            device.lost = False
            visible.add(device.gpu.uuid)

    def _found_again(self, device: _Device) -> bool:
        nv, uuid = self._nv, device.gpu.uuid
        notes: list[str] = []
        try:
            handle = nv.nvmlDeviceGetHandleByUUID(uuid)
            if not _answers(nv, handle):
                return False
            if device.mig_enabled:  # a reset GPU hands out new MIG handles
                _, migs = scan_migs(nv, uuid, handle, "", notes)
                device.gpu.migs = migs
        except nv.NVMLError:
            return False
        device.gpu.handle = handle
        # A reset dropped the GPU's XID registration: made again on the new handle.
        refused = device.watch.open(handle)
        for note in notes:
            log.warning("GPU %s found again: %s", uuid, note)
        if refused is not None:
            log.warning("GPU %s found again: XID events unavailable: %s", uuid, refused)
        return True

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Shielded with a deadline: closing must not hang shutdown, nor be skipped by it.
        with trio.move_on_after(self._timeout, shield=True):
            try:
                await self._system.run(self._close_sync)
            except self._nv.NVMLError:
                pass

    def _close_sync(self) -> None:
        try:
            for device in self._devices.values():
                device.watch.close()
        finally:
            self._nv.nvmlShutdown()


async def open_nvml(
    nvml: Any, *, call_timeout: float = 5.0
) -> tuple[NvmlSource, list[GpuDevice], str | None, str | None, list[str], list[Probe]]:
    """Initialise NVML and read every GPU once.

    Returns (source, gpus, driver_version, cuda_version, notes, first probes).
    Raises NvmlUnavailable when NVML cannot be loaded or initialised.
    """
    source = NvmlSource(nvml, call_timeout=call_timeout)
    try:
        gpus, driver, cuda, notes = await source._open()
    except trio.TooSlowError as exc:
        raise NvmlUnavailable("nvmlInit timed out") from exc
    except Exception as exc:  # a missing library raises OSError-like errors too
        await source.aclose()  # undo a half-done init; errors here are swallowed by aclose
        raise NvmlUnavailable(f"{type(exc).__name__}: {exc}") from exc
    probes = await source.probe()
    return source, gpus, driver, cuda, notes, probes
