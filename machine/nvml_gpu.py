"""One GPU as NVML describes it at discovery: its facts, its MIG instances, and
the handles later readings use. Blocking calls: run in the GPU's worker thread.

Each part is guarded on its own, so one unreadable part never costs the node
its other GPUs, nor the GPU its other parts:

- a field the driver refuses (the minor number, the PCI bus id, the compute
  capability, the slowdown temperature) is None, with a note;
- a MIG instance that cannot be read (destroyed mid-scan, refused) is left out
  with a note; the GPU's other instances stay;
- a GPU in MIG mode whose aggregate memory NVML refuses (it needs privileges
  the daemon's user lacks) is read with the v2 call, else its capacity is the
  sum of its instances': it keeps its MIG mode and its instances;
- what a lane cannot do without (the MIG mode, the memory of a whole GPU), or
  an error that concerns the whole device, makes the GPU "unknown" with no
  capacity and a note; its probes then say what is wrong.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from machine.inventory import GpuDevice, MigInstance
from machine.nvml_fields import Fields, device_level, text

__all__ = ["GpuHandle", "MigHandle", "describe", "mig_profile", "scan_migs"]


@dataclasses.dataclass
class MigHandle:
    uuid: str
    handle: Any
    gpu_instance_id: int | None
    compute_instance_id: int | None


@dataclasses.dataclass
class GpuHandle:
    """What readings of one GPU need: its handle, its instances', its slowdown."""

    uuid: str
    handle: Any
    migs: list[MigHandle] = dataclasses.field(default_factory=list)
    slowdown_c: float | None = None


def mig_profile(gpu_name: str, name: str) -> str:
    """NVML's "NVIDIA H200 MIG 1g.18gb" -> "1g.18gb", as dcgm-exporter's GPU_I_PROFILE."""
    prefix = f"{gpu_name} MIG "
    if name.startswith(prefix):
        return name.removeprefix(prefix)
    _, sep, profile = name.rpartition(" MIG ")
    return profile if sep else name


def describe(nv: Any, uuid: str, handle: Any, notes: list[str]) -> tuple[GpuDevice, GpuHandle]:
    state = GpuHandle(uuid=uuid, handle=handle)
    try:
        return _describe(nv, state, notes), state
    except nv.NVMLError as exc:
        # Known by uuid but unreadable: listed with no capacity; its probes say why.
        notes.append(f"gpu_unreadable: {uuid}: {exc}")
        state.migs = []
        return GpuDevice(uuid=uuid, name="unknown", pci_bus_id=None, memory_total_bytes=0), state


def _describe(nv: Any, state: GpuHandle, notes: list[str]) -> GpuDevice:
    uuid, handle = state.uuid, state.handle
    try:
        mig_mode = nv.nvmlDeviceGetMigMode(handle)  # [current, pending]
    except nv.NVMLError_NotSupported:
        mig_mode = None
    mig_enabled = mig_mode is not None and mig_mode[0] == nv.NVML_DEVICE_MIG_ENABLE
    fields = Fields(nv)
    raw_name = fields.get("name", nv.nvmlDeviceGetName, handle)
    name = text(raw_name) if raw_name is not None else "unknown"
    pci = fields.get("pci_bus_id", nv.nvmlDeviceGetPciInfo, handle)
    cc = fields.get("compute_capability", nv.nvmlDeviceGetCudaComputeCapability, handle)
    slowdown = fields.get(
        "slowdown_temperature",
        nv.nvmlDeviceGetTemperatureThreshold,
        handle,
        nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
    )
    state.slowdown_c = float(slowdown) if slowdown is not None else None
    minor = fields.get("minor_number", nv.nvmlDeviceGetMinorNumber, handle)
    instances: list[MigInstance] = []
    if mig_enabled:
        instances, state.migs = scan_migs(nv, uuid, handle, name, notes)
    total, used, free = _memory(nv, uuid, handle, instances if mig_enabled else None, notes)
    notes.extend(f"gpu_field_unreadable: {uuid}: {field}" for field in fields.unread)
    return GpuDevice(
        uuid=uuid,
        name=name,
        pci_bus_id=text(pci.busId) if pci is not None else None,
        memory_total_bytes=total,
        memory_used_bytes=used,
        memory_free_bytes=free,
        compute_capability=f"{cc[0]}.{cc[1]}" if cc is not None else None,
        mig_enabled=mig_enabled,
        mig_instances=tuple(instances),
        minor_number=int(minor) if minor is not None else None,
    )


