"""What the reservation journal holds: its record types and how one is framed.

A frame is a 4-byte big-endian length, a 4-byte CRC32 of the payload, then the
msgpack payload (a tagged msgspec Struct). `journal.py` writes and compacts
frames, `journal_replay.py` reads them back.
"""

from __future__ import annotations

import struct
import zlib

import msgspec

from machine.ledger import Reservation

__all__ = [
    "HEADER",
    "MAX_RECORD_BYTES",
    "EndedRecord",
    "ProcessEndedRecord",
    "ProcessRecord",
    "ProcessStartedRecord",
    "Record",
    "ReleaseRecord",
    "ReserveRecord",
    "decode_record",
    "frame",
]

HEADER = struct.Struct(">II")
# No honest record comes near this; a bigger length means a corrupt header.
MAX_RECORD_BYTES = 1 << 20


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


def frame(record: Record) -> bytes:
    """The record as it is written: length, CRC32, msgpack payload."""
    payload = _encoder.encode(record)
    return HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def decode_record(payload: bytes) -> Record:
    """The record in a frame's payload; raises msgspec.DecodeError."""
    return _decoder.decode(payload)
