"""After a restart: end what a dead daemon left running and release what it held.

The journal says which processes were started and not ended; reconcile
signals one only once /proc shows it is ours. It is ours if all of these hold:

- the pid is > 1 and is not the daemon's own pid, group or session;
- it started at the recorded instant: its /proc/<pid>/stat start time, in
  clock ticks since boot, equals the recorded one, so a reused pid is never
  taken for ours. Ticks do not move when the wall clock is stepped (psutil's
  create_time() does; it is only used for records written before ticks were);
- it leads its own session and group (sid == pgid == pid), as every
  invocation the supervisor starts does for its whole life;
- it is in no other invocation's cgroup (`litegraph-<other id>`, in the v2
  hierarchy or any v1 one).

A process that is ours gets its whole group ended: its descendants (a
shell's backgrounded children, say) are members of it. The leader may be
gone while members live on; the group id cannot be reused while any member
exists, but once the group empties it can: so the group is ended only if
every live member is ours - in the recorded session, started no earlier than
the recorded process (all of our group descends from it) and in no other
invocation's cgroup. Anything else is spared, with the reason logged.

All groups to end get SIGTERM at once and share one grace period, then the
survivors (each checked again) get SIGKILL: N stubborn groups take one grace,
not N, so start-up stays within systemd's start timeout.

Invocations are ephemeral, so every reservation from before the restart is
released (and the release journaled) once its processes are gone; one whose
group would not die is kept, with its pid reported and logged as an error,
so its resources are not handed out twice. A standing reservation (a holder's
outside the node: a Kubernetes claim's) is kept as it was (`standing`).
"""

from __future__ import annotations

import enum
import logging
import math
import os

import msgspec
import psutil  # type: ignore[import-untyped,unused-ignore]

from machine.cgroups.common import PREFIX as CGROUP_PREFIX
from machine.journal import Journal, ProcessRecord
from machine.ledger import Ledger
from machine.proc import ProcStat, process_cgroups, read_stat
from machine.procgroup import group_members, terminate_groups

__all__ = ["ReconcileReport", "SpareReason", "Spared", "reconcile"]

log = logging.getLogger(__name__)


class SpareReason(enum.StrEnum):
    INVALID_PID = "invalid_pid"  # <= 1: not a process the supervisor could have started
    DAEMON_ITSELF = "daemon_itself"  # the daemon's own pid, group or session
    NO_START_TIME = "no_start_time"  # recorded without one: cannot be told apart
    PID_REUSED = "pid_reused"  # the pid names a process started at another time
    NOT_SESSION_LEADER = "not_session_leader"  # not sid == pgid == pid, as ours always are
    OTHER_CGROUP = "other_cgroup"  # in another invocation's cgroup
    GROUP_REUSED = "group_reused"  # leader gone; its group id now holds others' processes


class Spared(msgspec.Struct, frozen=True):
    pid: int
    reason: SpareReason


class ReconcileReport(msgspec.Struct, frozen=True, kw_only=True):
    terminated: tuple[int, ...] = ()  # ours (or its group outlived it) and ended by us
    spared: tuple[Spared, ...] = ()  # not ours, or not to be trusted: never signalled
    gone: tuple[int, ...] = ()  # already exited, nothing of its group left
    unkillable: tuple[int, ...] = ()  # something of it still alive after SIGKILL
    released: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()  # a process of it survived: held, never handed out twice
    standing: tuple[str, ...] = ()  # held for a holder outside the node: kept as it was


class _Found(enum.Enum):
    GONE = "gone"  # the recorded process and its whole group have exited
    GROUP = "group"  # ours: end its group


def _expected_ticks(record: ProcessRecord, tolerance: float) -> tuple[int, int] | None:
    """(start ticks, allowed difference), or None when the record has no start time."""
    if record.start_ticks is not None:
        return record.start_ticks, 0
    if record.start_time <= 0:
        return None
    # An older record's wall-clock time, turned back into ticks as psutil made it.
    clock = os.sysconf("SC_CLK_TCK")
    ticks = round((record.start_time - float(psutil.boot_time())) * clock)
    return ticks, math.ceil(tolerance * clock)


def _daemon_ids() -> set[int]:
    return {os.getpid(), os.getpgrp(), os.getsid(0)}


def _in_other_cgroup(pid: int, reservation_id: str) -> bool:
    """In an invocation cgroup (v2, or any v1 hierarchy) that is not this one's."""
    names = {
        part
        for path in process_cgroups(pid) or ()
        for part in path.split("/")
        if part.startswith(CGROUP_PREFIX)
    }
    return bool(names - {f"{CGROUP_PREFIX}{reservation_id}"})


