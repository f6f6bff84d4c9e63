"""Reservation journal: durability framing, recovery of bad tails, safety, reconcile."""

from __future__ import annotations

import os
import signal
import subprocess
import zlib
from pathlib import Path

import psutil  # type: ignore[import-untyped,unused-ignore]
import pytest
import trio

from node.machine.journal import JOURNAL_FILENAME, Journal, JournalUnsafe, UnsafeReason
from node.machine.lanes import Isolation, LaneKind, Requirement
from node.machine.ledger import LaneGrant, Reservation
from node.machine.reconcile import reconcile


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
    journal.record_process_started("b", 4242, 1234.5)
    journal.close()
    _, replay = Journal.open(tmp_path / "state")
    assert replay.reservations == {"b": reservation("b")}
    assert replay.processes[4242].start_time == 1234.5
    assert replay.problem is None


def test_torn_tail_is_recovered(tmp_path: Path) -> None:
    journal, _ = Journal.open(tmp_path)
    journal.record_reserve(reservation("a"))
    journal.record_reserve(reservation("b"))
    journal.close()
    path = tmp_path / JOURNAL_FILENAME
    whole = path.read_bytes()
    for cut in range(len(whole) - 1, len(whole) // 2, -7):
        path.write_bytes(whole[:cut])
        journal, replay = Journal.open(tmp_path)
        assert set(replay.reservations) == {"a"}
        assert replay.problem in ("torn_header", "torn_record")
        # The file was truncated to the good prefix: appends after it are readable.
        journal.record_reserve(reservation("c"))
        journal.close()
        _, replay = Journal.open(tmp_path)
        assert set(replay.reservations) == {"a", "c"} and replay.problem is None


def test_corrupt_crc_is_recovered(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    journal, _ = Journal.open(tmp_path)
    for rid in "abc":
        journal.record_reserve(reservation(rid))
    journal.close()
    path = tmp_path / JOURNAL_FILENAME
    data = bytearray(path.read_bytes())
    frame = len(data) // 3
    data[frame + 12] ^= 0xFF  # a payload byte of the second record
    path.write_bytes(bytes(data))
    _, replay = Journal.open(tmp_path)
    assert set(replay.reservations) == {"a"}
    assert replay.problem == "bad_crc" and replay.dropped_bytes == 2 * frame
    assert "bad_crc" in caplog.text


def test_garbage_length_and_undecodable(tmp_path: Path) -> None:
    path = tmp_path / JOURNAL_FILENAME
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    os.write(fd, b"\xff\xff\xff\xff\x00\x00\x00\x00junk")
    os.close(fd)
    _, replay = Journal.open(tmp_path)
    assert replay.problem == "bad_length" and replay.reservations == {}
    payload = b"\x81\xa1x\x01"  # valid msgpack, not a record
    frame = len(payload).to_bytes(4, "big") + zlib.crc32(payload).to_bytes(4, "big") + payload
    path.write_bytes(frame)
    _, replay = Journal.open(tmp_path)
    assert replay.problem == "undecodable_record"


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
        start = psutil.Process(proc.pid).create_time()
        journal.record_process_started("inv-1", proc.pid, start)
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
        start = psutil.Process(proc.pid).create_time()
        journal.record_process_started("inv-2", proc.pid, start - 100.0)  # another process's time
        report = await reconcile(journal, grace=0.5)
        assert report.reused == (proc.pid,) and report.terminated == ()
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
        journal.record_process_started("inv-3", proc.pid, psutil.Process(proc.pid).create_time())
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
    start = psutil.Process(proc.pid).create_time()
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
