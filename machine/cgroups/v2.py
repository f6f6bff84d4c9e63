"""cgroup v2 (the unified hierarchy), with the standard delegation layout.

Invocations get `<the daemon's own cgroup>/litegraph-<name>` with memory.max,
memory.swap.max 0, memory.oom.group 1 (an OOM kill ends the whole
invocation), cpu.max and pids.max. Children only get those controllers once
the parent lists them in cgroup.subtree_control, and v2 allows that only
while the parent itself holds no processes ("no internal processes"). So if
enabling them is refused, the daemon's own processes move to a leaf
`<own>/daemon` first. A daemon found already in that leaf uses its parent.

Device access is not restricted here (v2 does that with BPF programs): a
sandbox's /dev decides it.
"""

from __future__ import annotations

import errno
import os
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

__all__ = ["DAEMON_LEAF", "REQUIRED", "V2Backend", "detect_v2"]

REQUIRED = ("memory", "cpu", "pids")
DAEMON_LEAF = "daemon"


@dataclass(frozen=True)
class V2Backend:
    parent: Path
    fs: CgroupFs
    version: str = "v2"
    restricts_devices: bool = False

    @property
    def parents(self) -> dict[str, Path]:
        return {"unified": self.parent}

    def existing(self, name: str) -> InvocationCgroup:
        path = self.parent / f"{PREFIX}{name}"
        return InvocationCgroup(
            name, self.version, {"unified": path} if path.is_dir() else {}, self.fs
        )

    def create(self, name: str, limits: CgroupLimits) -> InvocationCgroup:
        path = self.parent / f"{PREFIX}{name}"
        try:
            self.fs.mkdir(path)
        except OSError as exc:
            reason = "exists" if isinstance(exc, FileExistsError) else "setup_failed"
            raise CgroupError(reason, f"{name}: {exc}") from exc
        quota, period = cpu_quota(limits.cpu_millis)
        try:
            self.fs.write(path / "memory.max", str(limits.memory_bytes))
            # Optional files: swap accounting (swap.max), Linux 4.19+ (oom.group).
            for control, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                if (path / control).exists():
                    self.fs.write(path / control, value)
            self.fs.write(path / "cpu.max", f"{quota} {period}")
            self.fs.write(path / "pids.max", str(limits.pids_max))
        except OSError as exc:
            try:  # nothing has joined yet, so it is empty
                self.fs.rmdir(path)
            except OSError:
                pass
            raise CgroupError("setup_failed", f"{name}: {exc}") from exc
        return InvocationCgroup(name, self.version, {"unified": path}, self.fs)


def _controllers(path: Path, control: str) -> set[str]:
    return set(read_control(path / control).split())


def _move_to_leaf(parent: Path, fs: CgroupFs) -> None:
    leaf = parent / DAEMON_LEAF
    try:
        fs.mkdir(leaf)
    except FileExistsError:
        pass
    for pid in read_control(parent / "cgroup.procs").split():
        try:
            fs.write(leaf / "cgroup.procs", pid)
        except ProcessLookupError:
            pass  # exited meanwhile


def _enable(parent: Path, fs: CgroupFs) -> None:
    text = " ".join(f"+{c}" for c in REQUIRED)
    try:
        fs.write(parent / "cgroup.subtree_control", text)
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        _move_to_leaf(parent, fs)
        fs.write(parent / "cgroup.subtree_control", text)


def detect_v2(root: Path, relative: str, fs: CgroupFs) -> V2Backend | CgroupsUnavailable:
    own = inside(root, relative)
    if own is None or not (own / "cgroup.procs").is_file():
        return CgroupsUnavailable(f"cgroup v2: own cgroup {relative!r} not found under {root}")
    parent = own
    try:
        if own.name == DAEMON_LEAF and own != root.resolve():
            if set(REQUIRED) <= _controllers(own.parent, "cgroup.subtree_control"):
                parent = own.parent  # moved there by an earlier start
        missing = set(REQUIRED) - _controllers(parent, "cgroup.controllers")
        if missing:
            return CgroupsUnavailable(
                f"cgroup v2: {' '.join(sorted(missing))} not delegated to {parent}"
            )
        if not set(REQUIRED) <= _controllers(parent, "cgroup.subtree_control"):
            _enable(parent, fs)
        missing = set(REQUIRED) - _controllers(parent, "cgroup.subtree_control")
    except OSError as exc:
        return CgroupsUnavailable(f"cgroup v2: cannot enable controllers in {parent}: {exc}")
    if missing:
        return CgroupsUnavailable(f"cgroup v2: {' '.join(sorted(missing))} not enabled in {parent}")
    if not os.access(parent, os.W_OK):
        return CgroupsUnavailable(f"cgroup v2: {parent} not writable")
    return V2Backend(parent, fs)
