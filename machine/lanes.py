"""Lanes: the units a lane owner serialises work on.

A lane is a whole GPU, one MIG instance, or the CPU pool. Its id is derived
from the device uuid by hashing, so it is stable across restarts and machines
agree on nothing a guest could enumerate (it is not an index). A GPU in MIG
mode contributes its MIG instances as lanes, never itself.
"""

from __future__ import annotations

import enum
import hashlib

import msgspec

from machine.inventory import Inventory

__all__ = [
    "CPU_POOL_UUID",
    "ISOLATION_BY_KIND",
    "Isolation",
    "Lane",
    "LaneKind",
    "Requirement",
    "build_lanes",
    "lane_id_for",
]

# The CPU pool has no hardware uuid; a fixed name keeps its lane id stable.
CPU_POOL_UUID = "litegraph-cpu-pool"


class Isolation(enum.StrEnum):
    SHARED = "shared"
    SANDBOX = "sandbox"
    PARTITIONED = "partitioned"
    DEDICATED = "dedicated"


class Requirement(enum.StrEnum):
    """An execution requirement/preference; it never changes which function runs."""

    CPU = "cpu"
    GPU = "gpu"
    AUTO = "auto"


class LaneKind(enum.StrEnum):
    CPU = "cpu"
    GPU = "gpu"
    MIG = "mig"


ISOLATION_BY_KIND: dict[LaneKind, frozenset[Isolation]] = {
    LaneKind.CPU: frozenset({Isolation.SHARED, Isolation.SANDBOX}),
    LaneKind.GPU: frozenset({Isolation.DEDICATED, Isolation.SHARED, Isolation.SANDBOX}),
    LaneKind.MIG: frozenset({Isolation.PARTITIONED}),
}


def lane_id_for(uuid: str) -> str:
    """Opaque, stable lane id: "lane_" + 16 hex of sha256(uuid)."""
    return "lane_" + hashlib.sha256(uuid.encode("utf-8")).hexdigest()[:16]


class Lane(msgspec.Struct, frozen=True, kw_only=True):
    """One lane. `device_id` is the physical GPU uuid (or the CPU pool name);
    `visible_uuid` is what CUDA_VISIBLE_DEVICES names (the MIG uuid for MIG lanes)."""

    lane_id: str
    kind: LaneKind
    device_id: str
    visible_uuid: str | None
    accepts: frozenset[Isolation]
    vram_bytes: int = 0

    @property
    def is_gpu(self) -> bool:
        return self.kind is not LaneKind.CPU


def build_lanes(inventory: Inventory) -> tuple[Lane, ...]:
    """The CPU pool lane first, then GPUs in discovery order (MIG instances for MIG GPUs)."""
    lanes = [
        Lane(
            lane_id=lane_id_for(CPU_POOL_UUID),
            kind=LaneKind.CPU,
            device_id=CPU_POOL_UUID,
            visible_uuid=None,
            accepts=ISOLATION_BY_KIND[LaneKind.CPU],
        )
    ]
    for gpu in inventory.gpus:
        if gpu.mig_enabled:
            lanes.extend(
                Lane(
                    lane_id=lane_id_for(mig.uuid),
                    kind=LaneKind.MIG,
                    device_id=gpu.uuid,
                    visible_uuid=mig.uuid,
                    accepts=ISOLATION_BY_KIND[LaneKind.MIG],
                    vram_bytes=mig.memory_total_bytes,
                )
                for mig in gpu.mig_instances
            )
        else:
            lanes.append(
                Lane(
                    lane_id=lane_id_for(gpu.uuid),
                    kind=LaneKind.GPU,
                    device_id=gpu.uuid,
                    visible_uuid=gpu.uuid,
                    accepts=ISOLATION_BY_KIND[LaneKind.GPU],
                    vram_bytes=gpu.memory_total_bytes,
                )
            )
    return tuple(lanes)
