"""One reading (a Probe) of one GPU and its MIG instances through NVML. Blocking
calls: run in the GPU's worker thread.

Every field is read on its own (machine/nvml_fields.py): one the device does
not support is None; one the driver refuses is None with its reason in
`Probe.unread`, and the rest is read. The reading fails (health `unknown`)
only on an error that concerns the whole device, or when the device answered
no field at all; GpuIsLost makes it `lost`. XIDs drained before the reading
are carried even by a failed one. A GPU in MIG mode whose aggregate memory
needs privileges is read with the v2 call, else as the sum of its instances.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from machine.inventory import MigReading, Probe, ProbeStatus
from machine.nvml_events import Drained, XidWatch
from machine.nvml_fields import Fields
from machine.nvml_gpu import GpuHandle, MigHandle

__all__ = ["read_gpu"]


def read_gpu(nv: Any, gpu: GpuHandle, watch: XidWatch) -> Probe:
    """Drain the GPU's XID events, then read it."""
    drained = watch.drain(gpu.migs)
    try:
        probe = _read(nv, gpu, watch, drained)
    except nv.NVMLError as exc:  # device-level (machine/nvml_fields.py)
        lost = isinstance(exc, nv.NVMLError_GpuIsLost)
        return Probe(
            device_id=gpu.uuid,
            status=ProbeStatus.LOST if lost else ProbeStatus.FAILED,
            error=str(exc),
            xids=tuple(drained.gpu),
            mig=tuple(MigReading(uuid=u, xids=tuple(x)) for u, x in drained.instances.items()),
        )
    if drained.error is not None and probe.status is ProbeStatus.OK:
        # Events may have been missed: the reading cannot vouch for the GPU.
        error = f"xid_events_failed: {drained.error}"
        probe = msgspec.structs.replace(probe, status=ProbeStatus.FAILED, error=error)
    return probe


