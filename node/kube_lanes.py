"""The node's device lanes as the DRA driver offers them, and back again.

Every GPU lane is one device: a whole GPU (`gpu-<id>`), a MIG instance
(`mig-<id>`), or, for the GPUs the operator shares (`--kube-shared-gpus`), its
VRAM that many claims take part of (`vram-<id>`); `<id>` is the lane id's hex, so
a device name names its lane and nothing a pod could enumerate. The CPU pool is
not offered. Attributes: `type` (gpu, mig, vram), the device's uuid, product,
compute capability, driver version and PCI bus id, and for a MIG instance its
profile and parent GPU. Health as the ledger shows it: a lost device is `lost`,
any other not allocatable one `unhealthy`. A whole GPU or a MIG instance a DeviceClass
passes through (`kubeplugin.claim_config`) brings its device nodes, as a guest's
`/dev` holds them (`machine.devnodes`); a shared GPU's VRAM is never passed through.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Literal

from kubeplugin.cdi import Passthrough
from kubeplugin.claims import AllocatedDevice
from kubeplugin.health import DeviceHealthReading
from kubeplugin.slices import OfferedDevice, Version
from machine.devnodes import lane_device_nodes
from machine.health import ALLOCATABLE_STATES, HealthState
from machine.inventory import GpuDevice, Inventory
from machine.lanes import Lane, LaneKind
from machine.ledger import Ledger
from supervisor.hold import HoldGrant

__all__ = [
    "KubeLaneError",
    "device_health",
    "hold_grant",
    "offered_devices",
    "passthrough_of",
]

_LANE_PREFIX = "lane_"
SHARE_ALL = "all"


class KubeLaneError(ValueError):
    """A device this node cannot hold for a claim; `reason` is the claim's error code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _shares(lane: Lane, shared_gpus: Collection[str]) -> bool:
    """Whether the lane's VRAM is offered in parts (a GPU the operator shares)."""
    if lane.kind is not LaneKind.GPU:
        return False
    return SHARE_ALL in shared_gpus or lane.device_id in shared_gpus


def _kind(lane: Lane, shared_gpus: Collection[str]) -> str:
    if lane.kind is LaneKind.MIG:
        return "mig"
    return "vram" if _shares(lane, shared_gpus) else "gpu"


def _device_name(lane: Lane, shared_gpus: Collection[str]) -> str:
    return f"{_kind(lane, shared_gpus)}-{lane.lane_id.removeprefix(_LANE_PREFIX)}"


def _version(text: str | None) -> Version | None:
    """A semantic version from a dotted one (8.6 -> 8.6.0); None where it is not one."""
    if not text:
        return None
    parts = text.split("-")[0].split(".")
    if not all(part.isdigit() for part in parts):
        return None
    return Version(".".join([*parts, "0", "0"][:3]))


def _attributes(
    lane: Lane, kind: str, gpu: GpuDevice | None, inventory: Inventory
) -> dict[str, str | int | bool | Version]:
    found: dict[str, str | int | bool | Version | None] = {
        "type": kind,
        "uuid": lane.visible_uuid or lane.device_id,
        "productName": gpu.name if gpu else None,
        "cudaComputeCapability": _version(gpu.compute_capability if gpu else None),
        "driverVersion": _version(inventory.driver_version),
        "resource.kubernetes.io/pciBusID": gpu.pci_bus_id.lower()[-12:]
        if gpu and gpu.pci_bus_id
        else None,
    }
    if lane.kind is LaneKind.MIG and gpu is not None:
        mig = next((m for m in gpu.mig_instances if m.uuid == lane.visible_uuid), None)
        found["profile"] = mig.name if mig else None
        found["parentUUID"] = gpu.uuid
    return {name: value for name, value in found.items() if value is not None}


Health = Literal["ok", "unhealthy", "lost"]


def _health(ledger: Ledger, lane_id: str) -> Health:
    shown = ledger.lane_health_shown(lane_id)
    if shown is HealthState.LOST:
        return "lost"
    return "ok" if shown in ALLOCATABLE_STATES and ledger.available(lane_id) else "unhealthy"


