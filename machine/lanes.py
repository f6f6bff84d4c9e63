"""Lanes: the units a lane owner serialises work on.

A lane is a whole GPU, one MIG instance, or the CPU pool. Its id is derived
from the device uuid by hashing, so it is stable across restarts and machines
agree on nothing a guest could enumerate (it is not an index). A GPU in MIG
mode contributes its MIG instances as lanes, never itself.
"""

from __future__ import annotations

import enum
import hashlib
from typing import Literal

import msgspec

from machine.inventory import Inventory
from machine.sim_vram import cap_vram

__all__ = [
    "CPU_POOL_UUID",
    "ISOLATION_BY_KIND",
    "Isolation",
    "Lane",
    "LaneBackend",
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


# Where a lane's hosts keep buffers and run kernels: CuPy (the lane's CUDA device) or
# NumPy (host memory).
LaneBackend = Literal["numpy", "cupy"]


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
    # Simulated lanes only (their VRAM is host memory): the size the sim file
    # declares; `vram_bytes` is what the host's memory lets the lane hold.
    declared_vram_bytes: int | None = None
    # Its hosts' backend (`array_backend`); None: by kind, so a device lane is CUDA
    # unless it is marked host memory (build_lanes marks simulated ones).
    backend: LaneBackend | None = None

    @property
    def is_gpu(self) -> bool:
        return self.kind is not LaneKind.CPU

    @property
    def array_backend(self) -> LaneBackend:
        """NumPy on the CPU pool and simulated lanes; CuPy on a real GPU or MIG
        instance, which never falls back to host memory: without CUDA the lane is
        unhealthy `cuda_unavailable` instead."""
        if self.backend is not None:
            return self.backend
        return "numpy" if self.kind is LaneKind.CPU else "cupy"


def build_lanes(inventory: Inventory) -> tuple[Lane, ...]:
    """The CPU pool lane first, then GPUs in discovery order (MIG instances for MIG GPUs);
    simulated lanes' VRAM capped to `inventory.vram_limit_bytes` together. Lanes of
    NVML's devices compute with CuPy; the CPU pool and simulated ones with NumPy."""
    device_backend: LaneBackend = "cupy" if inventory.backend == "nvml" else "numpy"
    lanes = [
        Lane(
            lane_id=lane_id_for(CPU_POOL_UUID),
            kind=LaneKind.CPU,
            device_id=CPU_POOL_UUID,
            visible_uuid=None,
            accepts=ISOLATION_BY_KIND[LaneKind.CPU],
            backend="numpy",
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
                    backend=device_backend,
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
                    backend=device_backend,
                )
            )
    if inventory.vram_limit_bytes is None:
        return tuple(lanes)
    # The CPU pool (first) holds no buffers; the device lanes share the limit.
    cpu, devices = lanes[0], lanes[1:]
    granted = cap_vram([lane.vram_bytes for lane in devices], inventory.vram_limit_bytes)
    return (
        cpu,
        *(
            msgspec.structs.replace(lane, vram_bytes=size, declared_vram_bytes=lane.vram_bytes)
            for lane, size in zip(devices, granted, strict=True)
        ),
    )
