"""Reservation journal: durability framing, recovery of bad tails, safety, reconcile."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import time
import zlib
from pathlib import Path

import pytest
import trio

from machine.journal import (
    JOURNAL_FILENAME,
    MAX_IDS,
    EndedRecord,
    Journal,
    JournalCorrupt,
    JournalError,
    JournalUnsafe,
    Record,
    ReserveRecord,
    UnsafeReason,
    frame,
)
from machine.lanes import Isolation, LaneKind, Requirement
from machine.ledger import LaneGrant, Reservation
from machine.proc import process_start_ticks
from machine.reconcile import Spared, SpareReason, reconcile


def reservation(rid: str, cpu: int = 100) -> Reservation:
    return Reservation(
        reservation_id=rid,
        cpu_millis=cpu,
        memory_bytes=1 << 20,
        lanes=(
            LaneGrant(
                lane_id="lane_0123456789abcdef",
                kind=LaneKind.GPU,
                device_id="GPU-1",
                visible_uuid="GPU-1",
                vram_bytes=1 << 30,
            ),
        ),
        isolation=Isolation.SHARED,
        requirement=Requirement.GPU,
    )


def test_round_trip_and_mode(tmp_path: Path) -> None:
    journal, replay = Journal.open(tmp_path / "state")
    assert replay.reservations == {} and replay.records == 0
    path = tmp_path / "state" / JOURNAL_FILENAME
    assert path.stat().st_mode & 0o777 == 0o600
    journal.record_reserve(reservation("a"))
    journal.record_reserve(reservation("b"))
    journal.record_release("a")
    journal.record_process_started("b", 4242, 1234)
    journal.close()
    _, replay = Journal.open(tmp_path / "state")
    assert replay.reservations == {"b": reservation("b")}
    assert replay.processes[4242].start_ticks == 1234
    assert replay.problem is None


def unacknowledged(state_dir: Path, *records: Record) -> None:
    """Append records as a daemon killed mid-write left them: never acknowledged, so
    beyond the journal's mark (a crash can tear only these)."""
    with (state_dir / JOURNAL_FILENAME).open("ab") as file:
        file.write(b"".join(frame(r) for r in records))


