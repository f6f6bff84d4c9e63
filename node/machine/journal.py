"""The reservation journal: an fsync'd append-only log under the state dir.

Each record is framed as 4-byte big-endian length, 4-byte CRC32 of the
payload, then the msgpack payload (a tagged msgspec Struct). Compaction
rewrites the live state to a temp file, fsyncs it and renames it over the
log (atomic).

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

The file is created with mode 0600; a journal path that is a symlink, not a
regular file, owned by someone else or open to group/others is refused with
`JournalUnsafe` rather than used.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import stat
import struct
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import msgspec

from node.machine.ledger import Reservation

__all__ = [
    "JOURNAL_FILENAME",
    "RETAIN_ENDED",
    "RETAIN_ENDED_SECONDS",
    "EndedRecord",
    "Journal",
    "JournalCorrupt",
    "JournalError",
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
_HEADER = struct.Struct(">II")
# Ended invocations remembered (newest first), and for how long.
RETAIN_ENDED = 4096
RETAIN_ENDED_SECONDS = 24 * 3600.0
# No honest record comes near this; a bigger length means a corrupt header.
MAX_RECORD_BYTES = 1 << 20
# Looking for whole records after a length that runs past the end of the file reads
# at most this many payload bytes; past it the tail is judged corrupt (fail closed).
_RESYNC_BUDGET = 64 << 20


class ReserveRecord(msgspec.Struct, frozen=True, kw_only=True, tag="reserve"):
    reservation: Reservation


class ReleaseRecord(msgspec.Struct, frozen=True, kw_only=True, tag="release"):
    reservation_id: str


class ProcessStartedRecord(msgspec.Struct, frozen=True, kw_only=True, tag="process_started"):
    reservation_id: str
    pid: int
    # Tells a reused pid apart: /proc/<pid>/stat starttime, clock ticks since boot.
    start_ticks: int | None = None
    # Older records: psutil create_time(), wall-clock seconds (it shifts with the clock).
    start_time: float = 0.0


class ProcessEndedRecord(msgspec.Struct, frozen=True, kw_only=True, tag="process_ended"):
    reservation_id: str
    pid: int


class EndedRecord(msgspec.Struct, frozen=True, kw_only=True, tag="ended"):
    """An invocation that ended: what it was asked (a digest) and how it ended."""

    invocation_id: str
    request_digest: str
    ended_at: float  # Unix time: the retention window must hold across restarts
    outcome: bytes  # the supervisor's encoding; the journal does not read it


Record = ReserveRecord | ReleaseRecord | ProcessStartedRecord | ProcessEndedRecord | EndedRecord
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


class ProcessRecord(msgspec.Struct, frozen=True, kw_only=True):
    reservation_id: str
    pid: int
    start_ticks: int | None = None
    start_time: float = 0.0  # only in records written before start_ticks existed


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
            "as it was: inspect it, or move it aside to start without it"
        )


def frame(record: Record) -> bytes:
    """The record as it is written: length, CRC32, msgpack payload."""
    payload = _encoder.encode(record)
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def _check_safe(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise JournalUnsafe(UnsafeReason.SYMLINK, path)
    if not stat.S_ISREG(st.st_mode):
        raise JournalUnsafe(UnsafeReason.NOT_REGULAR_FILE, path)
    if st.st_uid != os.geteuid():
        raise JournalUnsafe(UnsafeReason.WRONG_OWNER, path)
    if st.st_mode & 0o077:
        raise JournalUnsafe(UnsafeReason.OPEN_PERMISSIONS, path)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _State:
    """The live view the log describes; replay and append both update it."""

    def __init__(self, *, retain_ended: int, retain_ended_s: float) -> None:
        self.reservations: dict[str, Reservation] = {}
        self.processes: dict[int, ProcessRecord] = {}
        self.ended: OrderedDict[str, EndedRecord] = OrderedDict()
        self._retain_ended = retain_ended
        self._retain_ended_s = retain_ended_s

    def apply(self, record: Record) -> None:
        match record:
            case ReserveRecord(reservation=r):
                self.reservations[r.reservation_id] = r
            case ReleaseRecord(reservation_id=rid):
                self.reservations.pop(rid, None)
            case ProcessStartedRecord(reservation_id=rid, pid=pid, start_ticks=k, start_time=t):
                self.processes[pid] = ProcessRecord(
                    reservation_id=rid, pid=pid, start_ticks=k, start_time=t
                )
            case ProcessEndedRecord(pid=pid):
                self.processes.pop(pid, None)
            case EndedRecord(invocation_id=iid):
                self.ended.pop(iid, None)
                self.ended[iid] = record
                while len(self.ended) > self._retain_ended:
                    self.ended.popitem(last=False)

    def _fresh(self, record: EndedRecord) -> bool:
        return record.ended_at >= time.time() - self._retain_ended_s

    def live_ended(self) -> dict[str, EndedRecord]:
        """The ended invocations still inside the retention window, oldest first."""
        return {iid: r for iid, r in self.ended.items() if self._fresh(r)}

    def live_ended_one(self, invocation_id: str) -> EndedRecord | None:
        record = self.ended.get(invocation_id)
        return record if record is not None and self._fresh(record) else None

    def size(self) -> int:
        return len(self.reservations) + len(self.processes) + len(self.ended)

    def records(self) -> list[Record]:
        out: list[Record] = [ReserveRecord(reservation=r) for r in self.reservations.values()]
        out.extend(
            ProcessStartedRecord(
                reservation_id=p.reservation_id,
                pid=p.pid,
                start_ticks=p.start_ticks,
                start_time=p.start_time,
            )
            for p in self.processes.values()
        )
        out.extend(self.live_ended().values())
        return out


class _Scan(msgspec.Struct, frozen=True):
    records: int
    good: int  # bytes of whole, good records from the start of the file
    problem: str | None = None
    torn: bool = False  # the problem is a torn last record, not corruption


def _frame_at(data: bytes, offset: int) -> Record | None:
    """The record whose whole, good frame starts at `offset`, else None."""
    if len(data) - offset < _HEADER.size:
        return None
    length, crc = _HEADER.unpack_from(data, offset)
    start = offset + _HEADER.size
    if length > MAX_RECORD_BYTES or start + length > len(data):
        return None
    payload = data[start : start + length]
    if zlib.crc32(payload) != crc:
        return None
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError:
        return None


def _frame_after(data: bytes, offset: int) -> bool:
    """Does a whole, good frame start anywhere after `offset`? (A torn record is the
    last thing in the file; a corrupted length is followed by the records it hides.)"""
    budget = _RESYNC_BUDGET
    for at in range(offset + 1, len(data) - _HEADER.size + 1):
        length = _HEADER.unpack_from(data, at)[0]
        if length > MAX_RECORD_BYTES or at + _HEADER.size + length > len(data):
            continue
        budget -= length
        if budget < 0 or _frame_at(data, at) is not None:
            return True
    return False


def _replay(data: bytes, state: _State) -> _Scan:
    """Apply every good frame from the start; say where and why it stopped."""
    scan = _scan_frames(data, state)
    if scan.problem is not None and not scan.torn and not any(data[scan.good :]):
        # The file was extended but the bytes never reached the disk: they read as 0.
        return _Scan(scan.records, scan.good, "zero_tail", torn=True)
    return scan


def _scan_frames(data: bytes, state: _State) -> _Scan:
    offset = count = 0
    while offset < len(data):
        if len(data) - offset < _HEADER.size:
            return _Scan(count, offset, "torn_header", torn=True)
        length, crc = _HEADER.unpack_from(data, offset)
        if length > MAX_RECORD_BYTES:
            return _Scan(count, offset, "bad_length")
        start = offset + _HEADER.size
        if start + length > len(data):
            if _frame_after(data, offset):
                return _Scan(count, offset, "bad_length")
            return _Scan(count, offset, "torn_record", torn=True)
        payload = data[start : start + length]
        if zlib.crc32(payload) != crc:
            return _Scan(count, offset, "bad_crc")
        try:
            record = _decoder.decode(payload)
        except msgspec.DecodeError:
            return _Scan(count, offset, "undecodable_record")
        state.apply(record)
        count += 1
        offset = start + length
    return _Scan(count, offset)


def _write_aside(path: Path, data: bytes) -> None:
    """Replace `path` with `data` (0600): temp file, fsync, rename, fsync the dir."""
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _drop_torn_tail(path: Path, fd: int, data: bytes, scan: _Scan) -> None:
    """Keep a copy of the torn bytes, then truncate them away."""
    aside = path.with_name(path.name + ".torn")
    _write_aside(aside, data[scan.good :])
    log.warning(
        "journal %s: %s at byte %d (a write cut short by a crash); %d bytes after %d good "
        "records copied to %s and dropped",
        path,
        scan.problem,
        scan.good,
        len(data) - scan.good,
        scan.records,
        aside,
    )
    os.ftruncate(fd, scan.good)
    os.fsync(fd)


class Journal:
    """Append-only reservation log. Methods are synchronous (they fsync): call them from
    a worker thread where blocking the event loop matters."""

    def __init__(
        self,
        path: Path,
        fd: int,
        state: _State,
        records: int,
        size: int,
        *,
        durable: bool,
        compact_every: int,
    ) -> None:
        self.path = path
        self._fd = fd
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
    ) -> tuple[Journal, JournalReplay]:
        """Open and replay; raises JournalUnsafe or JournalCorrupt (the file untouched)."""
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = state_dir / JOURNAL_FILENAME
        try:
            _check_safe(path, os.lstat(path))
            created = False
        except FileNotFoundError:
            created = True
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
            state = _State(retain_ended=retain_ended, retain_ended_s=retain_ended_s)
            scan = _replay(data, state)
            if scan.problem is not None and not scan.torn:
                raise JournalCorrupt(path, scan.good, scan.problem)
            if scan.torn:
                _drop_torn_tail(path, fd, data, scan)
            elif not data and not created:
                log.info("journal %s is empty: no reservations to recover", path)
            if created:
                _fsync_dir(state_dir)
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
            _write_all(self._fd, data)
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
        """`start_ticks`: `node.machine.proc.process_start_ticks(pid)`, read before the
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
            _write_all(new_fd, b"".join(frame(r) for r in records))
            os.fsync(new_fd)
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
        _fsync_dir(self.path.parent)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
