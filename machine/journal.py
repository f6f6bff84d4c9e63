"""The reservation journal: an fsync'd append-only log under the state dir.

Each record is framed as 4-byte big-endian length, 4-byte CRC32 of the payload, then
the msgpack payload (a tagged msgspec Struct). Compaction rewrites the live state to a
temp file, fsyncs it and renames it over the log (atomic).

Besides reservations and processes, the live state remembers ended
invocations (`EndedRecord`: the id, a digest of the request, and the outcome,
opaque here), so an id is not run twice across a restart. It keeps the newest
`retain_ended` (4,096) ended in the last `retain_ended_s` (24 h, by wall
clock); older ones are forgotten on compaction and are not reported.

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
import enum
import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path

import msgspec

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
    "RETAIN_ENDED",
    "RETAIN_ENDED_SECONDS",
    "EndedRecord",
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
]

log = logging.getLogger(__name__)

JOURNAL_FILENAME = "reservations.journal"
# Ended invocations remembered (newest first), and for how long.
RETAIN_ENDED = 4096
RETAIN_ENDED_SECONDS = 24 * 3600.0


class JournalReplay(msgspec.Struct, frozen=True, kw_only=True):
    """What the journal held on open."""

    reservations: dict[str, Reservation]
    # Processes recorded as started and not as ended, keyed by pid.
    processes: dict[int, ProcessRecord]
    # Invocations that ended within the retention window, oldest first.
    ended: dict[str, EndedRecord] = msgspec.field(default_factory=dict)
    records: int
    dropped_bytes: int = 0
    problem: str | None = None  # why a torn tail was dropped, if one was


class JournalError(Exception):
    """Base of the journal's errors (local fault: the state dir is not usable)."""


class UnsafeReason(enum.StrEnum):
    SYMLINK = "symlink"
    NOT_REGULAR_FILE = "not_regular_file"
    WRONG_OWNER = "wrong_owner"
    OPEN_PERMISSIONS = "open_permissions"


class JournalUnsafe(JournalError):
    def __init__(self, reason: UnsafeReason, path: Path) -> None:
        self.reason = reason
        self.path = path
        super().__init__(f"{reason.value}: refusing journal at {path}")


class JournalCorrupt(JournalError):
    """The journal is damaged where a crash cannot damage it: nothing is dropped."""

    def __init__(self, path: Path, offset: int, problem: str) -> None:
        self.path = path
        self.offset = offset
        self.problem = problem
        super().__init__(
            f"journal {path} is corrupt at byte {offset} ({problem}); the file is left "
            "as it was: inspect it, or move it aside and start with --accept-journal-loss"
        )


class JournalLost(JournalError):
    """The journal holds fewer records than it acknowledged: something cut it."""

    def __init__(self, path: Path, held: int, mark: Path, acknowledged: int | None) -> None:
        self.path = path
        self.held = held
        self.mark = mark
        self.acknowledged = acknowledged
        said = "is unreadable" if acknowledged is None else f"says {acknowledged} were acknowledged"
        self.what = f"journal {path} holds {held} records, {mark} {said}"
        super().__init__(f"{self.what}; --accept-journal-loss to start anyway")


def _check_loss(
    path: Path, held: int, mark: Path, acknowledged: int | None, *, accept: bool
) -> None:
    """Refuse a journal holding fewer records than its mark says it acknowledged."""
    if acknowledged is not None and held >= acknowledged:
        return
    lost = JournalLost(path, held, mark, acknowledged)
    if not accept:
        raise lost
    log.warning("%s: starting anyway (--accept-journal-loss); lost ids may run again", lost.what)