def _read(nv: Any, gpu: GpuHandle, watch: XidWatch, drained: Drained) -> Probe:
    h, f = gpu.handle, Fields(nv)
    unc, cor = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED
    vol, agg = nv.NVML_VOLATILE_ECC, nv.NVML_AGGREGATE_ECC
    temp = f.get("temperature_c", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
    power_mw = f.get("power_w", nv.nvmlDeviceGetPowerUsage, h)
    ecc_unc = f.get("ecc_volatile_uncorrected", nv.nvmlDeviceGetTotalEccErrors, h, unc, vol)
    retired = f.get("retired_pages_pending", nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
    remapped = f.get("remapped_rows", nv.nvmlDeviceGetRemappedRows, h)
    rates = f.get("utilization", nv.nvmlDeviceGetUtilizationRates, h)
    sm_clock = f.get("sm_clock_mhz", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
    mem_clock = f.get("memory_clock_mhz", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
    energy = f.get("total_energy_mj", nv.nvmlDeviceGetTotalEnergyConsumption, h)
    replays = f.get("pcie_replay_count", nv.nvmlDeviceGetPcieReplayCounter, h)
    ecc_counts = [
        f.get(name, nv.nvmlDeviceGetTotalEccErrors, h, kind, counter)
        for name, kind, counter in (
            ("ecc_volatile_corrected", cor, vol),
            ("ecc_aggregate_corrected", cor, agg),
            ("ecc_aggregate_uncorrected", unc, agg),
        )
    ]
    migs = tuple(_read_mig(nv, m, drained.instances.get(m.uuid, [])) for m in gpu.migs)
    used, free = _memory(nv, f, gpu, migs)
    xids = tuple(drained.gpu)
    if f.unread and not f.answered:  # it refused everything: nothing is known of it
        return Probe(device_id=gpu.uuid, status=ProbeStatus.FAILED, error=f.unread[0], xids=xids)
    over = temp is not None and gpu.slowdown_c is not None and temp >= gpu.slowdown_c
    return Probe(
        device_id=gpu.uuid,
        status=ProbeStatus.OK,
        xids=xids,
        temperature_c=float(temp) if temp is not None else None,
        power_w=power_mw / 1000 if power_mw is not None else None,
        ecc_volatile_uncorrected=int(ecc_unc) if ecc_unc is not None else None,
        retired_pages_pending=(retired == nv.NVML_FEATURE_ENABLED) if retired is not None else None,
        # (corrected, uncorrected, pending, failure): a failure is pending for good.
        remapped_rows_pending=bool(remapped[2] or remapped[3]) if remapped is not None else None,
        remapped_rows_failed=bool(remapped[3]) if remapped is not None else None,
        remapped_rows_correctable=_int(remapped[0]) if remapped is not None else None,
        remapped_rows_uncorrectable=_int(remapped[1]) if remapped is not None else None,
        memory_used_bytes=used,
        memory_free_bytes=free,
        utilization_gpu_percent=float(rates.gpu) if rates is not None else None,
        utilization_memory_percent=float(rates.memory) if rates is not None else None,
        sm_clock_mhz=int(sm_clock) if sm_clock is not None else None,
        memory_clock_mhz=int(mem_clock) if mem_clock is not None else None,
        ecc_volatile_corrected=_int(ecc_counts[0]),
        ecc_aggregate_corrected=_int(ecc_counts[1]),
        ecc_aggregate_uncorrected=_int(ecc_counts[2]),
        total_energy_mj=_int(energy),
        pcie_replay_count=_int(replays),
        xid_count=watch.count if watch.watching else None,
        last_xid=watch.last if watch.watching else None,
        mig=migs,
        over_temperature=over,
        unread=tuple(f.unread),
    )


def _int(value: Any) -> int | None:
    return int(value) if value is not None else None


def _memory(
    nv: Any, f: Fields, gpu: GpuHandle, migs: tuple[MigReading, ...]
) -> tuple[int | None, int | None]:
    if not gpu.migs:
        mem = f.get("memory", nv.nvmlDeviceGetMemoryInfo, gpu.handle)
        return (int(mem.used), int(mem.free)) if mem is not None else (None, None)
    # In MIG mode NVML gives the aggregate to a privileged caller only: v1, v2, else
    # the instances' sum (when every instance was read).
    tried = Fields(nv)
    mem = tried.get("memory", nv.nvmlDeviceGetMemoryInfo, gpu.handle)
    if mem is not None:
        f.answered += 1
        return int(mem.used), int(mem.free)
    v2 = tried.get(
        "memory",
        functools.partial(nv.nvmlDeviceGetMemoryInfo, version=nv.nvmlMemory_v2),
        gpu.handle,
    )
    if v2 is not None:
        f.answered += 1
        return int(v2.total) - int(v2.free), int(v2.free)
    used = [m.memory_used_bytes for m in migs]
    free = [m.memory_free_bytes for m in migs]
    if migs and None not in used and None not in free:
        f.answered += 1
        return sum(u for u in used if u is not None), sum(x for x in free if x is not None)
    f.unread.extend(tried.unread[:1])
    return None, None


def _read_mig(nv: Any, mig: MigHandle, xids: list[int]) -> MigReading:
    """An instance that cannot be read (destroyed, refused) has no figures: that says
    nothing about its GPU's health. Device-level errors are the GPU's."""
    f = Fields(nv)
    mem = f.get("memory", nv.nvmlDeviceGetMemoryInfo, mig.handle)
    rates = f.get("utilization", nv.nvmlDeviceGetUtilizationRates, mig.handle)  # NVML: none
    return MigReading(
        uuid=mig.uuid,
        memory_used_bytes=int(mem.used) if mem is not None else None,
        memory_free_bytes=int(mem.free) if mem is not None else None,
        utilization_gpu_percent=float(rates.gpu) if rates is not None else None,
        utilization_memory_percent=float(rates.memory) if rates is not None else None,
        xids=tuple(xids),
    )