def _member_spared(member: ProcStat, record: ProcessRecord, earliest: int) -> SpareReason | None:
    """Why a live member of the recorded group is not ours, or None if it is."""
    if member.pid in _daemon_ids():
        return SpareReason.DAEMON_ITSELF
    if member.session != record.pid or member.start_ticks < earliest:
        return SpareReason.GROUP_REUSED
    if _in_other_cgroup(member.pid, record.reservation_id):
        return SpareReason.OTHER_CGROUP
    return None


def _judge(record: ProcessRecord, tolerance: float) -> _Found | SpareReason:
    """End its group, gone, or why it is spared; judged from /proc alone."""
    pid = record.pid
    if pid <= 1:
        return SpareReason.INVALID_PID
    if pid in _daemon_ids():
        return SpareReason.DAEMON_ITSELF
    expected = _expected_ticks(record, tolerance)
    if expected is None:
        return SpareReason.NO_START_TIME
    ticks, slack = expected
    leader = read_stat(pid)
    if leader is not None and abs(leader.start_ticks - ticks) > slack:
        # Our pid is someone else's, so our group had emptied first (a group id
        # stays taken while it has members): nothing of ours is left.
        return SpareReason.PID_REUSED
    if leader is not None and leader.alive:
        if not leader.session == leader.pgrp == pid:
            return SpareReason.NOT_SESSION_LEADER
        if _in_other_cgroup(pid, record.reservation_id):
            return SpareReason.OTHER_CGROUP
        return _Found.GROUP
    # The leader is gone (or an unreaped zombie): look at what it left behind.
    members = group_members(pid)
    if not members:
        return _Found.GONE
    for member in members:
        reason = _member_spared(member, record, ticks - slack)
        if reason is not None:
            log.warning(
                "reconcile: process group %d holds process %d that is not ours (%s)",
                pid,
                member.pid,
                reason,
            )
            return reason
    return _Found.GROUP


async def reconcile(
    journal: Journal,
    *,
    ledger: Ledger | None = None,
    grace: float = 5.0,
    kill_wait: float = 2.0,
    start_time_tolerance: float = 0.05,
) -> ReconcileReport:
    """End the leftover groups that are ours, then release their reservations
    (journal and ledger). Takes at most about grace + kill_wait however many
    groups there are. `start_time_tolerance` applies only to older records
    that hold a wall-clock start time."""
    records = {r.pid: r for r in journal.processes().values()}
    spared: list[Spared] = []
    gone: list[int] = []
    to_end: list[int] = []
    for pid, record in records.items():
        verdict = _judge(record, start_time_tolerance)
        if verdict is _Found.GONE:
            gone.append(pid)
        elif isinstance(verdict, SpareReason):
            log.warning(
                "reconcile: spared pid %d of reservation %s: %s",
                pid,
                record.reservation_id,
                verdict,
            )
            spared.append(Spared(pid, verdict))
        else:
            to_end.append(pid)

    def still_ours(pgid: int) -> bool:
        # Right before SIGKILL: the group id must still name our group.
        return _judge(records[pgid], start_time_tolerance) is _Found.GROUP

    survivors = await terminate_groups(to_end, grace, kill_wait=kill_wait, still_ours=still_ours)
    stuck: set[str] = set()
    for pid in sorted(survivors):
        record = records[pid]
        log.error(
            "reconcile: process %d of reservation %s (members still alive: %s) survived "
            "SIGKILL; keeping the reservation so its resources are not handed out twice",
            pid,
            record.reservation_id,
            [m.pid for m in group_members(pid)] or [pid],
        )
        stuck.add(record.reservation_id)
    terminated = [pid for pid in to_end if pid not in survivors]
    for pid in terminated:
        log.info(
            "reconcile: ended process group %d of reservation %s", pid, records[pid].reservation_id
        )
    for pid, record in records.items():
        if pid not in survivors:
            journal.record_process_ended(record.reservation_id, pid)
    released: list[str] = []
    kept: list[str] = []
    standing: list[str] = []
    for reservation_id, reservation in journal.reservations().items():
        if reservation.standing:
            standing.append(reservation_id)
            continue
        if reservation_id in stuck:
            kept.append(reservation_id)
            continue
        journal.record_release(reservation_id)
        if ledger is not None:
            ledger.release(reservation_id)
        log.info("reconcile: released reservation %s", reservation_id)
        released.append(reservation_id)
    return ReconcileReport(
        terminated=tuple(terminated),
        spared=tuple(spared),
        gone=tuple(gone),
        unkillable=tuple(sorted(survivors)),
        released=tuple(released),
        kept=tuple(kept),
        standing=tuple(standing),
    )
