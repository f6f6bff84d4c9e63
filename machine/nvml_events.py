"""XID events of one GPU, from an NVML event set of its own. Blocking calls: run
in the GPU's worker thread.

A set per GPU (rather than one for the node) keeps each GPU's events its own:
an event is charged to the GPU whose set it came out of, so its device never
has to be named by reading its uuid (an event whose uuid could not be read
would otherwise be lost); a wait that fails or hangs concerns that GPU alone.

Draining reads up to MAX_EVENTS_PER_PROBE events without waiting
(`nvmlEventSetWait_v2(set, 0)`, which raises NVMLError_Timeout when none is
left). A wait that raises anything else (GpuIsLost, Unknown, ...) ends the
drain: the events read before it are kept, and the error is handed back, for
the reading to say that events may have been missed. The set is kept and the
next probe waits on it again.

An event names a MIG instance by its GPU and compute instance ids
(`gpuInstanceId`, `computeInstanceId`; 0xFFFFFFFF: not an instance, the whole
GPU). It is charged to the instances it names; one that names none of the
GPU's known instances is charged to the whole GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from machine.nvml_gpu import MigHandle

__all__ = ["GPU_SCOPE", "MAX_EVENTS_PER_PROBE", "Drained", "XidWatch"]

# Bound the work one probe does on a storm of events; the rest wait for the next probe.
MAX_EVENTS_PER_PROBE = 64
# gpuInstanceId / computeInstanceId of an event for the whole GPU.
GPU_SCOPE = 0xFFFFFFFF


@dataclasses.dataclass
class Drained:
    """What one drain found: XIDs of the whole GPU, XIDs by MIG instance uuid, and
    the wait's error when it failed mid-drain (what came before it is kept)."""

    gpu: list[int] = dataclasses.field(default_factory=list)
    instances: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    error: str | None = None


def charged_to(gi: int, ci: int, migs: list[MigHandle]) -> list[str]:
    """The MIG instances an event names (none: it is the whole GPU's)."""
    if gi == GPU_SCOPE:
        return []
    return [
        m.uuid
        for m in migs
        if m.gpu_instance_id == gi and (ci == GPU_SCOPE or m.compute_instance_id == ci)
    ]


class XidWatch:
    """One GPU's XID events: its event set, and what it has seen since it opened."""

    def __init__(self, nv: Any) -> None:
        self.nv = nv
        self.event_set: Any = None
        self.count = 0  # XID events seen since NVML opened (every instance's included)
        self.last = 0

    @property
    def watching(self) -> bool:
        return self.event_set is not None

    def open(self, handle: Any) -> str | None:
        """Create the set and register the GPU for XIDs; why not, when that fails
        (NotSupported on some devices, containers and vGPUs; NoPermission)."""
        nv = self.nv
        self.close()
        try:
            event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            return str(exc)
        try:
            nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, event_set)
        except nv.NVMLError as exc:
            self._free(event_set)
            return str(exc)
        self.event_set = event_set
        return None

    def drain(self, migs: list[MigHandle]) -> Drained:
        nv = self.nv
        found = Drained()
        if self.event_set is None:
            return found
        for _ in range(MAX_EVENTS_PER_PROBE):
            try:
                data = nv.nvmlEventSetWait_v2(self.event_set, 0)
            except nv.NVMLError_Timeout:
                break  # nothing more
            except nv.NVMLError as exc:
                found.error = str(exc)
                break
            if not data.eventType & nv.nvmlEventTypeXidCriticalError:
                continue
            xid = int(data.eventData)
            self.count += 1
            self.last = xid
            instances = charged_to(int(data.gpuInstanceId), int(data.computeInstanceId), migs)
            for uuid in instances:
                found.instances.setdefault(uuid, []).append(xid)
            if not instances:
                found.gpu.append(xid)
        return found

    def close(self) -> None:
        if self.event_set is not None:
            event_set, self.event_set = self.event_set, None
            self._free(event_set)

    def _free(self, event_set: Any) -> None:
        try:
            self.nv.nvmlEventSetFree(event_set)
        except self.nv.NVMLError:
            pass  # a set NVML no longer knows (after a reset or shutdown) is gone anyway
