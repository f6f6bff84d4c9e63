"""Group commit: concurrent journal appends share fsyncs, and each still returns only
once its own record is durable; a failed batch fails every one of its waiters."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import pytest
import trio

from machine.group_commit import GroupCommit, JournalBacklog
from machine.journal import Journal, Record, ReleaseRecord, frame
from machine.ledger import ReservationRequest
from tests.unit.machine.test_model import open_machine


def _runner(limiter: trio.CapacityLimiter) -> Callable[[Callable[[], None]], Awaitable[None]]:
    async def run(write: Callable[[], None]) -> None:
        await trio.to_thread.run_sync(write, limiter=limiter)

    return run


class _CountingFsync:
    """os.fsync that counts the journal's calls and can be held until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fd: int) -> None:
        self.fd, self.calls, self._real = fd, 0, os.fsync
        self.gate = threading.Event()
        self.gate.set()
        monkeypatch.setattr(os, "fsync", self.fsync)

    def fsync(self, fd: int) -> None:
        if fd == self.fd:
            self.calls += 1
            self.gate.wait(10)
        self._real(fd)


async def test_concurrent_reserves_share_fsyncs_and_each_is_durable_when_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    machine = await open_machine(tmp_path)
    fsyncs = _CountingFsync(monkeypatch, machine.journal._fd)
    returned: list[str] = []

    async def reserve(i: int) -> None:
        await machine.reserve(ReservationRequest(reservation_id=f"r{i}", cpu_millis=1))
        # Durable now: a fresh reader of the file sees it.
        _, replay = Journal.open(tmp_path, durable=False)
        assert f"r{i}" in replay.reservations
        returned.append(f"r{i}")

    fsyncs.gate.clear()  # hold the first fsync so the others pile up behind it
    async with trio.open_nursery() as nursery:
        for i in range(64):
            nursery.start_soon(reserve, i)
        await trio.sleep(0.2)
        assert returned == []  # nobody is answered before its fsync
        fsyncs.gate.set()
    assert len(returned) == 64
    assert fsyncs.calls <= 3, f"{fsyncs.calls} fsyncs for 64 concurrent reserves"
    assert machine.group_commit.records == 64 and machine.group_commit.batches == fsyncs.calls
    await machine.aclose()


