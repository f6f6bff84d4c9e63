"""The reservation journal: an fsync'd append-only log under the state dir.

Each record is framed as 4-byte big-endian length, 4-byte CRC32 of the payload, then
the msgpack payload (a tagged msgspec Struct). Compaction rewrites the live state to a
temp file, fsyncs it and renames it over the log (atomic).

Besides reservations and processes, the journal remembers ended invocations
(`EndedRecord`: the id, a digest of the request, and the outcome, opaque here),
so an id never runs twice inside the idempotency window (`window_s`, 24 h of
the node's running time) whatever the rate: the journal holds an ending until
a compaction has moved it, durably, into the index of ended invocations
(`ended_index.py`, SQLite), which keeps it for the window, up to `max_ids`.
`ended(id)` answers from both; `room()` says how many more ids fit.

Writing. An append is one frame, or a batch of frames joined into one write
(group commit), written and fsynced once; only then is it applied to the
live state. If the write or the fsync fails (a full disk, an I/O
error), the file is truncated back to the end of the last good record and the
error is raised, so a record never follows a partial one. Until a write
succeeds again, `write_problem` says why (the daemon's readiness shows it). If
even the truncation fails, appends are refused until it succeeds.

Reading (on open). A crash can tear only the record being appended, the last
one, and only by ending the file early: a *torn last record* is fewer than 8
header bytes at the end of the file, or a header whose declared length
(within the bound) runs past the end of the file with no complete record
anywhere after it, or nothing but zero bytes from the first bad frame to the
end (the file grew but its data never reached the disk; no record is all
zeros). A torn tail is copied to `<journal>.torn` (replacing an
older copy), then truncated away, with a warning naming the offset. Anything
else is corruption: a length over the bound, a complete frame whose CRC
fails (even the last one: the filesystem never shows a whole frame with
wrong bytes after a crash), a payload that does not decode, or a length that
runs past the end of the file while complete records follow it. Corruption
raises `JournalCorrupt`, one line naming the file and the byte offset, and
the file is left exactly as it was. A 0-byte journal (created and never
written, or compacted when nothing was live) is a journal with no records:
it opens with an info line saying so.

Losses. `<journal>.mark` (`journal_mark.py`) holds the record count of the last
fsynced write. A journal holding fewer (empty, cut, missing) raises `JournalLost`
naming the file and both counts, the file untouched, unless `accept_loss`: then a
warning, and the mark is rewritten. No mark (older versions wrote none) claims nothing.

The file is created with mode 0600; a journal path that is a symlink, not a
regular file, owned by someone else or open to group/others is refused with
`JournalUnsafe` rather than used.

The record types and their framing are in `journal_records.py`, reading a file
back (the live state, torn tails) in `journal_replay.py`; this module opens,
appends, compacts and re-exports the records.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from machine.disk_reserve import RESERVE_BYTES, RESERVE_SUFFIX, DiskReserve
from machine.ended_index import MAX_IDS, WINDOW_S, EndedIndex, IndexUnusable
from machine.journal_errors import (
    JournalCorrupt,
    JournalError,
    JournalLost,
    JournalUnsafe,
    UnsafeReason,
    check_loss,
    check_safe,
)
from machine.journal_mark import MARK_SUFFIX, JournalMark, MarkUnreadable, read_mark
from machine.journal_records import (
    EndedRecord,
    ProcessEndedRecord,
    ProcessRecord,
    ProcessStartedRecord,
    Record,
    ReleaseRecord,
    ReserveRecord,
    frame,
)
from machine.journal_replay import (
    LiveState,
    drop_torn_tail,
    fsync_dir,
    scan_journal,
    write_all,
)
from machine.ledger import Reservation

__all__ = [
    "JOURNAL_FILENAME",
    "LISTED_ENDED",
    "MAX_IDS",
    "WINDOW_S",
    "EndedRecord",
    "IndexUnusable",
    "Journal",
    "JournalCorrupt",
    "JournalError",
    "JournalLost",
    "JournalReplay",
    "JournalUnsafe",
    "ProcessEndedRecord",
    "ProcessRecord",
    "ProcessStartedRecord",
    "Record",
    "ReleaseRecord",
    "ReserveRecord",
    "UnsafeReason",
    "frame",
    "release_reserve",
]

log = logging.getLogger(__name__)

JOURNAL_FILENAME = "reservations.journal"
# The newest ended invocations the replay hands over to be listed.
LISTED_ENDED = 4096


class JournalReplay(msgspec.Struct, frozen=True, kw_only=True):
    """What the journal held on open."""

    reservations: dict[str, Reservation]
    # Processes recorded as started and not as ended, keyed by pid.
    processes: dict[int, ProcessRecord]
    # The newest `listed` invocations that ended inside the window, oldest first.
    ended: dict[str, EndedRecord] = msgspec.field(default_factory=dict)
    records: int
    dropped_bytes: int = 0
    problem: str | None = None  # why a torn tail was dropped, if one was


def release_reserve(state_dir: Path) -> bool:
    """Give the room kept for the journal back to the disk (a restart: its own start-up
    files may need it; the journal takes it again on open, or once the disk has it)."""
    return DiskReserve(state_dir / (JOURNAL_FILENAME + RESERVE_SUFFIX)).release()


class Journal:
    """Append-only reservation log. Methods are synchronous (they fsync): call them from
    a worker thread where blocking the event loop matters."""

    def __init__(
        self,
        path: Path,
        fd: int,
        state: LiveState,
        records: int,
        size: int,
        *,
        index: EndedIndex,
        reserve: DiskReserve,
        mark: JournalMark,
        durable: bool,
        compact_every: int,
    ) -> None:
        self.path = path
        self._fd = fd
        self.index = index
        self._reserve = reserve
        self._mark = mark
        self._state = state
        self._records = records
        self._size = size  # end of the last good record: where a failed write is cut back to
        self._durable = durable
        self._compact_every = compact_every
        # Why the last write failed, until one succeeds (readiness shows it).
        self.write_problem: str | None = None
        self._partial = False  # a failed write's bytes are still at the end of the file
        # Why the room kept for the journal is not kept (a full disk), until it is again.
        self.reserve_problem: str | None = None
        self._take_reserve()
        # Endings the journal holds that are in the index too (a compaction added them
        # and then failed): the next one does not add them again.
        self._indexed: dict[str, EndedRecord] = {}

    @classmethod
    def open(
        cls,
        state_dir: Path,
        *,
        durable: bool = True,
        compact_every: int = 1024,
        window_s: float = WINDOW_S,
        max_ids: int = MAX_IDS,
        listed: int = LISTED_ENDED,
        clock: Callable[[], float] = time.monotonic,
        accept_loss: bool = False,
        reserve_bytes: int = RESERVE_BYTES,
    ) -> tuple[Journal, JournalReplay]:
        """Open and replay; raises JournalUnsafe, JournalCorrupt, JournalLost (the file
        untouched) or IndexUnusable. `accept_loss`: open a journal that lost records
        anyway. `clock`: the monotonic clock node time is counted in. `reserve_bytes`:
        the room kept back for the journal (a full disk leaves it not ready, not shut)."""
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = state_dir / JOURNAL_FILENAME
        mark_path = path.with_name(path.name + MARK_SUFFIX)
        acknowledged: int | None  # None: the mark cannot be read
        try:
            sequence, acknowledged = read_mark(mark_path, check_safe) or (0, 0)
        except MarkUnreadable:
            sequence, acknowledged = 0, None
        try:
            check_safe(path, os.lstat(path))
            created = False
        except FileNotFoundError:
            created = True
            if not accept_loss:  # refused before anything is created
                check_loss(path, 0, mark_path, acknowledged, accept=False)
        flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:  # O_NOFOLLOW: a symlink planted after the check
            if path.is_symlink():
                raise JournalUnsafe(UnsafeReason.SYMLINK, path) from exc
            raise
        # Closed again if the open fails half-way.
        journal_mark: JournalMark | None = None
        index: EndedIndex | None = None
        try:
            check_safe(path, os.fstat(fd))
            with open(fd, "rb", closefd=False) as reader:
                data = reader.read()
            state = LiveState()
            scan = scan_journal(data, state)
            if scan.problem is not None and not scan.torn:
                raise JournalCorrupt(path, scan.good, scan.problem)
            check_loss(path, scan.records, mark_path, acknowledged, accept=accept_loss)
            if scan.torn:
                drop_torn_tail(path, fd, data, scan)
            elif not data and not created:
                log.info("journal %s is empty: no reservations to recover", path)
            if created:
                fsync_dir(state_dir)
            elif durable and not scan.torn:
                os.fsync(fd)  # what was read may not be on the disk yet: the mark claims it
            journal_mark = JournalMark.open(
                mark_path, scan.records, check_safe, sequence=sequence, durable=durable
            )
            index = EndedIndex.open(
                state_dir, window_s=window_s, max_ids=max_ids, durable=durable, clock=clock
            )
            older = [r for r in index.newest(listed) if r.invocation_id not in state.ended]
        except BaseException:
            os.close(fd)
            if index is not None:
                index.close()
            if journal_mark is not None:
                journal_mark.close()
            raise
        newest = [*older, *state.ended.values()][-listed:] if listed else []
        replay = JournalReplay(
            reservations=dict(state.reservations),
            processes=dict(state.processes),
            ended={record.invocation_id: record for record in newest},
            records=scan.records,
            dropped_bytes=len(data) - scan.good,
            problem=scan.problem,
        )
        journal = cls(
            path,
            fd,
            state,
            scan.records,
            scan.good,
            index=index,
            reserve=DiskReserve(path.with_name(path.name + RESERVE_SUFFIX), reserve_bytes),
            mark=journal_mark,
            durable=durable,
            compact_every=compact_every,
        )
        return journal, replay

    # -- appending ------------------------------------------------------------------
    def _append(self, record: Record) -> None:
        self.append_batch([record])

    def append_batch(self, records: Sequence[Record]) -> None:
        self.append_framed([(record, frame(record)) for record in records])

    def append_framed(self, batch: Sequence[tuple[Record, bytes]]) -> None:
        """Write the frames (each `frame(record)`) in one write, fsync once, and only then
        apply the records. The bytes written since the last good record are the unit of
        failure: if the write or the fsync fails, none of the batch counts and all of it
        is cut back."""
        if self._fd < 0:
            raise JournalError("journal is closed")
        if self._partial:
            self._cut_back()
            if self._partial:
                raise JournalError(f"journal {self.path}: a partial record could not be removed")
        if not batch:
            return
        data = b"".join(framed for _record, framed in batch)
        try:
            self._write(data)
        except OSError as exc:
            # Not durable, so not applied; cut the partial frames off so that the next
            # record does not land behind them (a restart would drop everything after).
            self.write_problem = f"write failed: {exc}"
            self._partial = True
            self._cut_back()
            raise
        self._size += len(data)
        self.write_problem = None
        if self.reserve_problem is not None:
            self._take_reserve()  # the disk took this write: it may have the room again
        for record, _framed in batch:
            self._state.apply(record)
        self._records += len(batch)
        try:
            self._mark.write(self._records)
        except OSError as exc:
            # The records are durable and stand; the mark still says fewer (never more).
            # Not ready until a write (or `recover`) brings the mark up to date.
            log.error("journal mark %s: %s", self._mark.path, exc)
            self.write_problem = f"mark write failed: {exc}"
        if self._records >= self._compact_every and self._records > 2 * self._state.size():
            try:
                self.compact()
            except Exception:
                # The records above are written and fsynced: they stand. Compaction is
                # retried on the next append.
                log.exception("journal %s: compaction failed; will retry", self.path)

    def _write(self, data: bytes) -> None:
        """Write and fsync `data`; a full disk gives the journal its reserve and the
        write is tried once more in that room."""
        try:
            write_all(self._fd, data)
            if self._durable:
                os.fsync(self._fd)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._reserve.held:
                raise
            self._cut_back()
            if self._partial:
                raise
            self._reserve.release()
            self.reserve_problem = (
                f"the state folder's disk is full: the journal writes in its reserve "
                f"({self._reserve.path}) and admits no new work"
            )
            log.error("journal %s: %s", self.path, self.reserve_problem)
            write_all(self._fd, data)
            if self._durable:
                os.fsync(self._fd)

    def _take_reserve(self) -> None:
        try:
            self._reserve.restore()
        except OSError as exc:
            self.reserve_problem = (
                f"the state folder's disk is full: {exc.strerror}: {exc.filename}; "
                "the journal admits no new work until it has that room"
            )
        except JournalUnsafe as exc:
            self.reserve_problem = str(exc)
        else:
            self.reserve_problem = None

    def _cut_back(self) -> None:
        """Truncate to the end of the last good record; on failure, stay partial."""
        try:
            os.ftruncate(self._fd, self._size)
            if self._durable:
                os.fsync(self._fd)
        except OSError as exc:
            log.error("journal %s: could not remove a partial record: %s", self.path, exc)
            return
        self._partial = False

    def recover(self) -> None:
        """After a failed write, prove the disk takes writes again: rewrite the journal
        (compaction writes and fsyncs every live record), and take the reserve back.
        Raises while the write still fails; `reserve_problem` stays while the room is
        not there."""
        if self.write_problem is not None:
            self.compact()
            self.write_problem = None
        if self.reserve_problem is not None:
            self._take_reserve()

    def record_reserve(self, reservation: Reservation) -> None:
        self._append(ReserveRecord(reservation=reservation))

    def record_release(self, reservation_id: str) -> None:
        self._append(ReleaseRecord(reservation_id=reservation_id))

    def record_process_started(
        self, reservation_id: str, pid: int, start_ticks: int | None
    ) -> None:
        """`start_ticks`: `machine.proc.process_start_ticks(pid)`, read before the
        process could be reaped (None when /proc could not tell)."""
        self._append(
            ProcessStartedRecord(reservation_id=reservation_id, pid=pid, start_ticks=start_ticks)
        )

    def record_process_ended(self, reservation_id: str, pid: int) -> None:
        self._append(ProcessEndedRecord(reservation_id=reservation_id, pid=pid))

    def record_ended(self, record: EndedRecord) -> None:
        self._append(record)

    # -- reading --------------------------------------------------------------------
    def reservations(self) -> dict[str, Reservation]:
        return dict(self._state.reservations)

    def processes(self) -> dict[int, ProcessRecord]:
        return dict(self._state.processes)

    def ended(self, invocation_id: str) -> EndedRecord | None:
        """How `invocation_id` ended, if it ended inside the window."""
        record = self._state.ended.get(invocation_id)
        return record if record is not None else self.index.get(invocation_id)

    def room(self) -> int:
        """How many more ended ids the window can hold (what the journal holds counts)."""
        return self.index.room() - (len(self._state.ended) - len(self._indexed))

    def expire(self) -> int:
        """Forget ids whose window has passed; raises sqlite3.Error."""
        return self.index.expire()

    @property
    def record_count(self) -> int:
        return self._records

    # -- compaction and closing -----------------------------------------------------
    def compact(self) -> None:
        """Rewrite the log as its live state: temp file, fsync, rename, fsync the dir.

        The new descriptor is the temp file's own, opened before the rename and
        swapped in only once the rename succeeded: whatever fails, the journal
        keeps appending to the file that is at `path`.
        """
        if self._fd < 0:
            raise JournalError("journal is closed")
        tmp = self.path.with_name("." + self.path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        moved = self._move_ended()
        records = self._state.records(ended=not moved)
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        new_fd = os.open(tmp, flags, 0o600)
        try:
            write_all(new_fd, b"".join(frame(r) for r in records))
            os.fsync(new_fd)
            # Lowered before the shorter journal takes the name: never more than it holds.
            self._mark.write(len(records), sync=True)
            os.replace(tmp, self.path)
        except BaseException:
            os.close(new_fd)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        old_fd, self._fd = self._fd, new_fd
        if moved:
            # `_indexed` first: a read of room() between the two then counts low, not high.
            self._indexed.clear()
            self._state.ended.clear()  # durable in the index, and gone from the journal
        self._records = len(records)
        self._size = os.fstat(new_fd).st_size
        self._partial = False  # the old file, partial tail and all, is gone
        os.close(old_fd)
        fsync_dir(self.path.parent)

    def _move_ended(self) -> bool:
        """Add the endings the journal holds to the index (durably); False if it cannot
        take them now: the compacted journal keeps them, and the next compaction retries."""
        if not self._state.ended or self.reserve_problem is not None:
            return False  # on a full disk a failed add would still grow the index's log
        # Those a compaction that failed later already added are not added again.
        fresh = [r for iid, r in self._state.ended.items() if self._indexed.get(iid) is not r]
        try:
            self.index.add(fresh)
        except sqlite3.Error as exc:
            log.error("index %s: endings stay in the journal for now: %s", self.index.path, exc)
            return False
        self._indexed.update((r.invocation_id, r) for r in fresh)
        return True

    def close(self) -> None:
        self.index.close()
        self._mark.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
