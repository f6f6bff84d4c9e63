"""After a restart: end what a dead daemon left running and release what it held.

For each process the journal recorded as started and not ended, the pid AND
its start time (psutil create_time) must both match before anything is
signalled: a reused pid belongs to someone else and is never killed. The
supervisor starts every invocation in its own session, so the recorded
process leads a process group (pgid == pid) and its descendants - a shell's
backgrounded children, say - are members of it. A match gets the whole group
ended: SIGTERM, a grace period for the group to empty, then SIGKILL.

The leader may be gone while members of its group live on (it exited, or was
killed with the daemon, and left children behind). The group id cannot be
reused while any member exists, but once the group empties it can: so the
group is ended only if every live member is one of ours - in the recorded
session (sid == pgid) and started no earlier than the recorded process (all
of our group descends from it). A group with an older member, or one from
another session, is someone else's and is never touched.

Invocations are ephemeral, so every reservation from before the restart is
released (and the release journaled) once its processes are gone; one whose
group would not die is kept, with its pid reported and logged as an error,
so its resources are not handed out twice.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import signal

import msgspec
import psutil  # type: ignore[import-untyped,unused-ignore]
import trio

from node.machine.journal import Journal, ProcessRecord
from node.machine.ledger import Ledger
from node.machine.procgroup import GroupMember, group_members, terminate_group

__all__ = ["ReconcileReport", "reconcile"]

log = logging.getLogger(__name__)

_POLL_S = 0.05


class ReconcileReport(msgspec.Struct, frozen=True, kw_only=True):
    terminated: tuple[int, ...] = ()  # matched (or its group outlived it) and ended by us
    reused: tuple[int, ...] = ()  # pid or group id now someone else's: left alone
    gone: tuple[int, ...] = ()  # already exited, nothing of its group left
    unkillable: tuple[int, ...] = ()  # something of it still alive after SIGKILL
    released: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()


class _Found(enum.Enum):
    GONE = "gone"  # leader gone, its group empty
    REUSED = "reused"  # the pid or the group id names someone else's now
    GROUP = "group"  # a group of ours (leader alive or not) to end
    SINGLE = "single"  # our process, alive, but not leading a group of its own


def _matches(pid: int, start_time: float, tolerance: float) -> bool | None:
    """True: our process, alive. False: pid reused by another. None: gone."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        created = proc.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return False  # not ours to judge, so never ours to kill
    return bool(abs(float(created) - start_time) <= tolerance)


def _member_is_ours(member: GroupMember, record: ProcessRecord, tolerance: float) -> bool:
    """Of the recorded process's session and no older than it (else: pid/pgid reuse)."""
    if member.session != record.pid:
        return False
    try:
        created = float(psutil.Process(member.pid).create_time())
    except psutil.NoSuchProcess:
        return True  # exited meanwhile: nothing of anyone's to protect
    except psutil.AccessDenied:
        return False
    return created >= record.start_time - tolerance


def _find(record: ProcessRecord, tolerance: float) -> _Found:
    leader = _matches(record.pid, record.start_time, tolerance)
    if leader is False:
        # The pid was reused, so its group had emptied first: nothing of ours is left.
        return _Found.REUSED
    if leader is True:
        try:
            if os.getpgid(record.pid) != record.pid:
                return _Found.SINGLE
            return _Found.GROUP
        except ProcessLookupError:
            pass  # exited just now: look at what it left behind
    members = group_members(record.pid)
    if not members:
        return _Found.GONE
    if all(_member_is_ours(m, record, tolerance) for m in members):
        return _Found.GROUP
    log.warning(
        "reconcile: process group %d now holds processes %s not started by process %d of "
        "reservation %s (group id reused): left alone",
        record.pid,
        [m.pid for m in members],
        record.pid,
        record.reservation_id,
    )
    return _Found.REUSED


def _still_ours(record: ProcessRecord, tolerance: float) -> bool:
    return _find(record, tolerance) is not _Found.REUSED


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


async def _wait_gone(record: ProcessRecord, seconds: float, tolerance: float) -> bool:
    # Not our child, so there is nothing to wait on: poll /proc, bounded by `seconds`.
    deadline = trio.current_time() + seconds
    while trio.current_time() < deadline:
        if not _matches(record.pid, record.start_time, tolerance):
            return True
        await trio.sleep(_POLL_S)
    return not _matches(record.pid, record.start_time, tolerance)


async def _end_single(
    record: ProcessRecord, grace: float, kill_wait: float, tolerance: float
) -> bool:
    # Not a group leader (never so for what the supervisor starts): end it alone.
    _signal(record.pid, signal.SIGTERM)
    if await _wait_gone(record, grace, tolerance):
        return True
    # Re-check right before SIGKILL: the pid must still be ours.
    if _matches(record.pid, record.start_time, tolerance):
        _signal(record.pid, signal.SIGKILL)
    return await _wait_gone(record, kill_wait, tolerance)


async def _end(
    record: ProcessRecord, found: _Found, grace: float, kill_wait: float, tolerance: float
) -> bool:
    if found is _Found.SINGLE:
        return await _end_single(record, grace, kill_wait, tolerance)
    return await terminate_group(
        record.pid,
        grace,
        kill_wait=kill_wait,
        # Right before SIGKILL: the group id must still name our group.
        still_ours=functools.partial(_still_ours, record, tolerance),
    )


async def reconcile(
    journal: Journal,
    *,
    ledger: Ledger | None = None,
    grace: float = 5.0,
    kill_wait: float = 2.0,
    start_time_tolerance: float = 0.05,
) -> ReconcileReport:
    """Terminate matching leftovers, then release their reservations (journal and ledger)."""
    terminated: list[int] = []
    reused: list[int] = []
    gone: list[int] = []
    unkillable: list[int] = []
    stuck: set[str] = set()
    for record in journal.processes().values():
        found = _find(record, start_time_tolerance)
        if found is _Found.GONE:
            gone.append(record.pid)
        elif found is _Found.REUSED:
            reused.append(record.pid)
        elif await _end(record, found, grace, kill_wait, start_time_tolerance):
            terminated.append(record.pid)
        else:
            survivors = [m.pid for m in group_members(record.pid)] or [record.pid]
            log.error(
                "reconcile: process %d of reservation %s (members still alive: %s) survived "
                "SIGKILL; keeping the reservation so its resources are not handed out twice",
                record.pid,
                record.reservation_id,
                survivors,
            )
            unkillable.append(record.pid)
            stuck.add(record.reservation_id)
            continue
        journal.record_process_ended(record.reservation_id, record.pid)
    released: list[str] = []
    kept: list[str] = []
    for reservation_id in journal.reservations():
        if reservation_id in stuck:
            kept.append(reservation_id)
            continue
        journal.record_release(reservation_id)
        if ledger is not None:
            ledger.release(reservation_id)
        released.append(reservation_id)
    return ReconcileReport(
        terminated=tuple(terminated),
        reused=tuple(reused),
        gone=tuple(gone),
        unkillable=tuple(unkillable),
        released=tuple(released),
        kept=tuple(kept),
    )
