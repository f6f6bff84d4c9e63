"""After a restart: end what a dead daemon left running and release what it held.

For each process the journal recorded as started and not ended, the pid AND
its start time (psutil create_time) must both match before anything is
signalled: a reused pid belongs to someone else and is never killed. A match
gets SIGTERM to its process group, then SIGKILL after a grace period.
Invocations are ephemeral, so every reservation from before the restart is
released (and the release journaled) once its processes are gone; one whose
process would not die is kept, with its pid reported, so its resources are
not handed out twice.
"""

from __future__ import annotations

import os
import signal

import msgspec
import psutil  # type: ignore[import-untyped,unused-ignore]
import trio

from node.journal import Journal, ProcessRecord
from node.ledger import Ledger

__all__ = ["ReconcileReport", "reconcile"]

_POLL_S = 0.05


class ReconcileReport(msgspec.Struct, frozen=True, kw_only=True):
    terminated: tuple[int, ...] = ()  # matched and ended by us
    reused: tuple[int, ...] = ()  # pid alive but started at another time: left alone
    gone: tuple[int, ...] = ()  # already exited
    unkillable: tuple[int, ...] = ()  # still alive after SIGKILL
    released: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()


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


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        # Spawned in its own session, our process leads its group: end the whole group.
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
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


async def _end(record: ProcessRecord, grace: float, kill_wait: float, tolerance: float) -> bool:
    _signal(record.pid, signal.SIGTERM)
    if await _wait_gone(record, grace, tolerance):
        return True
    # Re-check right before SIGKILL: the pid must still be ours.
    if _matches(record.pid, record.start_time, tolerance):
        _signal(record.pid, signal.SIGKILL)
    return await _wait_gone(record, kill_wait, tolerance)


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
        state = _matches(record.pid, record.start_time, start_time_tolerance)
        if state is None:
            gone.append(record.pid)
        elif state is False:
            reused.append(record.pid)
        elif await _end(record, grace, kill_wait, start_time_tolerance):
            terminated.append(record.pid)
        else:
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
