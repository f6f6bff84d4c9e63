"""How far a GPU's used memory, as NVML reads it, is from what the ledger grants.

The ledger grants VRAM to invocations (each lane's `allocated`); NVML says how
much of the GPU is in use (`memory_used_bytes`, a MIG parent's over all its
instances). Use beyond the grants is memory the node did not account for: a
lane host's pool cache or CUDA context, the driver's own, a process outside the
node. It is compared at every snapshot (so at every probe): the drift per GPU is
a metric, and a drift past the headroom kept back on the GPU's lanes
(`--vram-headroom` each) is a note, since a grant near the edge may then fail.
Simulated GPUs are host memory: they have no drift.
"""

from __future__ import annotations

import msgspec

from machine.snapshot import NodeSnapshot

__all__ = ["DeviceDrift", "drift_notes", "vram_drift"]


class DeviceDrift(msgspec.Struct, frozen=True, kw_only=True):
    device_id: str
    used: int  # NVML's used memory
    granted: int  # what the ledger allocated on the GPU's lanes
    headroom: int  # what the ledger keeps back on them

    @property
    def drift(self) -> int:
        """Bytes in use beyond the grants (negative: granted and not in use)."""
        return self.used - self.granted


def vram_drift(snapshot: NodeSnapshot) -> list[DeviceDrift]:
    """Per GPU with lanes and a reading of its used memory, on a node with real GPUs."""
    if snapshot.backend != "nvml":
        return []
    granted: dict[str, int] = {}
    headroom: dict[str, int] = {}
    for lane in snapshot.capacity.vram_bytes:
        granted[lane.device_id] = granted.get(lane.device_id, 0) + lane.allocated
        headroom[lane.device_id] = headroom.get(lane.device_id, 0) + lane.reserved
    return [
        DeviceDrift(
            device_id=device.device_id,
            used=device.memory_used_bytes,
            granted=granted[device.device_id],
            headroom=headroom[device.device_id],
        )
        for device in snapshot.devices
        if device.memory_used_bytes is not None and device.device_id in granted
    ]


def drift_notes(drifts: list[DeviceDrift]) -> tuple[str, ...]:
    return tuple(
        f"vram_drift: {d.device_id} has {d.drift >> 20} MiB in use beyond the "
        f"{d.granted >> 20} MiB its lanes grant, more than their {d.headroom >> 20} MiB "
        "headroom: memory the node does not account for (a lane host's cache or "
        "context, or a process outside the node)"
        for d in drifts
        if d.drift > d.headroom
    )
