"""The node's lanes as Kubernetes ResourceSlices (`resource.k8s.io/v1`): one pool, the
node's, its generation bumped on every change, as many slices as the devices need.

A whole GPU or a MIG instance is a device of its own; a shared GPU's VRAM is one device
that many claims may take part of (`allowMultipleAllocations`), each a `memory` amount
in steps of 1 GiB, enforced by the lane host. A device whose health is not ok carries a
taint: `NoSchedule` while it is unhealthy, `NoExecute` once it is lost.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kubeplugin.sockets import DRIVER_NAME

__all__ = [
    "HEALTH_TAINT",
    "OfferedDevice",
    "SliceError",
    "Version",
    "resource_slices",
    "slice_name",
]

HEALTH_TAINT = f"{DRIVER_NAME}/health"
# A slice holds at most 128 devices, 64 once any of them has a taint.
_MAX_DEVICES = 128
_MAX_TAINTED = 64
# Attributes and capacities together, per device.
_MAX_FIELDS = 32
_GIB = 1 << 30
_MAX_NAME = 253  # an object name: a DNS subdomain
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class SliceError(ValueError):
    """A device the API server would refuse in a ResourceSlice."""


@dataclass(frozen=True)
class Version:
    """A semantic-version attribute (a driver's or a compute capability's)."""

    text: str


@dataclass(frozen=True)
class OfferedDevice:
    """One device of the pool: `name` a DNS label, unique on the node."""

    name: str
    memory_bytes: int
    attributes: Mapping[str, str | int | bool | Version] = field(default_factory=dict)
    # Many claims may each take part of its memory (a shared GPU's VRAM lane).
    shared: bool = False
    health: Literal["ok", "unhealthy", "lost"] = "ok"


def _attribute(value: str | int | bool | Version) -> dict[str, Any]:
    if isinstance(value, Version):
        return {"version": value.text}
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    return {"string": value}


def _device(offered: OfferedDevice, added_at: str) -> dict[str, Any]:
    if not _DNS_LABEL.fullmatch(offered.name):
        raise SliceError(f"device name {offered.name!r} is not a DNS label")
    if len(offered.attributes) + 1 > _MAX_FIELDS:
        raise SliceError(f"device {offered.name}: more than {_MAX_FIELDS} attributes")
    memory: dict[str, Any] = {"value": str(offered.memory_bytes)}
    device: dict[str, Any] = {
        "name": offered.name,
        "attributes": {name: _attribute(value) for name, value in offered.attributes.items()},
        "capacity": {"memory": memory},
    }
    if offered.shared:
        whole = offered.memory_bytes - offered.memory_bytes % _GIB
        if whole < _GIB:
            raise SliceError(f"device {offered.name}: less than 1 GiB to share")
        # The value is a whole number of steps: the API server refuses it otherwise.
        memory["value"] = str(whole)
        memory["requestPolicy"] = {
            "default": str(_GIB),
            "validRange": {"min": str(_GIB), "max": str(whole), "step": str(_GIB)},
        }
        device["allowMultipleAllocations"] = True
    if offered.health != "ok":
        effect = "NoExecute" if offered.health == "lost" else "NoSchedule"
        taint = {"key": HEALTH_TAINT, "value": offered.health, "effect": effect}
        device["taints"] = [{**taint, "timeAdded": added_at}]
    return device


def slice_name(node: str, driver: str, index: int) -> str:
    """`<node>-<driver>-<index>`, a DNS subdomain of at most 253 characters: a node name
    too long for it is cut, and a digest of it keeps two such nodes apart."""
    tail = f"-{driver}-{index}"
    if len(node) + len(tail) <= _MAX_NAME:
        return f"{node}{tail}"
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    cut = node[: _MAX_NAME - len(tail) - len(digest) - 1].rstrip(".-")
    return f"{cut}-{digest}{tail}"


def resource_slices(
    node: str,
    devices: Sequence[OfferedDevice],
    *,
    generation: int,
    added_at: str | Mapping[str, str],
    driver: str = DRIVER_NAME,
) -> list[dict[str, Any]]:
    """The pool's slices, in device order (allocation is first fit). `added_at`: when
    a tainted device's taint was first seen (RFC 3339; by device name, or one for all),
    as the API server keeps it: NoExecute's eviction counts from it."""
    names = [d.name for d in devices]
    if len(set(names)) != len(names):
        raise SliceError("device names repeat in the pool")

    def when(name: str) -> str:
        return added_at if isinstance(added_at, str) else added_at.get(name, "")

    built = [_device(d, when(d.name)) for d in devices]
    per_slice = _MAX_TAINTED if any("taints" in d for d in built) else _MAX_DEVICES
    chunks = [built[i : i + per_slice] for i in range(0, len(built), per_slice)] or [[]]
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": slice_name(node, driver, index)},
            "spec": {
                "driver": driver,
                "nodeName": node,
                "pool": {
                    "name": node,
                    "generation": generation,
                    "resourceSliceCount": len(chunks),
                },
                "devices": chunk,
            },
        }
        for index, chunk in enumerate(chunks)
    ]