def test_torn_tail_is_recovered(tmp_path: Path) -> None:
    journal, _ = Journal.open(tmp_path)
    journal.record_reserve(reservation("a"))
    journal.close()
    unacknowledged(tmp_path, ReserveRecord(reservation=reservation("b")))
    path = tmp_path / JOURNAL_FILENAME
    mark = tmp_path / (JOURNAL_FILENAME + ".mark")
    whole, acknowledged = path.read_bytes(), mark.read_bytes()
    for cut in range(len(whole) - 1, len(whole) // 2, -7):
        path.write_bytes(whole[:cut])
        mark.write_bytes(acknowledged)  # as the crash left it: "a" acknowledged
        journal, replay = Journal.open(tmp_path)
        assert set(replay.reservations) == {"a"}
        assert replay.problem in ("torn_header", "torn_record")
        # The file was truncated to the good prefix: appends after it are readable.
        journal.record_reserve(reservation("c"))
        journal.close()
        _, replay = Journal.open(tmp_path)
        assert set(replay.reservations) == {"a", "c"} and replay.problem is None


def _three_records(tmp_path: Path) -> tuple[Path, bytes, int]:
    """Two acknowledged records and a third a crash cut short of acknowledging."""
    journal, _ = Journal.open(tmp_path)
    for rid in "ab":
        journal.record_reserve(reservation(rid))
    journal.close()
    unacknowledged(tmp_path, ReserveRecord(reservation=reservation("c")))
    path = tmp_path / JOURNAL_FILENAME
    data = path.read_bytes()
    return path, data, len(data) // 3


def _refused(tmp_path: Path, path: Path, offset: int, problem: str) -> None:
    """Opening refuses, naming the file and the offset, and leaves every byte as it was."""
    before = path.read_bytes()
    with pytest.raises(JournalCorrupt) as info:
        Journal.open(tmp_path)
    assert (info.value.offset, info.value.problem) == (offset, problem)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and f"byte {offset}" in message
    assert path.read_bytes() == before
    assert not list(tmp_path.glob("*.torn"))


def test_a_flipped_byte_mid_file_refuses_and_keeps_the_file(tmp_path: Path) -> None:
    path, data, frame = _three_records(tmp_path)
    flipped = bytearray(data)
    flipped[frame + 12] ^= 0xFF  # a payload byte of the second record
    path.write_bytes(bytes(flipped))
    _refused(tmp_path, path, frame, "bad_crc")


def test_a_flipped_byte_in_the_last_complete_record_refuses(tmp_path: Path) -> None:
    # It ends exactly at the end of the file: a crash cannot write a whole frame wrong.
    path, data, frame = _three_records(tmp_path)
    flipped = bytearray(data)
    flipped[2 * frame + 12] ^= 0x01
    path.write_bytes(bytes(flipped))
    _refused(tmp_path, path, 2 * frame, "bad_crc")


@pytest.mark.parametrize("length", [2, 0x0001_0000, 0xFFFF_FFFF])
def test_a_corrupted_first_length_refuses(tmp_path: Path, length: int) -> None:
    # Shorter: the CRC fails. Longer but within the bound: it runs past the end of the
    # file like a torn write, but whole records follow it. Huge: over the bound.
    path, data, _ = _three_records(tmp_path)
    path.write_bytes(length.to_bytes(4, "big") + data[4:])
    problem = {2: "bad_crc", 0x0001_0000: "bad_length", 0xFFFF_FFFF: "bad_length"}[length]
    _refused(tmp_path, path, 0, problem)


def test_garbage_length_and_undecodable_refuse(tmp_path: Path) -> None:
    path = tmp_path / JOURNAL_FILENAME
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    os.write(fd, b"\xff\xff\xff\xff\x00\x00\x00\x00junk")
    os.close(fd)
    _refused(tmp_path, path, 0, "bad_length")
    payload = b"\x81\xa1x\x01"  # valid msgpack, not a record
    frame = len(payload).to_bytes(4, "big") + zlib.crc32(payload).to_bytes(4, "big") + payload
    path.write_bytes(frame)
    _refused(tmp_path, path, 0, "undecodable_record")


def test_a_torn_tail_is_copied_aside_before_truncation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, data, frame = _three_records(tmp_path)
    path.write_bytes(data[: 2 * frame + 12])
    _, replay = Journal.open(tmp_path)
    assert set(replay.reservations) == {"a", "b"} and replay.problem == "torn_record"
    assert path.read_bytes() == data[: 2 * frame]
    aside = tmp_path / (JOURNAL_FILENAME + ".torn")
    assert aside.read_bytes() == data[2 * frame : 2 * frame + 12]
    assert aside.stat().st_mode & 0o777 == 0o600
    assert str(aside) in caplog.text and f"byte {2 * frame}" in caplog.text


def test_a_tail_of_zeros_is_torn_not_corrupt(tmp_path: Path) -> None:
    # A crash can leave the file longer than what reached the disk: the rest reads as
    # zeros. No record is all zeros, so nothing acknowledged can hide in there.
    path, data, frame = _three_records(tmp_path)
    path.write_bytes(data[: 2 * frame] + bytes(4096))
    _, replay = Journal.open(tmp_path)
    assert set(replay.reservations) == {"a", "b"} and replay.problem == "zero_tail"
    assert path.read_bytes() == data[: 2 * frame]
    assert (tmp_path / (JOURNAL_FILENAME + ".torn")).read_bytes() == bytes(4096)


def test_zeros_with_a_record_after_them_are_corrupt(tmp_path: Path) -> None:
    path, data, frame = _three_records(tmp_path)
    path.write_bytes(data[:frame] + bytes(frame) + data[2 * frame :])
    _refused(tmp_path, path, frame, "undecodable_record")


def test_an_empty_journal_starts_fresh_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / JOURNAL_FILENAME
    path.write_bytes(b"")
    path.chmod(0o600)
    caplog.set_level(logging.INFO, logger="machine.journal")
    journal, replay = Journal.open(tmp_path)
    journal.close()
    assert replay.records == 0 and replay.problem is None
    assert f"journal {path} is empty" in caplog.text


def test_refuses_symlink_and_open_permissions(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    target.chmod(0o600)
    (tmp_path / JOURNAL_FILENAME).symlink_to(target)
    with pytest.raises(JournalUnsafe) as info:
        Journal.open(tmp_path)
    assert info.value.reason is UnsafeReason.SYMLINK
    other = tmp_path / "other"
    other.mkdir()
    (other / JOURNAL_FILENAME).write_bytes(b"")
    (other / JOURNAL_FILENAME).chmod(0o644)
    with pytest.raises(JournalUnsafe) as info:
        Journal.open(other)
    assert info.value.reason is UnsafeReason.OPEN_PERMISSIONS
    third = tmp_path / "third"
    (third / JOURNAL_FILENAME).mkdir(parents=True)
    with pytest.raises(JournalUnsafe) as info:
        Journal.open(third)
    assert info.value.reason is UnsafeReason.NOT_REGULAR_FILE


def test_compaction_keeps_live_state(tmp_path: Path) -> None:
    journal, _ = Journal.open(tmp_path, compact_every=16)
    for i in range(40):
        journal.record_reserve(reservation(f"r{i}"))
        if i % 4:
            journal.record_release(f"r{i}")
    assert journal.record_count < 40
    live = journal.reservations()
    journal.close()
    assert (tmp_path / JOURNAL_FILENAME).stat().st_mode & 0o777 == 0o600
    assert not list(tmp_path.glob(".*.tmp"))
    _, replay = Journal.open(tmp_path)
    assert replay.reservations == live == {f"r{i}": reservation(f"r{i}") for i in range(0, 40, 4)}


def churn(journal: Journal, start: int, count: int) -> None:
    """Reserve and release: enough dead records to trigger compaction."""
    for i in range(start, start + count):
        journal.record_reserve(reservation(f"t{i}"))
        journal.record_release(f"t{i}")


def test_failed_open_during_compaction_loses_no_append(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal, _ = Journal.open(tmp_path, compact_every=8)
    journal.record_reserve(reservation("keep"))
    path = tmp_path / JOURNAL_FILENAME
    real_open = os.open

    def no_reopen(file: object, *args: object, **kwargs: object) -> int:
        if Path(str(file)) == path:  # the log itself, reopened after the rename
            raise OSError(24, "Too many open files")
        return real_open(file, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", no_reopen)
    churn(journal, 0, 8)  # compacts along the way
    assert journal.record_count < 17
    journal.record_reserve(reservation("after"))
    monkeypatch.undo()
    journal.close()
    _, replay = Journal.open(tmp_path)
    assert set(replay.reservations) == {"keep", "after"}


def test_failed_rename_keeps_appending_and_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    journal, _ = Journal.open(tmp_path, compact_every=8)
    journal.record_reserve(reservation("keep"))

    def no_rename(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_rename)
    churn(journal, 0, 8)  # every compaction fails; no append does
    assert journal.record_count == 17
    assert "compaction failed" in caplog.text
    assert not list(tmp_path.glob(".*.tmp"))
    journal.record_reserve(reservation("during"))
    monkeypatch.undo()
    journal.record_release("during")  # compaction retried, and now it works
    assert journal.record_count == 1
    journal.record_reserve(reservation("after"))
    journal.close()
    _, replay = Journal.open(tmp_path)
    assert set(replay.reservations) == {"keep", "after"} and replay.problem is None


def spawn(*argv: str) -> subprocess.Popen[bytes]:
    # In its own session, as the supervisor starts invocations: pgid == pid.
    return subprocess.Popen(argv, start_new_session=True)


def spawn_sleep() -> subprocess.Popen[bytes]:
    return spawn("sleep", "60")


async def wait_exit(proc: subprocess.Popen[bytes]) -> int | None:
    deadline = trio.current_time() + 5
    while trio.current_time() < deadline:
        if proc.poll() is not None:
            break
        await trio.sleep(0.02)
    return proc.poll()


async def test_reconcile_kills_matching_process(tmp_path: Path) -> None:
    proc = spawn_sleep()
    try:
        journal, _ = Journal.open(tmp_path)
        journal.record_reserve(reservation("inv-1"))
        journal.record_process_started("inv-1", proc.pid, process_start_ticks(proc.pid))
        journal.close()  # the daemon "dies" here
        journal, replay = Journal.open(tmp_path)
        assert set(replay.reservations) == {"inv-1"}
        report = await reconcile(journal, grace=2.0)
        assert report.terminated == (proc.pid,)
        assert report.released == ("inv-1",)
        assert await wait_exit(proc) == -signal.SIGTERM
        journal.close()
        _, replay = Journal.open(tmp_path)
        assert replay.reservations == {} and replay.processes == {}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_reconcile_never_kills_a_reused_pid(tmp_path: Path) -> None:
    proc = spawn_sleep()
    try:
        journal, _ = Journal.open(tmp_path)
        journal.record_reserve(reservation("inv-2"))
        start = process_start_ticks(proc.pid)
        assert start is not None
        journal.record_process_started("inv-2", proc.pid, start - 1)  # another process's time
        report = await reconcile(journal, grace=0.5)
        assert report.spared == (Spared(proc.pid, SpareReason.PID_REUSED),)
        assert report.terminated == ()
        assert report.released == ("inv-2",)  # our process is gone; its resources are free
        assert proc.poll() is None
        journal.close()
    finally:
        proc.kill()
        proc.wait()


async def test_reconcile_sigkills_after_grace(tmp_path: Path) -> None:
    proc = spawn("sh", "-c", "trap '' TERM; while :; do sleep 0.05; done")
    try:
        await trio.sleep(0.2)  # let the shell install its trap
        journal, _ = Journal.open(tmp_path)
        journal.record_reserve(reservation("inv-3"))
        journal.record_process_started("inv-3", proc.pid, process_start_ticks(proc.pid))
        report = await reconcile(journal, grace=0.3, kill_wait=3.0)
        assert report.terminated == (proc.pid,)
        assert await wait_exit(proc) == -signal.SIGKILL
        journal.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_reconcile_gone_process_releases(tmp_path: Path) -> None:
    proc = spawn_sleep()
    start = process_start_ticks(proc.pid)
    proc.kill()
    proc.wait()
    journal, _ = Journal.open(tmp_path)
    journal.record_reserve(reservation("inv-4"))
    journal.record_reserve(reservation("inv-5"))  # never got a process
    journal.record_process_started("inv-4", proc.pid, start)
    report = await reconcile(journal)
    assert report.gone == (proc.pid,)
    assert set(report.released) == {"inv-4", "inv-5"}
    assert journal.reservations() == {}
    journal.close()


class FullDisk:
    """os.write for one descriptor: the next `fail` writes land half their bytes, then
    the disk is full (ENOSPC), as a real short write followed by a failing one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fd: int) -> None:
        self.fd = fd
        self.fail = 0
        self._real = os.write
        monkeypatch.setattr(os, "write", self.write)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        if fd != self.fd or not self.fail:
            return self._real(fd, data)
        self.fail -= 1
        half = len(data) // 2
        if half:
            self._real(fd, bytes(data[:half]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_failed_write_is_truncated_away_and_later_records_survive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal, _ = Journal.open(tmp_path, reserve_bytes=0)  # no room kept back to fall on
    journal.record_reserve(reservation("a"))
    good = (tmp_path / JOURNAL_FILENAME).stat().st_size
    disk = FullDisk(monkeypatch, journal._fd)
    disk.fail = 1
    with pytest.raises(OSError) as info:
        journal.record_reserve(reservation("lost"))
    assert info.value.errno == errno.ENOSPC
    assert (tmp_path / JOURNAL_FILENAME).stat().st_size == good  # no partial record left
    assert "lost" not in journal.reservations()
    assert journal.write_problem is not None and "No space left" in journal.write_problem
    # Space returns: the records after the failure are readable after a restart.
    journal.record_reserve(reservation("b"))
    journal.record_process_started("b", 4242, 1)
    assert journal.write_problem is None
    journal.close()
    _, replay = Journal.open(tmp_path)
    assert set(replay.reservations) == {"a", "b"} and set(replay.processes) == {4242}
    assert replay.problem is None


def test_a_tail_that_cannot_be_truncated_blocks_appends_until_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal, _ = Journal.open(tmp_path)
    journal.record_reserve(reservation("a"))
    disk = FullDisk(monkeypatch, journal._fd)
    real_truncate = os.ftruncate
    broken = [True]

    def ftruncate(fd: int, length: int) -> None:
        if broken[0]:
            raise OSError(errno.EIO, "I/O error")
        real_truncate(fd, length)

    monkeypatch.setattr(os, "ftruncate", ftruncate)
    disk.fail = 1
    with pytest.raises(OSError):
        journal.record_reserve(reservation("lost"))
    # A record must never follow a partial one: refused while the tail is there.
    with pytest.raises(JournalError, match="partial record"):
        journal.record_reserve(reservation("refused"))
    assert journal.write_problem is not None
    broken[0] = False
    journal.record_reserve(reservation("b"))
    journal.close()
    _, replay = Journal.open(tmp_path)
    assert set(replay.reservations) == {"a", "b"} and replay.problem is None


def test_recover_rewrites_the_journal_and_clears_the_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal, _ = Journal.open(tmp_path, reserve_bytes=0)
    journal.record_reserve(reservation("a"))
    disk = FullDisk(monkeypatch, journal._fd)
    disk.fail = 1
    with pytest.raises(OSError):
        journal.record_release("a")
    assert journal.write_problem is not None
    journal.recover()
    assert journal.write_problem is None
    journal.close()
    _, replay = Journal.open(tmp_path)
    assert set(replay.reservations) == {"a"}


def ended(iid: str, at: float | None = None) -> EndedRecord:
    return EndedRecord(
        invocation_id=iid,
        request_digest="d-" + iid,
        ended_at=time.time() if at is None else at,
        outcome=b'{"state":"succeeded"}',
    )


class NodeClock:
    """A monotonic clock the test moves (node time is counted in it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_ended_invocations_survive_compaction_and_restart_for_the_window(
    tmp_path: Path,
) -> None:
    clock = NodeClock()
    journal, _ = Journal.open(tmp_path, compact_every=8, window_s=3600, listed=5, clock=clock)
    for i in range(7):
        journal.record_ended(ended(f"e{i}"))
    churn(journal, 0, 8)  # compaction moves the endings into the index along the way
    assert journal.record_count < 16 and journal.index.count == 7
    assert journal.ended("e6") == ended("e6", at=journal.ended("e6").ended_at)  # type: ignore[union-attr]
    assert journal.ended("e0") is not None  # no count bound short of --idempotency-max-ids
    clock.now += 1800
    journal.close()
    journal, replay = Journal.open(tmp_path, window_s=3600, listed=5, clock=clock)
    assert list(replay.ended) == ["e2", "e3", "e4", "e5", "e6"]  # the newest, to be listed
    assert replay.ended["e4"].request_digest == "d-e4"
    assert all(journal.ended(f"e{i}") is not None for i in range(7))
    # Node time goes on from where the last run left it: 1,800 s more ends the window.
    clock.now += 1799
    assert journal.ended("e0") is not None
    clock.now += 2
    assert journal.ended("e0") is None and journal.room() == MAX_IDS - 7
    assert journal.expire() == 7 and journal.room() == MAX_IDS
    journal.close()


def test_the_same_id_ending_again_keeps_only_its_latest_record(tmp_path: Path) -> None:
    journal, _ = Journal.open(tmp_path, listed=2, compact_every=4)
    journal.record_ended(ended("a", at=time.time() - 10))
    churn(journal, 0, 4)  # "a" moves into the index
    journal.record_ended(ended("b"))
    journal.record_ended(ended("a"))
    journal.close()
    journal, replay = Journal.open(tmp_path, listed=2)
    assert list(replay.ended) == ["b", "a"] and replay.ended["a"].ended_at > time.time() - 5
    journal.compact()
    assert journal.ended("a").ended_at > time.time() - 5  # type: ignore[union-attr]
    journal.close()