def _memory(
    nv: Any, uuid: str, handle: Any, instances: list[MigInstance] | None, notes: list[str]
) -> tuple[int, int, int]:
    """(total, used, free). `instances`: the GPU is in MIG mode, where NVML gives the
    aggregate only to a privileged caller; then v2, then the instances' sum."""
    try:
        mem = nv.nvmlDeviceGetMemoryInfo(handle)
        return int(mem.total), int(mem.used), int(mem.free)
    except nv.NVMLError as exc:
        if instances is None or device_level(nv, exc):
            raise  # a whole GPU whose memory is unknown has no lane to offer
        refused = exc
    try:
        v2 = nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2)
        # v2 keeps `reserved` apart from `used`; counted as v1 counts it (total - free).
        return int(v2.total), int(v2.total) - int(v2.free), int(v2.free)
    except nv.NVMLError as exc:
        if device_level(nv, exc):
            raise
    notes.append(f"mig_parent_memory: {uuid}: {refused}; its capacity is its instances'")
    total = sum(m.memory_total_bytes for m in instances)
    used = sum(m.memory_used_bytes or 0 for m in instances)
    return total, used, total - used


def scan_migs(
    nv: Any, uuid: str, handle: Any, gpu_name: str, notes: list[str]
) -> tuple[list[MigInstance], list[MigHandle]]:
    """The GPU's MIG instances; one that cannot be read is left out with a note."""
    try:
        slots = nv.nvmlDeviceGetMaxMigDeviceCount(handle)
    except nv.NVMLError as exc:
        if device_level(nv, exc):
            raise
        notes.append(f"mig_unreadable: {uuid}: {exc}")
        return [], []
    instances: list[MigInstance] = []
    handles: list[MigHandle] = []
    for index in range(slots):
        try:
            mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except nv.NVMLError_NotFound:
            continue  # an empty slot
        except nv.NVMLError as exc:
            if device_level(nv, exc):
                raise
            notes.append(f"mig_unreadable: {uuid}: slot {index}: {exc}")
            continue
        try:
            instance, mig_handle = _instance(nv, mig, gpu_name)
        except nv.NVMLError as exc:
            if device_level(nv, exc):
                raise
            # Destroyed mid-scan (NotFound) or refused: the other instances stay.
            notes.append(f"mig_unreadable: {uuid}: slot {index}: {exc}")
            continue
        instances.append(instance)
        handles.append(mig_handle)
    return instances, handles


def _instance(nv: Any, mig: Any, gpu_name: str) -> tuple[MigInstance, MigHandle]:
    uuid = text(nv.nvmlDeviceGetUUID(mig))
    mem = nv.nvmlDeviceGetMemoryInfo(mig)
    fields = Fields(nv)
    raw_name = fields.get("name", nv.nvmlDeviceGetName, mig)
    gi = fields.get("gpu_instance_id", nv.nvmlDeviceGetGpuInstanceId, mig)
    ci = fields.get("compute_instance_id", nv.nvmlDeviceGetComputeInstanceId, mig)
    gi, ci = (int(gi) if gi is not None else None), (int(ci) if ci is not None else None)
    instance = MigInstance(
        uuid=uuid,
        name=mig_profile(gpu_name, text(raw_name)) if raw_name is not None else "mig",
        memory_total_bytes=int(mem.total),
        memory_used_bytes=int(mem.used),
        gpu_instance_id=gi,
        compute_instance_id=ci,
    )
    return instance, MigHandle(uuid=uuid, handle=mig, gpu_instance_id=gi, compute_instance_id=ci)
