"""CPU and memory discovery: psutil for the host, cgroup v2 for the limits we run under.

Capacity is the smaller of what the host has and what our cgroup (and each of
its ancestors) allows: `cpu.max` quota/period, the CPU affinity mask, and
`memory.max`. Available memory is the kernel's MemAvailable (reclaimable page
cache is not "used"); inside a cgroup it is the limit minus usage not counting
inactive file cache. The /sys and /proc roots are parameters so tests can
point them at fake trees.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped,unused-ignore]

from machine.inventory import CpuInfo, MemoryInfo

__all__ = ["CgroupLimits", "discover_host", "read_cgroup_limits", "read_host_memory"]


class CgroupLimits:
    """The tightest cgroup v2 limits on the path from our cgroup to the root."""

    def __init__(
        self,
        cpu_millis: int | None = None,
        memory_bytes: int | None = None,
        memory_used_bytes: int | None = None,
    ) -> None:
        self.cpu_millis = cpu_millis
        self.memory_bytes = memory_bytes
        # Usage of the cgroup that sets the memory limit, less inactive file cache.
        self.memory_used_bytes = memory_used_bytes


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_cgroup(proc_root: Path) -> str | None:
    text = _read(proc_root / "self" / "cgroup")
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith("0::"):  # the unified (v2) hierarchy
            return line[3:] or "/"
    return None


def _cpu_max(text: str | None) -> int | None:
    if not text:
        return None
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota * 1000 // period if period > 0 else None


def _memory_used(directory: Path) -> int | None:
    current = _read(directory / "memory.current")
    if current is None or not current.isdigit():
        return None
    inactive = 0
    for line in (_read(directory / "memory.stat") or "").splitlines():
        key, _, value = line.partition(" ")
        if key == "inactive_file" and value.isdigit():
            inactive = int(value)
    return max(0, int(current) - inactive)


def read_cgroup_limits(
    *, sys_root: Path = Path("/sys"), proc_root: Path = Path("/proc")
) -> CgroupLimits:
    """Walk from our cgroup up to the v2 root, keeping the smallest cpu and memory limit."""
    root = sys_root / "fs" / "cgroup"
    own = _own_cgroup(proc_root)
    if own is None or not (root / "cgroup.controllers").exists():
        return CgroupLimits()
    limits = CgroupLimits()
    directory = root / own.strip("/")
    while True:
        cpu = _cpu_max(_read(directory / "cpu.max"))
        if cpu is not None and (limits.cpu_millis is None or cpu < limits.cpu_millis):
            limits.cpu_millis = cpu
        mem = _read(directory / "memory.max")
        if (
            mem
            and mem.isdigit()
            and (limits.memory_bytes is None or int(mem) < limits.memory_bytes)
        ):
            limits.memory_bytes = int(mem)
            limits.memory_used_bytes = _memory_used(directory)
        if directory == root or root not in directory.parents:
            break
        directory = directory.parent
    return limits


def _cpu_model(proc_root: Path) -> str:
    for line in (_read(proc_root / "cpuinfo") or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model") and value.strip():
            return value.strip()
    return "unknown"


def _numa_nodes(sys_root: Path) -> int | None:
    base = sys_root / "devices" / "system" / "node"
    try:
        nodes = [p for p in base.iterdir() if p.name.startswith("node") and p.name[4:].isdigit()]
    except OSError:
        return None
    return len(nodes) or None


def _affinity_cores(ps: Any) -> int | None:
    try:
        return len(ps.Process().cpu_affinity())
    except (AttributeError, OSError, psutil.Error):
        return None


def discover_host(
    *, sys_root: Path = Path("/sys"), proc_root: Path = Path("/proc"), psutil_module: Any = psutil
) -> tuple[CpuInfo, MemoryInfo]:
    """CPU and memory facts with capacity bounded by cgroup v2 limits (synchronous, cheap)."""
    ps = psutil_module
    limits = read_cgroup_limits(sys_root=sys_root, proc_root=proc_root)
    logical = int(ps.cpu_count(logical=True) or 1)
    physical = ps.cpu_count(logical=False)
    cpu_millis = logical * 1000
    affinity = _affinity_cores(ps)
    if affinity:
        cpu_millis = min(cpu_millis, affinity * 1000)
    if limits.cpu_millis is not None:
        cpu_millis = min(cpu_millis, limits.cpu_millis)
    cpu = CpuInfo(
        logical_cores=logical,
        physical_cores=int(physical) if physical else None,
        model=_cpu_model(proc_root),
        numa_nodes=_numa_nodes(sys_root),
        capacity_millis=cpu_millis,
        cgroup_limit_millis=limits.cpu_millis,
    )
    return cpu, _memory(ps, limits)


def _memory(ps: Any, limits: CgroupLimits) -> MemoryInfo:
    vm = ps.virtual_memory()
    total, available = int(vm.total), int(vm.available)
    capacity = total
    if limits.memory_bytes is not None:
        capacity = min(total, limits.memory_bytes)
        if limits.memory_used_bytes is not None:
            available = min(available, max(0, limits.memory_bytes - limits.memory_used_bytes))
        available = min(available, capacity)
    return MemoryInfo(
        total_bytes=total,
        available_bytes=available,
        capacity_bytes=capacity,
        cgroup_limit_bytes=limits.memory_bytes,
    )


def read_host_memory(
    *, sys_root: Path = Path("/sys"), proc_root: Path = Path("/proc"), psutil_module: Any = psutil
) -> MemoryInfo:
    """Memory facts as they are now (each health probe reads them again; synchronous, cheap)."""
    return _memory(psutil_module, read_cgroup_limits(sys_root=sys_root, proc_root=proc_root))
