"""The journal's high-water mark: how many records the journal held when it last
acknowledged a write, kept beside it in `<journal>.mark`.

A journal that lost records (truncated to zero, or cut mid-file by something
other than a crash) must not open as if it had not: its acknowledged ids would
be forgotten and could run again. So after every fsynced write the journal
writes its record count here, and on open a journal holding fewer records than
the mark is refused (`journal.JournalLost`) unless the operator accepts it.

The mark never claims more than the journal holds: it is written only after the
journal's fsync, and lowered *before* a compaction renames a shorter journal
into place. A torn last record after a crash was never acknowledged, so it is
beyond the mark and still dropped as before.

The file is 1 KiB: two 512-byte slots (separate sectors), each a magic, a
sequence number, the record count and a CRC32. Writes alternate between the
slots in place (`pwrite` and, when durable, `fdatasync`: one small extra flush
per group commit batch, no metadata, no rename), so a write torn by a power
loss leaves the other slot, the previous (lower or equal) count, readable.
Reading takes the valid slot with the highest sequence number; a file with no
valid slot is unreadable, which is refused like a loss.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

from machine.journal_replay import write_aside

__all__ = ["MARK_SUFFIX", "JournalMark", "MarkUnreadable", "read_mark"]

MARK_SUFFIX = ".mark"
_MAGIC = b"LGJM"
_SLOT = struct.Struct(">4sQQ")  # magic, sequence, records; then a CRC32 of these
_CRC = struct.Struct(">I")
_SLOT_BYTES = 512
_FILE_BYTES = 2 * _SLOT_BYTES

Check = Callable[[Path, os.stat_result], None]


class MarkUnreadable(Exception):
    """The mark exists but neither slot is whole: what was acknowledged is unknown."""


def _pack(sequence: int, records: int) -> bytes:
    body = _SLOT.pack(_MAGIC, sequence, records)
    return body + _CRC.pack(zlib.crc32(body))


def _unpack(data: bytes) -> tuple[int, int] | None:
    body = data[: _SLOT.size]
    crc = data[_SLOT.size : _SLOT.size + _CRC.size]
    if len(crc) < _CRC.size or _CRC.unpack(crc)[0] != zlib.crc32(body):
        return None
    magic, sequence, records = _SLOT.unpack(body)
    return (sequence, records) if magic == _MAGIC else None


def read_mark(path: Path, check: Check) -> tuple[int, int] | None:
    """(sequence, records) of the newest whole slot; None when there is no mark.
    `check` refuses an unsafe file (as the journal's own check does)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        check(path, os.lstat(path))  # a symlink: refused by name
        raise
    try:
        check(path, os.fstat(fd))
        data = os.pread(fd, _FILE_BYTES, 0)
    finally:
        os.close(fd)
    slots = [_unpack(data[at : at + _SLOT_BYTES]) for at in (0, _SLOT_BYTES)]
    whole = [slot for slot in slots if slot is not None]
    if not whole:
        raise MarkUnreadable(f"{path}: no whole slot in {len(data)} bytes")
    return max(whole)


class JournalMark:
    """The open mark file; `write` after every fsynced journal write."""

    def __init__(self, path: Path, fd: int, sequence: int, *, durable: bool) -> None:
        self.path = path
        self._fd = fd
        self._sequence = sequence
        self._durable = durable

    @classmethod
    def open(
        cls, path: Path, records: int, check: Check, *, sequence: int = 0, durable: bool
    ) -> JournalMark:
        """Replace the mark by one saying `records` (temp file, fsync, rename, fsync the
        dir: a crash leaves the old mark or the new one), then open it for writing."""
        sequence += 1
        slots = [bytes(_SLOT_BYTES), bytes(_SLOT_BYTES)]
        slots[sequence % 2] = _pack(sequence, records).ljust(_SLOT_BYTES, b"\0")
        write_aside(path, b"".join(slots))
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            check(path, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, sequence, durable=durable)

    def write(self, records: int, *, sync: bool = False) -> None:
        """Say the journal holds `records` (call only once they are fsynced there)."""
        if self._fd < 0:
            return
        sequence = self._sequence + 1
        os.pwrite(self._fd, _pack(sequence, records), (sequence % 2) * _SLOT_BYTES)
        if self._durable or sync:
            os.fdatasync(self._fd)
        self._sequence = sequence

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
