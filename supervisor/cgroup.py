"""Per-invocation cgroup v2 for a memory limit the kernel enforces.

The daemon creates `<its own cgroup>/litegraph-<name>`, writes `memory.max`,
and the child joins it between fork and exec (writing "0" to `cgroup.procs`).
When the invocation ends the cgroup is killed (`cgroup.kill`, which also
reaches processes that left the process group) and removed.

Detection is "can we really do it", never a guess: the daemon's cgroup (from
/proc/self/cgroup) must already exist with a `cgroup.subtree_control` that
offers the memory controller, and the child directory must accept
`memory.max`. On a host without a writable cgroup v2 tree (cgroup v1, a
read-only mount, no delegation) `create` returns None and the caller decides
on a fallback. Note that /sys/fs/cgroup can be a plain tmpfs (hybrid v1
hosts): anything can be written there, which is why the parent's
`cgroup.subtree_control` is read (never created) before anything else.

The root, the /proc file and removal are injectable so tests can run against
a directory that imitates cgroupfs.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

__all__ = ["CGROUP_NAME_RE", "CgroupV2"]

log = logging.getLogger(__name__)

# The name becomes a path component: no separators, no dots-only names.
CGROUP_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")

_PREFIX = "litegraph-"
# rmdir fails with EBUSY while killed processes are still being torn down.
_REMOVE_WAIT_SECONDS = 2.0
_REMOVE_POLL_SECONDS = 0.02


def _write(path: Path, text: str, *, create: bool = False) -> None:
    # Without O_CREAT a missing control file is an error, not a new plain file.
    flags = os.O_WRONLY | os.O_TRUNC | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


@dataclass(frozen=True)
class CgroupV2:
    """Where and how invocation cgroups are made."""

    root: Path = Path("/sys/fs/cgroup")
    self_cgroup: Path = Path("/proc/self/cgroup")
    # Tests against a plain directory can skip moving the child.
    join: bool = True
    # cgroupfs directories are removed with rmdir (their files are virtual).
    remove_dir: Callable[[Path], None] = field(default=os.rmdir)

    def parent(self) -> Path | None:
        """The daemon's own cgroup v2 directory, if it offers the memory controller."""
        try:
            lines = self.self_cgroup.read_text().splitlines()
        except OSError:
            return None
        relative = next((line[3:] for line in lines if line.startswith("0::")), None)
        if relative is None:
            return None
        base = (self.root / relative.lstrip("/")).resolve()
        if base != self.root.resolve() and self.root.resolve() not in base.parents:
            return None
        control = base / "cgroup.subtree_control"
        try:
            enabled = control.read_text().split()
            if "memory" not in enabled:
                # Only works when the daemon's cgroup holds no processes itself
                # (cgroup v2's "no internal processes" rule); worth one try.
                _write(control, "+memory")
                enabled = control.read_text().split()
        except OSError:
            return None
        return base if "memory" in enabled else None

    def create(self, name: str, memory_max: int) -> Path | None:
        """Make `litegraph-<name>` with memory.max; None when cgroups are not usable here."""
        if not CGROUP_NAME_RE.fullmatch(name):
            raise ValueError(f"invalid cgroup name {name!r}")
        if memory_max <= 0:
            raise ValueError(f"memory_max must be > 0, got {memory_max}")
        parent = self.parent()
        if parent is None:
            return None
        path = parent / f"{_PREFIX}{name}"
        try:
            path.mkdir()
        except FileExistsError:
            # A leftover of a crashed daemon; reuse it only once it is empty.
            try:
                self.remove_dir(path)
                path.mkdir()
            except OSError as exc:
                log.warning("cgroup %s exists and cannot be replaced: %s", path, exc)
                return None
        except OSError as exc:
            log.info("cannot create cgroup %s: %s", path, exc)
            return None
        try:
            _write(path / "memory.max", str(memory_max), create=True)
            for control, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                # Optional: no swapping around the limit; an OOM ends the whole invocation.
                if (path / control).exists():
                    _write(path / control, value)
        except OSError as exc:
            log.info("cannot set memory.max in %s: %s", path, exc)
            self._remove_now(path)
            return None
        return path

    def preexec_join(self, path: Path) -> Callable[[], None] | None:
        """What the child runs between fork and exec to enter `path` (None: skip)."""
        if not self.join:
            return None
        procs = os.fsencode(path / "cgroup.procs")

        def join() -> None:
            # Runs in the forked child: raw syscalls only, no logging, no locks.
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

        return join

    def kill(self, path: Path) -> None:
        """SIGKILL everything in the cgroup (Linux 5.14+); a no-op where unsupported."""
        try:
            _write(path / "cgroup.kill", "1")
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cgroup.kill failed for %s: %s", path, exc)

    async def remove(self, path: Path) -> bool:
        """Kill what is left in the cgroup and remove it; False if it stayed (logged)."""
        self.kill(path)
        with trio.move_on_after(_REMOVE_WAIT_SECONDS):
            while True:
                try:
                    self.remove_dir(path)
                    return True
                except FileNotFoundError:
                    return True
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        log.warning("cannot remove cgroup %s: %s", path, exc)
                        return False
                await trio.sleep(_REMOVE_POLL_SECONDS)
        log.warning("cgroup %s still busy after %.1f s; left in place", path, _REMOVE_WAIT_SECONDS)
        return False

    def _remove_now(self, path: Path) -> None:
        try:
            self.remove_dir(path)
        except OSError as exc:
            log.warning("cannot remove cgroup %s: %s", path, exc)
