"""The simulated backend: an Inventory of CPU, RAM, GPUs and MIG instances from a sim
file, whose devices then follow its fault and load timeline.

The file and its checks: machine/sim_spec.py; the timeline: machine/sim_timeline.py.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import trio

from machine.capacity_notes import simulated_vram_note
from machine.inventory import CpuInfo, GpuDevice, Inventory, MemoryInfo, MigInstance
from machine.lanes import build_lanes
from machine.sim_spec import (
    BUILTIN_SIM_FILE,
    FaultKind,
    SimError,
    SimGpu,
    SimSpec,
    load_sim_spec,
    parse_size,
)
from machine.sim_timeline import SimDeviceSource, SimHostMemory
from machine.sim_vram import vram_limit

# The names other code imports from here, wherever they now live.
__all__ = [
    "BUILTIN_SIM_FILE",
    "FaultKind",
    "SimDeviceSource",
    "SimError",
    "SimHostMemory",
    "SimSpec",
    "discover_sim",
    "load_sim_spec",
    "parse_size",
]


def _gpu(spec: SimGpu, index: int) -> GpuDevice:
    total, used = parse_size(spec.memory), parse_size(spec.memory_used)
    return GpuDevice(
        uuid=spec.uuid,
        name=spec.name,
        pci_bus_id=spec.pci_bus_id,
        memory_total_bytes=total,
        memory_used_bytes=used,
        memory_free_bytes=total - used,
        compute_capability=spec.compute_capability,
        mig_enabled=spec.mig_enabled,
        mig_instances=tuple(
            MigInstance(
                uuid=m.uuid,
                name=m.name,
                memory_total_bytes=parse_size(m.memory),
                memory_used_bytes=parse_size(m.memory_used),
                gpu_instance_id=m.gpu_instance_id,
            )
            for m in spec.mig
        ),
        minor_number=index,
    )


async def discover_sim(
    spec: SimSpec,
    *,
    host: tuple[CpuInfo, MemoryInfo],
    host_memory: Callable[[], MemoryInfo] | None = None,
) -> Inventory:
    """An Inventory from the spec; CPU/RAM sections it omits come from `host` (and are
    read again through `host_memory`). The lanes' VRAM is capped to `host`'s real
    memory (machine/sim_vram.py), never to what the spec's RAM section claims."""
    cpu, memory = host
    limit = vram_limit(memory)
    start = trio.current_time()
    if spec.cpu is not None:
        c = spec.cpu
        cpu = CpuInfo(
            logical_cores=c.logical_cores,
            physical_cores=c.physical_cores,
            model=c.model,
            numa_nodes=c.numa_nodes,
            capacity_millis=c.logical_cores * 1000,
        )
    if spec.memory is not None:
        total = parse_size(spec.memory.total)
        avail = parse_size(spec.memory.available) if spec.memory.available is not None else total
        memory = MemoryInfo(
            total_bytes=total, available_bytes=min(avail, total), capacity_bytes=total
        )
        host_memory = SimHostMemory(memory, spec.memory.timeline, start=start)
        memory = host_memory()
    source = SimDeviceSource(spec, start=start)
    probes = await source.probe()
    found = Inventory(
        backend="sim",
        cpu=cpu,
        memory=memory,
        gpus=tuple(_gpu(g, index) for index, g in enumerate(spec.gpus)),
        driver_version=spec.driver_version,
        cuda_version=spec.cuda_version,
        probes=tuple(probes),
        source=source,
        host_memory=host_memory,
        vram_limit_bytes=limit,
    )
    note = simulated_vram_note(build_lanes(found), memory=host[1])
    return found if note is None else msgspec.structs.replace(found, notes=(*found.notes, note))
