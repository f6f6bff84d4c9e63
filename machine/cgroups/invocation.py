"""One invocation's cgroup (one directory per hierarchy): join, usage, kill, remove.

Killing does not trust process groups or sessions, which a guest can leave:
it takes whatever the kernel says is in the cgroup. First `cgroup.kill`
(cgroup v2, Linux 5.14+; on hybrid hosts the controller-less unified tree
offers it too), which kills atomically, forks included. If that is missing or
something is left, the cgroup is frozen (v1 freezer, or v2 cgroup.freeze) so
nothing in it can fork, every task is sent SIGKILL, and it is thawed so the
signal is delivered. Both are repeated until the cgroup is empty or the
deadline passes.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import trio

from machine.cgroups.common import (
    CgroupError,
    CgroupFs,
    CgroupKillFailed,
    CgroupUsage,
    read_control,
    read_keyed,
)
from machine.cgroups.usage import read_usage

__all__ = ["InvocationCgroup"]

log = logging.getLogger(__name__)

KILL_SECONDS = 5.0
REMOVE_SECONDS = 5.0
OOM_POLL_SECONDS = 0.1
# How long cgroup.kill gets before the freezer pass, and a freeze before SIGKILL anyway
# (a task already dying may never report frozen).
_AFTER_CGROUP_KILL_S = 1.0
_FREEZE_S = 0.5
_POLL_S = 0.01


async def _poll(done: Callable[[], bool], seconds: float) -> bool:
    """Whether `done()` held within `seconds`, checked every few milliseconds."""
    deadline = trio.current_time() + seconds
    while not done():
        if trio.current_time() >= deadline:
            return False
        await trio.sleep(_POLL_S)
    return True


@dataclass(eq=False)
class InvocationCgroup:
    name: str
    version: str
    # Role (a v1 controller, or "unified") -> directory; v1 roles may share one.
    dirs: Mapping[str, Path]
    fs: CgroupFs = field(default_factory=CgroupFs)

    def _tops(self) -> list[Path]:
        return list(dict.fromkeys(self.dirs.values()))

    def _tree(self) -> list[Path]:
        """Every directory, nested cgroups first (a root guest could have made some)."""
        found: list[Path] = []
        for top in self._tops():
            try:
                links = os.stat(top).st_nlink
            except FileNotFoundError:
                continue
            if links == 2:
                # No subdirectory (cgroupfs counts them in the link count): listing
                # the dozens of control files to learn that costs more than the rest.
                found.append(top)
                continue
            for here, _subdirs, _files in os.walk(top, topdown=False):
                found.append(Path(here))
        return found

    def preexec_join(self) -> Callable[[], None]:
        """What the child runs between fork and exec (as root) to enter every directory."""
        files = [os.fsencode(top / "cgroup.procs") for top in self._tops()] if self.fs.join else []

        def join() -> None:
            # Runs in the forked child: raw syscalls only, no logging, no locks.
            for name in files:
                fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC)
                try:
                    os.write(fd, b"0")
                finally:
                    os.close(fd)

        return join

    def admit(self, pid: int) -> None:
        """Move process `pid` into every directory, from outside it: for a child that
        waits at its gate, so that nothing runs in the child between fork and exec."""
        if not self.fs.join:
            return
        for top in self._tops():
            try:
                self.fs.write(top / "cgroup.procs", str(pid))
            except OSError as exc:
                detail = f"{self.name}: pid {pid} into {top}: {exc}"
                raise CgroupError("join_failed", detail) from exc

    def usage(self) -> CgroupUsage:
        return read_usage(self.version, self.dirs)

    def grow_memory(self, nbytes: int) -> None:
        """Raise its memory limit by `nbytes` (blocking: cgroupfs writes), for
        something that joins it with a cost of its own: an invocation's lane host."""
        try:
            if self.version == "v1":
                memory = self.dirs["memory"]
                limit = int(read_control(memory / "memory.limit_in_bytes")) + nbytes
                swap = memory / "memory.memsw.limit_in_bytes"
                if swap.exists():  # never below limit_in_bytes: raised first
                    self.fs.write(swap, str(limit))
                self.fs.write(memory / "memory.limit_in_bytes", str(limit))
                return
            control = self.dirs["unified"] / "memory.max"
            current = read_control(control).strip()
            if current != "max":
                self.fs.write(control, str(int(current) + nbytes))
        except (OSError, ValueError, KeyError) as exc:
            raise CgroupError("limit_failed", f"{self.name}: memory: {exc}") from exc

    def pids(self) -> frozenset[int]:
        """Every process in the cgroup, nested cgroups included."""
        found: set[int] = set()
        for path in self._tree():
            try:
                found.update(int(pid) for pid in read_control(path / "cgroup.procs").split())
            except FileNotFoundError:
                continue  # removed meanwhile: nothing in it
            except (OSError, ValueError) as exc:
                raise CgroupError("unreadable", f"{path}/cgroup.procs: {exc}") from exc
        return frozenset(found)

    def finish_if_empty(self) -> tuple[CgroupUsage | None, bool] | None:
        """The common ending in one blocking call (run it off the event loop: cgroupfs
        mkdir, rmdir and reads cost milliseconds of kernel time): if nothing is left in
        the cgroup, its usage (None if unreadable, logged), then every directory
        removed, and whether all went. None when something is still in it: nothing
        was read or removed, so `kill`, `usage` and `remove` must follow."""
        if self.pids():
            return None
        try:
            usage: CgroupUsage | None = self.usage()
        except CgroupError as exc:  # unread counters never keep the cgroup
            log.error("cgroup %s: no usage: %s", self.name, exc)
            usage = None
        removed = True
        for path in self._tree():
            try:
                self.fs.rmdir(path)
            except FileNotFoundError:
                continue
            except OSError:
                removed = False  # EBUSY while the last task is torn down: `remove` waits
        return usage, removed

    async def _empty_within(self, seconds: float) -> bool:
        return await _poll(lambda: not self.pids(), seconds)

    def _write_each(self, control: str, text: str) -> bool:
        wrote = False
        for path in self._tree():
            if (path / control).exists():
                try:
                    self.fs.write(path / control, text)
                    wrote = True
                except OSError as exc:
                    log.warning("cgroup: cannot write %s to %s: %s", text, path / control, exc)
        return wrote

    async def _freeze(self) -> None:
        freezer = self.dirs.get("freezer")
        if freezer is not None:  # v1: freezing the top freezes what is nested
            self.fs.write(freezer / "freezer.state", "FROZEN")
            await _poll(
                lambda: read_control(freezer / "freezer.state").strip() == "FROZEN", _FREEZE_S
            )
            return
        unified = self.dirs.get("unified")
        if unified is not None and (unified / "cgroup.freeze").exists():
            self.fs.write(unified / "cgroup.freeze", "1")
            await _poll(lambda: read_keyed(unified / "cgroup.events").get("frozen") == 1, _FREEZE_S)

    def _thaw(self) -> None:
        freezer = self.dirs.get("freezer")
        unified = self.dirs.get("unified")
        try:
            if freezer is not None:
                self.fs.write(freezer / "freezer.state", "THAWED")
            elif unified is not None and (unified / "cgroup.freeze").exists():
                self.fs.write(unified / "cgroup.freeze", "0")
        except FileNotFoundError:
            pass

    async def _freeze_and_kill(self) -> None:
        # Frozen, nothing in it can fork or exit, so the list read is complete and
        # no pid in it can be reused before the signal lands (it lands on thaw).
        try:
            await self._freeze()
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        finally:
            self._thaw()

    async def kill(self, within: float = KILL_SECONDS) -> None:
        """Return once every process in the cgroup is dead; CgroupKillFailed if not in time."""
        try:
            with trio.move_on_after(within):
                if self._write_each("cgroup.kill", "1") and await self._empty_within(
                    _AFTER_CGROUP_KILL_S
                ):
                    return
                while self.pids():
                    await self._freeze_and_kill()
                    if await self._empty_within(_AFTER_CGROUP_KILL_S):
                        return
        except OSError as exc:  # a freezer file that vanished or refused
            raise CgroupError("kill_failed", f"{self.name}: {exc}") from exc
        left = self.pids()
        if left:
            raise CgroupKillFailed(self.name, left)

    async def kill_after_oom(self, poll: float = OOM_POLL_SECONDS) -> None:
        """Once the OOM killer has struck in the cgroup, kill all of it, then return.

        v2's memory.oom.group makes the kernel do this itself; v1 kills one process
        and leaves the rest running, so the owner runs this beside the work. Returns
        quietly if the cgroup is gone (the work ended first).
        """
        while True:
            try:
                struck = self.usage().oom_killed
            except CgroupError:
                return
            if struck:
                log.warning("cgroup %s: out of memory, ending everything in it", self.name)
                await self.kill()
                return
            await trio.sleep(poll)

    async def remove(self, within: float = REMOVE_SECONDS) -> bool:
        """Kill, then remove every directory; False (logged) if something stayed."""
        try:
            await self.kill(within)
        except CgroupError as exc:
            log.error("cgroup %s not removed: %s", self.name, exc)
            return False
        removed = True
        deadline = trio.current_time() + within
        for path in self._tree():
            removed = await self._rmdir(path, deadline) and removed
        return removed

    async def _rmdir(self, path: Path, deadline: float) -> bool:
        # EBUSY while killed tasks are still being torn down.
        while True:
            try:
                self.fs.rmdir(path)
                return True
            except FileNotFoundError:
                return True
            except OSError as exc:
                if exc.errno != errno.EBUSY or trio.current_time() >= deadline:
                    log.error("cgroup %s: cannot remove %s: %s", self.name, path, exc)
                    return False
            await trio.sleep(_POLL_S)
