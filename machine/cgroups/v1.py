"""cgroup v1: one hierarchy per controller (hybrid hosts add a controller-less cgroup2).

Each invocation gets `<the daemon's own cgroup in that hierarchy>/litegraph-<name>`
in memory, cpu, cpuacct, pids, freezer, devices (when mounted) and the unified
tree (when mounted, for cgroup.kill). Limits:

- memory: memory.swappiness 0, memory.limit_in_bytes, then memory.memsw.limit_in_bytes
  (swap accounting only; it must not be below limit_in_bytes, so it comes second).
- cpu: cpu.cfs_period_us and cpu.cfs_quota_us (CPU time in cpuacct.usage), the
  quota cut down to the daemon's own share if an ancestor has a smaller one.
- pids: pids.max.
- devices: deny everything, then allow what a sandbox's /dev needs plus the
  granted nodes (their major:minor, read from the node itself).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from machine.cgroups.common import (
    PREFIX,
    CgroupError,
    CgroupFs,
    CgroupLimits,
    CgroupsUnavailable,
    cpu_quota,
    inside,
    read_control,
)
from machine.cgroups.invocation import InvocationCgroup

__all__ = ["BASE_DEVICES", "REQUIRED", "V1Backend", "cpu_ceiling", "detect_v1", "device_rules"]

REQUIRED = ("memory", "cpu", "cpuacct", "pids", "freezer")
_OPTIONAL = ("devices",)

# What bubblewrap's --dev binds from the host (null, zero, full, random, urandom,
# tty), the pty multiplexer and the ptys.
BASE_DEVICES = (
    "c 1:3 rwm",
    "c 1:5 rwm",
    "c 1:7 rwm",
    "c 1:8 rwm",
    "c 1:9 rwm",
    "c 5:0 rwm",
    "c 5:2 rwm",
    "c 136:* rwm",
)


def device_rules(paths: tuple[str, ...]) -> list[str]:
    """`devices.allow` lines for the granted nodes; CgroupError if one is not a node."""
    rules = []
    for path in paths:
        try:
            mode = os.stat(path)
        except OSError as exc:
            raise CgroupError("device_unreadable", f"{path}: {exc}") from exc
        if stat.S_ISCHR(mode.st_mode):
            kind = "c"
        elif stat.S_ISBLK(mode.st_mode):
            kind = "b"
        else:
            raise CgroupError("not_a_device", f"{path} is not a device node")
        rules.append(f"{kind} {os.major(mode.st_rdev)}:{os.minor(mode.st_rdev)} rwm")
    return rules


def cpu_ceiling(parent: Path) -> float | None:
    """The tightest CPU share (in CPUs) set on `parent` or above it, None if none is.

    v1 refuses (EINVAL) a quota above an ancestor's, where v2 would just apply
    the smaller one: so a grant is cut down to what the daemon itself may use.
    """
    shares = []
    for path in (parent, *parent.parents):
        try:
            quota = int(read_control(path / "cpu.cfs_quota_us"))
            period = int(read_control(path / "cpu.cfs_period_us"))
        except (OSError, ValueError):
            break  # above the hierarchy's root
        if quota > 0 and period > 0:
            shares.append(quota / period)
    return min(shares, default=None)


@dataclass(frozen=True)
class V1Backend:
    # Role -> the daemon's own cgroup in that hierarchy (roles may share a directory).
    parents: Mapping[str, Path]
    fs: CgroupFs
    version: str = "v1"

    @property
    def restricts_devices(self) -> bool:
        return "devices" in self.parents

    def existing(self, name: str) -> InvocationCgroup:
        dirs = {role: p / f"{PREFIX}{name}" for role, p in self.parents.items()}
        return InvocationCgroup(
            name, self.version, {r: d for r, d in dirs.items() if d.is_dir()}, self.fs
        )

    def create(self, name: str, limits: CgroupLimits) -> InvocationCgroup:
        rules = None if limits.devices is None else device_rules(limits.devices)
        if rules is not None and "devices" not in self.parents:
            raise CgroupError("devices_unsupported", "no cgroup v1 devices hierarchy")
        made: dict[Path, Path] = {}
        dirs: dict[str, Path] = {}
        try:
            for role, parent in self.parents.items():
                if parent not in made:
                    self.fs.mkdir(parent / f"{PREFIX}{name}")  # never someone else's
                    made[parent] = parent / f"{PREFIX}{name}"
                dirs[role] = made[parent]
            self._limit(dirs, limits, rules)
        except OSError as exc:
            for path in reversed(made.values()):
                try:  # nothing has joined yet, so these are empty
                    self.fs.rmdir(path)
                except OSError:
                    pass
            reason = "exists" if isinstance(exc, FileExistsError) else "setup_failed"
            raise CgroupError(reason, f"{name}: {exc}") from exc
        return InvocationCgroup(name, self.version, dirs, self.fs)

    def _limit(self, dirs: dict[str, Path], limits: CgroupLimits, rules: list[str] | None) -> None:
        write = self.fs.write
        memory = dirs["memory"]
        write(memory / "memory.swappiness", "0")
        write(memory / "memory.limit_in_bytes", str(limits.memory_bytes))
        if (memory / "memory.memsw.limit_in_bytes").exists():
            write(memory / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        quota, period = cpu_quota(limits.cpu_millis)
        ceiling = cpu_ceiling(self.parents["cpu"])
        if ceiling is not None:
            quota = max(1000, min(quota, int(ceiling * period)))
        write(dirs["cpu"] / "cpu.cfs_period_us", str(period))
        write(dirs["cpu"] / "cpu.cfs_quota_us", str(quota))
        write(dirs["pids"] / "pids.max", str(limits.pids_max))
        if rules is not None:
            write(dirs["devices"] / "devices.deny", "a")
            for rule in (*BASE_DEVICES, *rules):
                write(dirs["devices"] / "devices.allow", rule)


def _hierarchy(root: Path, controller: str, mounted_as: str, relative: str) -> Path | None:
    """The daemon's cgroup for `controller`, if it is a real cgroup directory."""
    for mount in (root / controller, root / mounted_as):
        path = inside(mount, relative) if mount.is_dir() else None
        # A plain tmpfs directory has no cgroup.procs.
        if path is not None and (path / "cgroup.procs").is_file():
            return path
    return None


def detect_v1(
    root: Path, v1: Mapping[str, tuple[str, str]], unified: str | None, fs: CgroupFs
) -> V1Backend | CgroupsUnavailable:
    """`v1`: controller -> (its mount's name, e.g. "cpu,cpuacct"; the daemon's path)."""
    parents: dict[str, Path] = {}
    for controller in (*REQUIRED, *_OPTIONAL):
        if controller in v1:
            path = _hierarchy(root, controller, *v1[controller])
            if path is not None:
                parents[controller] = path
    missing = [c for c in REQUIRED if c not in parents]
    if missing:
        return CgroupsUnavailable(f"cgroup v1 without the {', '.join(missing)} hierarchy")
    if unified is not None:
        path = _hierarchy(root, "unified", "unified", unified)
        if path is not None:
            parents["unified"] = path
    read_only = [str(p) for p in parents.values() if not os.access(p, os.W_OK)]
    if read_only:
        return CgroupsUnavailable(f"cgroup v1 hierarchy not writable: {read_only[0]}")
    return V1Backend(parents, fs)
