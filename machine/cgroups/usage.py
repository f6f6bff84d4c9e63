"""Reading what an invocation cgroup used and which limits it hit, per version."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from machine.cgroups.common import CgroupError, CgroupUsage, read_control, read_keyed

__all__ = ["read_usage"]


def _v1(dirs: Mapping[str, Path]) -> CgroupUsage:
    memory = dirs["memory"]
    return CgroupUsage(
        cpu_seconds=int(read_control(dirs["cpuacct"] / "cpuacct.usage")) / 1e9,
        peak_memory_bytes=int(read_control(memory / "memory.max_usage_in_bytes")),
        # v1's OOM counter (memory.failcnt also counts reclaims that succeeded).
        oom_killed=read_keyed(memory / "memory.oom_control").get("oom_kill", 0) > 0,
        pids_limit_hit=read_keyed(dirs["pids"] / "pids.events").get("max", 0) > 0,
    )


def _v2(path: Path) -> CgroupUsage:
    peak = path / "memory.peak"  # Linux 5.19+
    return CgroupUsage(
        cpu_seconds=read_keyed(path / "cpu.stat").get("usage_usec", 0) / 1e6,
        peak_memory_bytes=int(read_control(peak)) if peak.exists() else None,
        oom_killed=read_keyed(path / "memory.events").get("oom_kill", 0) > 0,
        pids_limit_hit=read_keyed(path / "pids.events").get("max", 0) > 0,
    )


def read_usage(version: str, dirs: Mapping[str, Path]) -> CgroupUsage:
    try:
        return _v1(dirs) if version == "v1" else _v2(dirs["unified"])
    except (OSError, ValueError, KeyError) as exc:
        raise CgroupError("usage_unreadable", f"{exc}") from exc