def _check_safe(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise JournalUnsafe(UnsafeReason.SYMLINK, path)
    if not stat.S_ISREG(st.st_mode):
        raise JournalUnsafe(UnsafeReason.NOT_REGULAR_FILE, path)
    if st.st_uid != os.geteuid():
        raise JournalUnsafe(UnsafeReason.WRONG_OWNER, path)
    if st.st_mode & 0o077:
        raise JournalUnsafe(UnsafeReason.OPEN_PERMISSIONS, path)


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
        mark: JournalMark,
        durable: bool,
        compact_every: int,
    ) -> None:
        self.path = path
        self._fd = fd
        self._mark = mark
        self._state = state
        self._records = records
        self._size = size  # end of the last good record: where a failed write is cut back to
        self._durable = durable
        self._compact_every = compact_every
        # Why the last write failed, until one succeeds (readiness shows it).
        self.write_problem: str | None = None
        self._partial = False  # a failed write's bytes are still at the end of the file

    @classmethod
    def open(
        cls,
        state_dir: Path,
        *,
        durable: bool = True,
        compact_every: int = 1024,
        retain_ended: int = RETAIN_ENDED,
        retain_ended_s: float = RETAIN_ENDED_SECONDS,
        accept_loss: bool = False,
    ) -> tuple[Journal, JournalReplay]:
        """Open and replay; raises JournalUnsafe, JournalCorrupt or JournalLost (the
        file untouched). `accept_loss`: open a journal that lost records anyway."""
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = state_dir / JOURNAL_FILENAME
        mark_path = path.with_name(path.name + MARK_SUFFIX)
        acknowledged: int | None  # None: the mark cannot be read
        try:
            sequence, acknowledged = read_mark(mark_path, _check_safe) or (0, 0)
        except MarkUnreadable:
            sequence, acknowledged = 0, None
        try:
            _check_safe(path, os.lstat(path))
            created = False
        except FileNotFoundError:
            created = True
            if not accept_loss:  # refused before anything is created
                _check_loss(path, 0, mark_path, acknowledged, accept=False)
        flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:  # O_NOFOLLOW: a symlink planted after the check
            if path.is_symlink():
                raise JournalUnsafe(UnsafeReason.SYMLINK, path) from exc
            raise
        try:
            _check_safe(path, os.fstat(fd))
            with open(fd, "rb", closefd=False) as reader:
                data = reader.read()
            state = LiveState(retain_ended=retain_ended, retain_ended_s=retain_ended_s)
            scan = scan_journal(data, state)
            if scan.problem is not None and not scan.torn:
                raise JournalCorrupt(path, scan.good, scan.problem)
            _check_loss(path, scan.records, mark_path, acknowledged, accept=accept_loss)
            if scan.torn:
                drop_torn_tail(path, fd, data, scan)
            elif not data and not created:
                log.info("journal %s is empty: no reservations to recover", path)
            if created:
                fsync_dir(state_dir)
            elif durable and not scan.torn:
                os.fsync(fd)  # what was read may not be on the disk yet: the mark claims it
            journal_mark = JournalMark.open(
                mark_path, scan.records, _check_safe, sequence=sequence, durable=durable
            )
        except BaseException:
            os.close(fd)
            raise
        replay = JournalReplay(
            reservations=dict(state.reservations),
            processes=dict(state.processes),
            ended=state.live_ended(),
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
            write_all(self._fd, data)
            if self._durable:
                os.fsync(self._fd)
        except OSError as exc:
            # Not durable, so not applied; cut the partial frames off so that the next
            # record does not land behind them (a restart would drop everything after).
            self.write_problem = f"write failed: {exc}"
            self._partial = True
            self._cut_back()
            raise
        self._size += len(data)
        self.write_problem = None
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
        (compaction writes and fsyncs every live record). Raises while it still fails."""
        if self.write_problem is None:
            return
        self.compact()
        self.write_problem = None

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
        """How `invocation_id` ended, if that is remembered and inside the window."""
        return self._state.live_ended_one(invocation_id)

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
        records = self._state.records()
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
        self._records = len(records)
        self._size = os.fstat(new_fd).st_size
        self._partial = False  # the old file, partial tail and all, is gone
        os.close(old_fd)
        fsync_dir(self.path.parent)

    def close(self) -> None:
        self._mark.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