async def test_a_failed_batch_fails_every_waiter_and_is_cut_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    machine = await open_machine(tmp_path)
    await machine.reserve(ReservationRequest(reservation_id="held", cpu_millis=1))
    size = machine.journal.path.stat().st_size
    fsyncs = _CountingFsync(monkeypatch, machine.journal._fd)
    fd, real_write, full = machine.journal._fd, os.write, [True]

    def write(target: int, data: bytes | memoryview) -> int:
        if target != fd or not full[0]:
            return real_write(target, data)
        real_write(target, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", write)
    errors: list[BaseException] = []

    async def reserve(i: int) -> None:
        try:
            await machine.reserve(ReservationRequest(reservation_id=f"x{i}", cpu_millis=1))
        except OSError as exc:
            errors.append(exc)

    fsyncs.gate.clear()
    async with trio.open_nursery() as nursery:
        for i in range(16):
            nursery.start_soon(reserve, i)
        await trio.sleep(0.1)
        fsyncs.gate.set()
    assert len(errors) == 16 and all(e.errno == errno.ENOSPC for e in errors)  # type: ignore[attr-defined]
    assert len({id(e) for e in errors}) == 16  # each waiter raises its own copy
    assert set(machine.ledger.reservations()) == {"held"}  # every refused grant given back
    assert machine.journal.path.stat().st_size == size  # no partial frame left behind
    assert machine.journal_problem() is not None
    full[0] = False
    await machine.reserve(ReservationRequest(reservation_id="after", cpu_millis=1))
    assert machine.journal_problem() is None
    await machine.aclose()
    _, replay = Journal.open(tmp_path, durable=False)
    assert set(replay.reservations) == {"held", "after"}


async def test_batches_are_bounded_in_records_and_bytes(tmp_path: Path) -> None:
    journal, _ = Journal.open(tmp_path, durable=False)
    sizes: list[int] = []
    real = journal.append_framed

    def append_framed(batch: Sequence[tuple[Record, bytes]]) -> None:
        sizes.append(len(batch))
        real(batch)

    journal.append_framed = append_framed  # type: ignore[method-assign]
    group = GroupCommit(journal, run=_runner(trio.CapacityLimiter(1)), timeout=10, max_records=5)
    async with trio.open_nursery() as nursery:
        for i in range(23):
            nursery.start_soon(group.commit, ReleaseRecord(reservation_id=f"r{i}"))
    assert sum(sizes) == 23 and max(sizes) <= 5
    sizes.clear()
    one = len(frame(ReleaseRecord(reservation_id="s0")))
    small = GroupCommit(journal, run=_runner(trio.CapacityLimiter(1)), timeout=10, max_bytes=one)
    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(small.commit, ReleaseRecord(reservation_id=f"s{i}"))
    assert sum(sizes) == 6 and max(sizes) == 1  # one record is always taken, never two
    sizes.clear()
    await group.commit(*(ReleaseRecord(reservation_id=f"t{i}") for i in range(7)))
    assert sizes == [7]  # one commit's records go together, even past max_records
    journal.close()


async def test_a_full_backlog_refuses_at_once_and_writes_nothing_more(tmp_path: Path) -> None:
    journal, _ = Journal.open(tmp_path, durable=False)
    limiter = trio.CapacityLimiter(1)
    group = GroupCommit(journal, run=_runner(limiter), timeout=10, max_pending=4)
    async with trio.open_nursery() as nursery:
        await limiter.acquire()  # the disk is busy: nothing drains
        nursery.start_soon(group.commit, ReleaseRecord(reservation_id="taken"))
        await trio.sleep(0.01)  # the flusher took it and waits for the disk
        for i in range(4):
            nursery.start_soon(group.commit, ReleaseRecord(reservation_id=f"q{i}"))
        await trio.sleep(0.01)
        with pytest.raises(JournalBacklog):
            await group.commit(ReleaseRecord(reservation_id="over"))
        limiter.release()
    journal.close()
    _, replay = Journal.open(tmp_path, durable=False)
    assert replay.records == 5  # the refused record was never written


async def test_a_caller_that_gives_up_before_its_batch_is_taken_is_not_written(
    tmp_path: Path,
) -> None:
    journal, _ = Journal.open(tmp_path, durable=False)
    limiter = trio.CapacityLimiter(1)
    group = GroupCommit(journal, run=_runner(limiter), timeout=10)
    async with trio.open_nursery() as nursery:
        await limiter.acquire()
        nursery.start_soon(group.commit, ReleaseRecord(reservation_id="first"))
        await trio.sleep(0.01)  # taken; waits for the disk
        with trio.move_on_after(0.05):
            await group.commit(ReleaseRecord(reservation_id="gave-up"))
        limiter.release()
    journal.close()
    _, replay = Journal.open(tmp_path, durable=False)
    assert replay.records == 1  # "gave-up" never reached the file


async def test_a_record_behind_a_stuck_write_fails_by_its_own_deadline_unwritten(
    tmp_path: Path,
) -> None:
    journal, _ = Journal.open(tmp_path, durable=False)
    limiter = trio.CapacityLimiter(1)
    group = GroupCommit(journal, run=_runner(limiter), timeout=0.2)
    failed: dict[str, float] = {}

    async def commit(name: str) -> None:
        start = trio.current_time()
        with pytest.raises(trio.TooSlowError):
            await group.commit(ReleaseRecord(reservation_id=name))
        failed[name] = trio.current_time() - start

    async with trio.open_nursery() as nursery:
        await limiter.acquire()  # a hung disk: the first write never starts
        nursery.start_soon(commit, "stuck")
        await trio.sleep(0.1)  # taken; waits for the disk
        nursery.start_soon(commit, "behind")
    limiter.release()
    # Each waiter is answered by its own deadline (no cancel scope of its own: the
    # flusher bounds the batch by its earliest deadline and fails what expired).
    assert set(failed) == {"stuck", "behind"}
    assert all(0.2 <= waited < 1.0 for waited in failed.values()), failed
    journal.close()
    _, replay = Journal.open(tmp_path, durable=False)
    assert replay.records == 0  # "behind" was never taken; "stuck" never started


async def test_a_shielded_commit_outlives_a_cancel_and_is_durable(tmp_path: Path) -> None:
    journal, _ = Journal.open(tmp_path, durable=False)
    disk = trio.Event()

    async def run(write: Callable[[], None]) -> None:
        await disk.wait()  # the disk is busy until the test lets it go
        write()

    group = GroupCommit(journal, run=run, timeout=10)
    returned: list[str] = []

    async def commit(name: str, shield: bool) -> None:
        await group.commit(ReleaseRecord(reservation_id=name), shield=shield)
        returned.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(commit, "first", False)
        await trio.sleep(0.01)  # taken; waits for the disk
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as inner:
                inner.start_soon(commit, "shielded", True)
                inner.start_soon(commit, "plain", False)
                await trio.sleep(0.01)
                scope.cancel()  # "plain" gives up at once; "shielded" waits on
                disk.set()
    assert returned == ["first", "shielded"]
    journal.close()
    _, replay = Journal.open(tmp_path, durable=False)
    assert replay.records == 2  # "plain" gave up before its batch was taken
