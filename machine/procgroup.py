"""Ending process groups: SIGTERM, a grace period for them to empty, then SIGKILL.

Shared by the supervisor (which ends the groups it started) and by reconcile
after a restart (which ends the groups a dead daemon left behind). "Empty"
means no member that is not a zombie: a zombie holds no resources, and an
orphaned one is reaped only when init gets to it (lazily by some container
inits, never by a daemon running as PID 1 without one).

Several groups are ended together: all get SIGTERM at once and share one
grace period, so N stubborn groups take one grace, not N.

`signal_group` refuses a group id of 1 or less and the daemon's own group:
kill(-1) reaches every process, kill(0) the daemon's own group.

A sandboxed guest is ended differently (`terminate_sandbox`): its group holds only
bubblewrap, which does not pass SIGTERM on. It dies of it at once, and its init (pid
1 of the guest's pid namespace, a session of its own) dies with it, so the kernel
SIGKILLs everything in the namespace: the guest's own TERM handler never runs.
SIGTERM goes instead to the guest's own processes, every descendant of that init, the
first of them (litegraph-gate's keeper, where `make` built it) first: the keeper then
waits for all of them, and bubblewrap exits once it has, taking any rest along.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Collection, Iterable
from typing import Protocol

import trio

from machine.proc import ProcStat, iter_stats, read_stat

__all__ = [
    "KILL_WAIT_SECONDS",
    "POLL_SECONDS",
    "Leader",
    "group_has_live_member",
    "group_members",
    "live_groups",
    "sandbox_guest",
    "signal_group",
    "signal_process",
    "terminate_group",
    "terminate_groups",
    "terminate_sandbox",
    "wait_group_gone",
    "wait_groups_gone",
]

log = logging.getLogger(__name__)

POLL_SECONDS = 0.05
# After SIGKILL: how long to wait for the kernel to tear the group down.
KILL_WAIT_SECONDS = 3.0


def signal_group(pgid: int, signum: int) -> bool:
    """Send `signum` to the group; False if the group no longer exists.

    Raises ValueError for a group id that is not a process group we could have
    started: <= 1 (kill(-1) is every process, killpg(0) our own group) or ours.
    """
    if pgid <= 1 or pgid == os.getpgrp():
        raise ValueError(f"refusing to signal process group {pgid}")
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    return True


def signal_process(stat: ProcStat, signum: int) -> bool:
    """Send `signum` to the process `stat` describes, and only to it: through a pidfd,
    once its start time shows the pid still names that process. False if it is gone."""
    try:
        pidfd = os.pidfd_open(stat.pid)
    except OSError:
        return False
    try:
        now = read_stat(stat.pid)
        if now is None or now.start_ticks != stat.start_ticks or not now.alive:
            return False
        signal.pidfd_send_signal(pidfd, signum)
    except OSError:
        return False
    finally:
        os.close(pidfd)
    return True


def sandbox_guest(leader: int, among: Iterable[int] | None = None) -> list[ProcStat]:
    """The live processes of a sandboxed guest: every descendant of the sandbox's init,
    the child of `leader` (bubblewrap, our own child) that is pid 1 of the guest's pid
    namespace; the init itself is not one. [] before the sandbox runs the guest, after
    the guest has gone, or when /proc cannot be read. Orphans in the namespace are
    reparented to that init, so none is missed by a double fork.

    `among`: the pids that can be in the sandbox (its cgroup's), read instead of all
    of /proc, whose scan costs milliseconds of CPU on a busy host. A leader that has
    exited took the sandbox with it (its init dies with it, and the kernel kills the
    rest of the namespace): nothing is read then."""
    own = read_stat(leader)
    if own is None or not own.alive:
        return []
    if among is None:
        stats = iter_stats()
    else:
        stats = (stat for stat in map(read_stat, among) if stat is not None)
    if stats is None:
        return []
    children: dict[int, list[ProcStat]] = {}
    for stat in stats:
        children.setdefault(stat.ppid, []).append(stat)
    found: list[ProcStat] = []
    todo = [init.pid for init in children.get(leader, ())]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child.pid)
    return [stat for stat in found if stat.alive]


def live_groups(pgids: Collection[int]) -> set[int]:
    """Those of `pgids` that still have a live (not zombie) member.

    kill(-pgid, 0) alone counts zombies, so /proc is scanned as well, once for
    all of them. When /proc cannot be read every group counts as alive.
    """
    existing = {pgid for pgid in pgids if signal_group(pgid, 0)}
    if not existing:
        return set()
    stats = iter_stats()
    if stats is None:
        return existing
    return {stat.pgrp for stat in stats if stat.alive and stat.pgrp in existing}


def group_members(pgid: int) -> list[ProcStat]:
    """The group's live (not zombie) members; [] when it has none or /proc is unreadable."""
    if not signal_group(pgid, 0):
        return []
    stats = iter_stats()
    return [] if stats is None else [s for s in stats if s.alive and s.pgrp == pgid]


def group_has_live_member(pgid: int) -> bool:
    """True while a process of the group exists that is not a zombie."""
    return bool(live_groups((pgid,)))


async def wait_groups_gone(pgids: Collection[int], seconds: float) -> set[int]:
    """Wait up to `seconds` for every group to empty; returns those still alive."""
    left = live_groups(pgids)
    with trio.move_on_after(seconds):
        # The kernel offers no event for "group empty" (a pidfd covers one process).
        while left:
            await trio.sleep(POLL_SECONDS)
            left = live_groups(left)
    return left


class Leader(Protocol):
    """Our own child leading the group (trio.Process, or the supervisor's own)."""

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...


async def wait_group_gone(pgid: int, seconds: float, leader: Leader | None = None) -> bool:
    """Wait up to `seconds` for the group to empty; `leader`, our own child, is reaped."""
    deadline = trio.current_time() + seconds
    if leader is not None:
        # Our own child stays a zombie (still a group member) until reaped.
        with trio.move_on_at(deadline):
            await leader.wait()
        if leader.returncode is None:
            return False
    return not await wait_groups_gone((pgid,), max(0.0, deadline - trio.current_time()))


async def _graced(pgid: int, grace: float, leader: Leader | None, hurry: trio.Event | None) -> bool:
    """`wait_group_gone` for the grace, cut short once `hurry` is set."""
    if hurry is None:
        return await wait_group_gone(pgid, grace, leader)
    gone = False
    async with trio.open_nursery() as nursery:

        async def cut_short() -> None:
            await hurry.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(cut_short)
        gone = await wait_group_gone(pgid, grace, leader)
        nursery.cancel_scope.cancel()
    return gone


async def terminate_group(
    pgid: int,
    grace: float,
    *,
    leader: Leader | None = None,
    kill_wait: float = KILL_WAIT_SECONDS,
    hurry: trio.Event | None = None,
) -> bool:
    """SIGTERM the process group, wait up to `grace` for it to empty, then SIGKILL.
    `hurry`, once set (a second Ctrl-C of the daemon), cuts the grace short.

    `leader`, when the group leader is our own child, is reaped along the way.
    Returns True once the group is empty, False if it survived SIGKILL for
    `kill_wait` seconds (logged; like Slurm's "kill task failed", the caller
    should treat what it held as suspect). Callers on a cancellation path run
    this under a shielded scope with a deadline.
    """
    if not signal_group(pgid, signal.SIGTERM) and leader is None:
        return True
    if await _graced(pgid, grace, leader, hurry):
        return True
    log.info("process group %d still alive %.1f s after SIGTERM; sending SIGKILL", pgid, grace)
    signal_group(pgid, signal.SIGKILL)
    if await wait_group_gone(pgid, kill_wait, leader):
        return True
    log.error("process group %d survived SIGKILL", pgid)
    return False


async def terminate_sandbox(
    pgid: int,
    grace: float,
    *,
    leader: Leader,
    kill_wait: float = KILL_WAIT_SECONDS,
    members: Callable[[], Iterable[int] | None] | None = None,
    hurry: trio.Event | None = None,
) -> bool:
    """End a sandboxed guest whose bubblewrap, our own child `leader`, leads group
    `pgid` (its pid): SIGTERM to the guest's own processes (`sandbox_guest`: the
    sandbox's first process, the keeper, before its descendants), never to bubblewrap;
    up to `grace` for bubblewrap to exit (once that first process has: the keeper,
    once every guest process has) and the group to empty; then SIGKILL to the group, which
    takes the whole sandbox (its init dies with bubblewrap, and the kernel kills the
    rest of its namespace), and to the guest's processes. Before the guest runs (at
    its gate) or after it is gone, this is `terminate_group`. Returns as
    `terminate_group` does; callers run it shielded with a deadline too. `members`:
    what may be in the sandbox (its cgroup's pids; see `sandbox_guest`), or None when
    that cannot be read (all of /proc is then). `hurry` as for `terminate_group`."""
    guest = sandbox_guest(pgid, None if members is None else members())
    if not guest or not [stat for stat in guest if signal_process(stat, signal.SIGTERM)]:
        return await terminate_group(pgid, grace, leader=leader, kill_wait=kill_wait, hurry=hurry)
    # The keeper may have forked its guest after the list was read, and had its own
    # SIGTERM too late to pass it on: once more, for what was not there before.
    signalled = {(stat.pid, stat.start_ticks) for stat in guest}
    for stat in sandbox_guest(pgid, None if members is None else members()):
        if (stat.pid, stat.start_ticks) not in signalled:
            signal_process(stat, signal.SIGTERM)
    if await _graced(pgid, grace, leader, hurry):
        return True
    log.info(
        "sandbox %d still alive %.1f s after SIGTERM to its guest; sending SIGKILL", pgid, grace
    )
    # bubblewrap's death takes the sandbox (--die-with-parent); its guest goes directly too.
    signal_group(pgid, signal.SIGKILL)
    for stat in sandbox_guest(pgid, None if members is None else members()):
        signal_process(stat, signal.SIGKILL)
    if await wait_group_gone(pgid, kill_wait, leader):
        return True
    log.error("process group %d survived SIGKILL", pgid)
    return False


async def terminate_groups(
    pgids: Collection[int],
    grace: float,
    *,
    kill_wait: float = KILL_WAIT_SECONDS,
    still_ours: Callable[[int], bool],
) -> set[int]:
    """End several groups at once: SIGTERM to all, one `grace` for all, then SIGKILL.

    `still_ours(pgid)` is asked right before SIGKILL; False means the group id
    no longer names the group meant (it emptied and the id was reused), so
    nothing more is sent to it. Returns the groups still alive `kill_wait`
    seconds after SIGKILL (each logged). The whole takes at most about
    grace + kill_wait, however many groups there are.
    """
    signalled = {pgid for pgid in pgids if signal_group(pgid, signal.SIGTERM)}
    left = await wait_groups_gone(signalled, grace)
    changed = {pgid for pgid in left if not still_ours(pgid)}
    for pgid in sorted(changed):
        log.warning("process group %d changed hands during its grace period; left alone", pgid)
    left -= changed
    for pgid in sorted(left):
        log.info("process group %d still alive %.1f s after SIGTERM; sending SIGKILL", pgid, grace)
        signal_group(pgid, signal.SIGKILL)
    survivors = await wait_groups_gone(left, kill_wait)
    for pgid in sorted(survivors):
        log.error("process group %d survived SIGKILL", pgid)
    return survivors
