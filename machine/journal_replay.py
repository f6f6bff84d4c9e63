"""Reading the reservation journal back on open: the live state its records
describe, where the good records end, and what to do with a torn tail.

A crash can tear only the record being appended, the last one, and only by
ending the file early: a *torn last record* is fewer than 8 header bytes at the
end of the file, or a header whose declared length (within the bound) runs past
the end of the file with no complete record anywhere after it, or nothing but
zero bytes from the first bad frame to the end. Anything else is corruption
(`Scan.torn` is False): `journal.py` refuses to open such a file.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections import OrderedDict
from pathlib import Path

import msgspec

from machine.journal_records import (
    HEADER,
    MAX_RECORD_BYTES,
    EndedRecord,
    ProcessEndedRecord,
    ProcessRecord,
    ProcessStartedRecord,
    Record,
    ReleaseRecord,
    ReserveRecord,
    decode_record,
)
from machine.ledger import Reservation

__all__ = [
    "LiveState",
    "Scan",
    "drop_torn_tail",
    "fsync_dir",
    "scan_journal",
    "write_all",
    "write_aside",
]

log = logging.getLogger(__name__)

# Looking for whole records after a length that runs past the end of the file reads
# at most this many payload bytes; past it the tail is judged corrupt (fail closed).
_RESYNC_BUDGET = 64 << 20


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LiveState:
    """The live view the log describes; replay and append both update it. `ended`:
    the endings the log holds, not yet moved into the index of ended invocations."""

    def __init__(self) -> None:
        self.reservations: dict[str, Reservation] = {}
        self.processes: dict[int, ProcessRecord] = {}
        self.ended: OrderedDict[str, EndedRecord] = OrderedDict()

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

    def size(self) -> int:
        return len(self.reservations) + len(self.processes) + len(self.ended)

    def records(self, *, ended: bool = True) -> list[Record]:
        """The records a compacted log holds; `ended`: the endings too."""
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
        if ended:
            out.extend(self.ended.values())
        return out


class Scan(msgspec.Struct, frozen=True):
    records: int
    good: int  # bytes of whole, good records from the start of the file
    problem: str | None = None
    torn: bool = False  # the problem is a torn last record, not corruption


def _frame_at(data: bytes, offset: int) -> Record | None:
    """The record whose whole, good frame starts at `offset`, else None."""
    if len(data) - offset < HEADER.size:
        return None
    length, crc = HEADER.unpack_from(data, offset)
    start = offset + HEADER.size
    if length > MAX_RECORD_BYTES or start + length > len(data):
        return None
    payload = data[start : start + length]
    if zlib.crc32(payload) != crc:
        return None
    try:
        return decode_record(payload)
    except msgspec.DecodeError:
        return None


def _frame_after(data: bytes, offset: int) -> bool:
    """Does a whole, good frame start anywhere after `offset`? (A torn record is the
    last thing in the file; a corrupted length is followed by the records it hides.)"""
    budget = _RESYNC_BUDGET
    for at in range(offset + 1, len(data) - HEADER.size + 1):
        length = HEADER.unpack_from(data, at)[0]
        if length > MAX_RECORD_BYTES or at + HEADER.size + length > len(data):
            continue
        budget -= length
        if budget < 0 or _frame_at(data, at) is not None:
            return True
    return False


def scan_journal(data: bytes, state: LiveState) -> Scan:
    """Apply every good frame from the start; say where and why it stopped."""
    scan = _scan_frames(data, state)
    if scan.problem is not None and not scan.torn and not any(data[scan.good :]):
        # The file was extended but the bytes never reached the disk: they read as 0.
        return Scan(scan.records, scan.good, "zero_tail", torn=True)
    return scan


def _scan_frames(data: bytes, state: LiveState) -> Scan:
    offset = count = 0
    while offset < len(data):
        if len(data) - offset < HEADER.size:
            return Scan(count, offset, "torn_header", torn=True)
        length, crc = HEADER.unpack_from(data, offset)
        if length > MAX_RECORD_BYTES:
            return Scan(count, offset, "bad_length")
        start = offset + HEADER.size
        if start + length > len(data):
            if _frame_after(data, offset):
                return Scan(count, offset, "bad_length")
            return Scan(count, offset, "torn_record", torn=True)
        payload = data[start : start + length]
        if zlib.crc32(payload) != crc:
            return Scan(count, offset, "bad_crc")
        try:
            record = decode_record(payload)
        except msgspec.DecodeError:
            return Scan(count, offset, "undecodable_record")
        state.apply(record)
        count += 1
        offset = start + length
    return Scan(count, offset)


def write_aside(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace `path` with `data` (`mode`): temp file, fsync, rename, fsync the dir."""
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        write_all(fd, data)
        os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def drop_torn_tail(path: Path, fd: int, data: bytes, scan: Scan) -> None:
    """Keep a copy of the torn bytes, then truncate them away."""
    aside = path.with_name(path.name + ".torn")
    write_aside(aside, data[scan.good :])
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