def offered_devices(
    ledger: Ledger, inventory: Inventory, shared_gpus: Collection[str]
) -> list[OfferedDevice]:
    gpus = {gpu.uuid: gpu for gpu in inventory.gpus}
    offered = []
    for lane in ledger.lanes():
        if not lane.is_gpu:
            continue
        kind = _kind(lane, shared_gpus)
        offered.append(
            OfferedDevice(
                name=_device_name(lane, shared_gpus),
                memory_bytes=lane.vram_bytes,
                attributes=_attributes(lane, kind, gpus.get(lane.device_id), inventory),
                shared=kind == "vram",
                health=_health(ledger, lane.lane_id),
            )
        )
    return offered


def passthrough_of(
    devices: Sequence[AllocatedDevice],
    grants: Sequence[HoldGrant],
    ledger: Ledger,
    inventory: Inventory,
    dev_root: Path,
) -> Passthrough:
    """The device nodes (in the container, on the host) and uuids of the devices a
    claim has passed through; KubeLaneError where a lane's nodes cannot be had."""
    nodes: list[tuple[str, str]] = []
    visible: list[str] = []
    for device, grant in zip(devices, grants, strict=True):
        if not device.passthrough:
            continue
        lane = ledger.lane(grant.lane_id)
        found = () if lane is None else lane_device_nodes(inventory, lane, dev_root)
        # A MIG instance is nothing to CUDA without its capability nodes.
        caps = any(path.parent.name == "nvidia-caps" for path in found)
        if (
            lane is None
            or not found
            or lane.visible_uuid is None
            or (lane.kind is LaneKind.MIG and not caps)
        ):
            raise KubeLaneError(
                "passthrough_unavailable", f"device {device.device}: its device nodes are not here"
            )
        for host in found:
            inside = f"/dev/{host.relative_to(dev_root)}"
            if (inside, str(host)) not in nodes:
                nodes.append((inside, str(host)))
        visible.append(lane.visible_uuid)
    return Passthrough(nodes=tuple(nodes), visible=tuple(visible))


def device_health(ledger: Ledger, shared_gpus: Collection[str]) -> list[DeviceHealthReading]:
    """Each offered device's health for kubelet's health stream, with why it is not
    healthy (the lane's own fault, or its device's health)."""
    readings = []
    for lane in ledger.lanes():
        if not lane.is_gpu:
            continue
        health = _health(ledger, lane.lane_id)
        why = "" if health == "ok" else ledger.lane_fault(lane.lane_id) or health
        name = _device_name(lane, shared_gpus)
        readings.append(DeviceHealthReading(name, healthy=health == "ok", message=why))
    return readings


def hold_grant(device: AllocatedDevice, ledger: Ledger, shared_gpus: Collection[str]) -> HoldGrant:
    """What an allocated device holds of its lane: all of it, or the claim's part of
    a shared GPU's VRAM (its `memory`, which a shared device's allocation must name)."""
    kind, _, hexid = device.device.partition("-")
    lane = ledger.lane(_LANE_PREFIX + hexid)
    if lane is None or not lane.is_gpu or _kind(lane, shared_gpus) != kind:
        raise KubeLaneError("device_unknown", f"device {device.device}: not one of this node's")
    if kind != "vram":
        return HoldGrant(lane_id=lane.lane_id)
    if device.passthrough:
        raise KubeLaneError(
            "passthrough_unsupported",
            f"device {device.device}: a part of a shared GPU is served through its lane "
            "host alone, never passed through",
        )
    if not device.memory_bytes:
        raise KubeLaneError(
            "vram_unsized",
            f"device {device.device}: the allocation names no memory (a shared GPU's VRAM "
            "is given in parts, which needs Kubernetes 1.36 or later: DRAConsumableCapacity)",
        )
    return HoldGrant(lane_id=lane.lane_id, vram_bytes=device.memory_bytes, whole=False)
