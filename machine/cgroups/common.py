"""What every cgroup version shares: limits, usage, errors and control-file I/O.

/sys/fs/cgroup can be a plain tmpfs (hybrid v1 hosts), where opening a
missing file with O_CREAT would silently make an ordinary file. Control files
are therefore opened without O_CREAT: a missing one is an error.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CGROUP_NAME_RE",
    "PREFIX",
    "CgroupError",
    "CgroupFs",
    "CgroupKillFailed",
    "CgroupLimits",
    "CgroupUsage",
    "CgroupsUnavailable",
    "cpu_quota",
    "inside",
    "pool_cgroup_prefix",
    "read_control",
    "read_keyed",
    "write_control",
]

# Every invocation cgroup is `<parent>/litegraph-<name>`.
PREFIX = "litegraph-"
# The name becomes a path component: no separators, no dots-only names.
CGROUP_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


def pool_cgroup_prefix(state_dir: Path) -> str:
    """How the names of one state folder's ready sandboxes' cgroups start
    (`supervisor/sandbox_pool.py`): `_` starts no invocation id, and the tag is the
    folder's, so a restart removes what its own pool left and no other daemon's."""
    tag = hashlib.sha256(os.path.realpath(state_dir).encode()).hexdigest()[:12]
    return f"_pool-{tag}-"


class CgroupError(RuntimeError):
    """A cgroup could not be made, read or emptied; `reason` is a short stable word."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class CgroupKillFailed(CgroupError):
    """Processes were still in the cgroup when the kill's deadline passed."""

    def __init__(self, name: str, pids: frozenset[int]) -> None:
        super().__init__("kill_failed", f"{name} still holds processes {sorted(pids)}")
        self.pids = pids


@dataclass(frozen=True)
class CgroupsUnavailable:
    """Why this host cannot enforce limits with cgroups (one line, for /readyz and logs)."""

    reason: str


@dataclass(frozen=True)
class CgroupLimits:
    memory_bytes: int
    # The quota in thousandths of a CPU: 200 is a fifth of one CPU.
    cpu_millis: int
    pids_max: int
    # Device node paths the guest may open (v1 devices controller); None: no restriction.
    devices: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "cpu_millis", "pids_max"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if self.devices is not None and not all(isinstance(d, str) for d in self.devices):
            raise ValueError("devices must be a tuple of paths")


@dataclass(frozen=True)
class CgroupUsage:
    cpu_seconds: float
    peak_memory_bytes: int | None
    # The kernel's OOM killer killed something in the cgroup.
    oom_killed: bool
    # A fork was refused because of pids.max.
    pids_limit_hit: bool


def write_control(path: Path, text: str) -> None:
    # O_TRUNC lets a directory that imitates cgroupfs hold the last value written.
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read_control(path: Path) -> str:
    return path.read_text()


def read_keyed(path: Path) -> dict[str, int]:
    """A `key value` per line file (cpu.stat, memory.events, pids.events, oom_control)."""
    found: dict[str, int] = {}
    for line in read_control(path).splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            found[key] = int(value)
    return found


@dataclass(frozen=True)
class CgroupFs:
    """How directories are made, removed and written; tests swap these to imitate cgroupfs."""

    mkdir: Callable[[Path], None] = os.mkdir
    # cgroupfs directories go with rmdir (their files are virtual).
    rmdir: Callable[[Path], None] = os.rmdir
    write: Callable[[Path, str], None] = write_control
    # False: the child does not join (a plain directory cannot take a process).
    join: bool = True


def inside(base: Path, relative: str) -> Path | None:
    """`base/relative`, or None if `relative` leads outside `base`."""
    path = (base / relative.lstrip("/")).resolve()
    top = base.resolve()
    return path if path == top or top in path.parents else None


# A guest's start-up (fork, joining its cgroups, the sandbox, exec) takes a few ms of
# CPU. Under a quota smaller than that per period it is throttled for whole periods
# (`true` in its sandbox on a 20 milli-CPU grant: 7 ms of CPU spread over 300 ms).
# So a small grant gets a longer period, at most the kernel's 1 s, such that one
# period's quota holds START_QUOTA_US: the long-run share is the grant either way.
START_QUOTA_US = 20_000
MIN_PERIOD_US = 100_000
MAX_PERIOD_US = 1_000_000


def cpu_quota(cpu_millis: int) -> tuple[int, int]:
    """(quota, period) in microseconds for `cpu_millis` thousandths of a CPU.

    The period is 100 ms, or longer (up to 1 s) for a small grant, so that one
    period's quota holds START_QUOTA_US of CPU (a start-up runs unthrottled) and
    is never under the kernel's 1 ms minimum.
    """
    wanted = START_QUOTA_US * 1000 // max(1, cpu_millis)
    period = min(MAX_PERIOD_US, max(MIN_PERIOD_US, wanted))
    return cpu_millis * period // 1000, period
