"""The reservation journal: an fsync'd append-only log under the state dir.

Each record is framed as 4-byte big-endian length, 4-byte CRC32 of the
payload, then the msgpack payload (a tagged msgspec Struct). A crash at any
instant leaves a readable prefix: on open, replay stops at the first torn or
corrupt frame, logs what it dropped, truncates the file there and carries on
(it never refuses to start over a bad tail). Compaction rewrites the live
state to a temp file, fsyncs it and renames it over the log (atomic).

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
import zlib
from pathlib import Path

import msgspec

from node.machine.ledger import Reservation

__all__ = [
    "JOURNAL_FILENAME",
    "Journal",
    "JournalError",
    "JournalReplay",
    "JournalUnsafe",
    "ProcessEndedRecord",
    "ProcessRecord",
    "ProcessStartedRecord",
    "ReleaseRecord",
    "ReserveRecord",
    "UnsafeReason",
]

log = logging.getLogger(__name__)

JOURNAL_FILENAME = "reservations.journal"
_HEADER = struct.Struct(">II")
# No honest record comes near this; a bigger length means a corrupt header.
MAX_RECORD_BYTES = 1 << 20


class ReserveRecord(msgspec.Struct, frozen=True, kw_only=True, tag="reserve"):
    reservation: Reservation


class ReleaseRecord(msgspec.Struct, frozen=True, kw_only=True, tag="release"):
    reservation_id: str


class ProcessStartedRecord(msgspec.Struct, frozen=True, kw_only=True, tag="process_started"):
    reservation_id: str
    pid: int
    start_time: float  # psutil create_time(): tells a reused pid apart


class ProcessEndedRecord(msgspec.Struct, frozen=True, kw_only=True, tag="process_ended"):
    reservation_id: str
    pid: int


Record = ReserveRecord | ReleaseRecord | ProcessStartedRecord | ProcessEndedRecord
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


class ProcessRecord(msgspec.Struct, frozen=True, kw_only=True):
    reservation_id: str
    pid: int
    start_time: float


class JournalReplay(msgspec.Struct, frozen=True, kw_only=True):
    """What the journal held on open."""

    reservations: dict[str, Reservation]
    # Processes recorded as started and not as ended, keyed by pid.
    processes: dict[int, ProcessRecord]
    records: int
    dropped_bytes: int = 0
    problem: str | None = None  # why the tail was dropped, if it was


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


def _frame(record: Record) -> bytes:
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

    def __init__(self) -> None:
        self.reservations: dict[str, Reservation] = {}
        self.processes: dict[int, ProcessRecord] = {}

    def apply(self, record: Record) -> None:
        match record:
            case ReserveRecord(reservation=r):
                self.reservations[r.reservation_id] = r
            case ReleaseRecord(reservation_id=rid):
                self.reservations.pop(rid, None)
            case ProcessStartedRecord(reservation_id=rid, pid=pid, start_time=t):
                self.processes[pid] = ProcessRecord(reservation_id=rid, pid=pid, start_time=t)
            case ProcessEndedRecord(pid=pid):
                self.processes.pop(pid, None)

    def records(self) -> list[Record]:
        out: list[Record] = [ReserveRecord(reservation=r) for r in self.reservations.values()]
        out.extend(
            ProcessStartedRecord(
                reservation_id=p.reservation_id, pid=p.pid, start_time=p.start_time
            )
            for p in self.processes.values()
        )
        return out


def _replay(data: bytes, state: _State) -> tuple[int, int, str | None]:
    """Apply every good frame; returns (records, good_length, problem)."""
    offset = count = 0
    while offset < len(data):
        if len(data) - offset < _HEADER.size:
            return count, offset, "torn_header"
        length, crc = _HEADER.unpack_from(data, offset)
        if length > MAX_RECORD_BYTES:
            return count, offset, "bad_length"
        start = offset + _HEADER.size
        payload = data[start : start + length]
        if len(payload) < length:
            return count, offset, "torn_record"
        if zlib.crc32(payload) != crc:
            return count, offset, "bad_crc"
        try:
            record = _decoder.decode(payload)
        except msgspec.DecodeError:
            return count, offset, "undecodable_record"
        state.apply(record)
        count += 1
        offset = start + length
    return count, offset, None


class Journal:
    """Append-only reservation log. Methods are synchronous (they fsync): call them from
    a worker thread where blocking the event loop matters."""

    def __init__(
        self, path: Path, fd: int, state: _State, records: int, *, durable: bool, compact_every: int
    ) -> None:
        self.path = path
        self._fd = fd
        self._state = state
        self._records = records
        self._durable = durable
        self._compact_every = compact_every

    @classmethod
    def open(
        cls, state_dir: Path, *, durable: bool = True, compact_every: int = 1024
    ) -> tuple[Journal, JournalReplay]:
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
            state = _State()
            records, good, problem = _replay(data, state)
            if problem is not None:
                # Recover up to the last good record; the lost tail was never acknowledged
                # as durable to anyone but the dead daemon.
                log.warning(
                    "journal %s: %s at byte %d; dropped %d bytes after %d good records",
                    path,
                    problem,
                    good,
                    len(data) - good,
                    records,
                )
                os.ftruncate(fd, good)
                os.fsync(fd)
            if created:
                _fsync_dir(state_dir)
        except BaseException:
            os.close(fd)
            raise
        replay = JournalReplay(
            reservations=dict(state.reservations),
            processes=dict(state.processes),
            records=records,
            dropped_bytes=len(data) - good,
            problem=problem,
        )
        return cls(path, fd, state, records, durable=durable, compact_every=compact_every), replay

    # -- appending ------------------------------------------------------------------
    def _append(self, record: Record) -> None:
        if self._fd < 0:
            raise JournalError("journal is closed")
        _write_all(self._fd, _frame(record))
        if self._durable:
            os.fsync(self._fd)
        self._state.apply(record)
        self._records += 1
        live = len(self._state.reservations) + len(self._state.processes)
        if self._records >= self._compact_every and self._records > 2 * live:
            try:
                self.compact()
            except Exception:
                # The record above is written and fsynced: it stands. Compaction is
                # retried on the next append.
                log.exception("journal %s: compaction failed; will retry", self.path)

    def record_reserve(self, reservation: Reservation) -> None:
        self._append(ReserveRecord(reservation=reservation))

    def record_release(self, reservation_id: str) -> None:
        self._append(ReleaseRecord(reservation_id=reservation_id))

    def record_process_started(self, reservation_id: str, pid: int, start_time: float) -> None:
        self._append(
            ProcessStartedRecord(reservation_id=reservation_id, pid=pid, start_time=start_time)
        )

    def record_process_ended(self, reservation_id: str, pid: int) -> None:
        self._append(ProcessEndedRecord(reservation_id=reservation_id, pid=pid))

    # -- reading --------------------------------------------------------------------
    def reservations(self) -> dict[str, Reservation]:
        return dict(self._state.reservations)

    def processes(self) -> dict[int, ProcessRecord]:
        return dict(self._state.processes)

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
            _write_all(new_fd, b"".join(_frame(r) for r in records))
            os.fsync(new_fd)
            os.replace(tmp, self.path)
        except BaseException:
            os.close(new_fd)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        old_fd, self._fd = self._fd, new_fd
        self._records = len(records)
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
