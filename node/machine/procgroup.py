"""Ending a process group: SIGTERM, a grace period for it to empty, then SIGKILL.

Shared by the supervisor (which ends the groups it started) and by reconcile
after a restart (which ends the groups a dead daemon left behind). "Empty"
means no member that is not a zombie: a zombie holds no resources, and an
orphaned one is reaped only when init gets to it (lazily by some container
inits, never by a daemon running as PID 1 without one).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import NamedTuple

import trio

__all__ = [
    "KILL_WAIT_SECONDS",
    "POLL_SECONDS",
    "GroupMember",
    "group_has_live_member",
    "group_members",
    "signal_group",
    "terminate_group",
    "wait_group_gone",
]

log = logging.getLogger(__name__)

POLL_SECONDS = 0.05
# After SIGKILL: how long to wait for the kernel to tear the group down.
KILL_WAIT_SECONDS = 3.0


class GroupMember(NamedTuple):
    """One live (not zombie) process of a group, as /proc described it."""

    pid: int
    session: int


def signal_group(pgid: int, signum: int) -> bool:
    """Send `signum` to the group; False if the group no longer exists."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    return True


def _scan(pgid: int, *, first_only: bool) -> list[GroupMember] | None:
    """Live members of `pgid` from /proc; None if /proc cannot be listed."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    found: list[GroupMember] = []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                # After "(comm)", which may itself contain ")": state, ppid, pgrp, session, ...
                state, _ppid, pgrp, session = stat.read().rsplit(b")", 1)[1].split()[:4]
            if int(pgrp) == pgid and state not in (b"Z", b"X"):
                found.append(GroupMember(int(entry), int(session)))
                if first_only:
                    return found
        except (OSError, ValueError):
            continue  # exited meanwhile
    return found


def group_members(pgid: int) -> list[GroupMember]:
    """The group's live (not zombie) members; [] when it has none or /proc is unreadable."""
    if not signal_group(pgid, 0):
        return []
    return _scan(pgid, first_only=False) or []


def group_has_live_member(pgid: int) -> bool:
    """True while a process of the group exists that is not a zombie.

    kill(-pgid, 0) alone counts zombies, so /proc is scanned as well.
    """
    if not signal_group(pgid, 0):
        return False
    found = _scan(pgid, first_only=True)
    return True if found is None else bool(found)  # cannot tell: assume alive


async def wait_group_gone(pgid: int, seconds: float, leader: trio.Process | None = None) -> bool:
    """Wait up to `seconds` for the group to empty; `leader`, our own child, is reaped."""
    with trio.move_on_after(seconds):
        if leader is not None:
            # Our own child stays a zombie (still a group member) until reaped.
            await leader.wait()
        # The kernel offers no event for "group empty" (a pidfd covers one process).
        while group_has_live_member(pgid):  # noqa: ASYNC110
            await trio.sleep(POLL_SECONDS)
        return True
    return False


async def terminate_group(
    pgid: int,
    grace: float,
    *,
    leader: trio.Process | None = None,
    kill_wait: float = KILL_WAIT_SECONDS,
    still_ours: Callable[[], bool] | None = None,
) -> bool:
    """SIGTERM the process group, wait up to `grace` for it to empty, then SIGKILL.

    `leader`, when the group leader is our own child, is reaped along the way.
    `still_ours`, when given, is asked right before SIGKILL; False means the
    group id no longer names the group meant (it emptied and the id was
    reused), so nothing more is sent and the group counts as gone.
    Returns True once the group is empty, False if it survived SIGKILL for
    `kill_wait` seconds (logged; like Slurm's "kill task failed", the caller
    should treat what it held as suspect). Callers on a cancellation path run
    this under a shielded scope with a deadline.
    """
    if not signal_group(pgid, signal.SIGTERM) and leader is None:
        return True
    if await wait_group_gone(pgid, grace, leader):
        return True
    if still_ours is not None and not still_ours():
        log.warning("process group %d changed hands during its grace period; left alone", pgid)
        return True
    log.info("process group %d still alive %.1f s after SIGTERM; sending SIGKILL", pgid, grace)
    signal_group(pgid, signal.SIGKILL)
    if await wait_group_gone(pgid, kill_wait, leader):
        return True
    log.error("process group %d survived SIGKILL", pgid)
    return False
