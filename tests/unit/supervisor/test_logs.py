"""Invocation logs on disk: every byte kept within the bounds, followed live, read after
the end and after a restart; a full disk cuts the logs and says so, never more."""

from __future__ import annotations

import errno
import os
import stat
import time
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing

import supervisor.logstore
from machine.disk_floor import DiskFloor
from supervisor.logread import read_log
from supervisor.logstore import InvocationLogs, LogLimits, LogStore
from supervisor.output import OutputRing
from supervisor.process import ProcessSpec, run_process
from tests.disk_fixtures import free_bytes, small_tmpfs

LIMITS = LogLimits(invocation_bytes=2**30, total_bytes=2**31, retention_s=3600)


async def _read(logs: InvocationLogs, stream: str = "stdout", offset: int = 0) -> bytes:
    return b"".join([chunk async for chunk in read_log(logs, stream, offset, follow=False)])


async def _started(store: LogStore, invocation_id: str) -> InvocationLogs:
    logs = store.begin(invocation_id)
    await logs.create()
    return logs


async def _no_journal(pid: int, start_ticks: int | None) -> None:
    pass


async def test_every_byte_of_a_large_output_reaches_the_log(tmp_path: Path) -> None:
    store = await LogStore.open(tmp_path / "logs", LIMITS)
    logs = await _started(store, "seq")

    async def out(data: bytes) -> None:
        await logs.write("stdout", data)

    async def err(data: bytes) -> None:
        await logs.write("stderr", data)

    ring, ring_err = OutputRing(64 * 1024), OutputRing(64 * 1024)
    code = await run_process(
        ProcessSpec(argv=("sh", "-c", "seq 1 200000; echo done >&2")),
        stdout=ring,
        stderr=ring_err,
        on_started=_no_journal,
        cgroups=None,
        sinks=(out, err),
    )
    await logs.close()
    assert code == 0
    text = await _read(logs)
    assert text.splitlines() == [str(n).encode() for n in range(1, 200001)]
    assert ring.dropped_bytes > 0  # the ring alone would have lost most of it
    assert await _read(logs, "stderr") == b"done\n"
    assert await _read(logs, offset=len(text) - 7) == b"200000\n"
    assert logs.cut is None


async def test_files_are_the_daemons_alone(tmp_path: Path) -> None:
    store = await LogStore.open(tmp_path / "logs", LIMITS)
    logs = await _started(store, "private")
    await logs.write("stdout", b"out")
    await logs.write("stderr", b"err")
    assert stat.S_IMODE((tmp_path / "logs").stat().st_mode) == 0o700
    for stream in ("stdout", "stderr"):
        info = logs.path(stream).stat()
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()


async def test_a_follower_gets_each_write_live_and_ends_after_the_last_byte(
    tmp_path: Path,
) -> None:
    store = await LogStore.open(tmp_path / "logs", LIMITS)
    logs = await _started(store, "live")
    got: list[bytes] = []
    first, ended = trio.Event(), trio.Event()

    async def follow() -> None:
        async for chunk in read_log(logs, "stdout", 0, follow=True):
            got.append(chunk)
            first.set()
        ended.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(follow)
        await logs.write("stdout", b"first\n")
        with trio.fail_after(5):
            await first.wait()
        assert got == [b"first\n"]
        assert not ended.is_set()  # still running: the follower waits for more
        await logs.write("stdout", b"second\n")
        await logs.close()
        with trio.fail_after(5):
            await ended.wait()
    assert b"".join(got) == b"first\nsecond\n"


async def test_the_bound_per_invocation_cuts_and_the_status_can_say_so(tmp_path: Path) -> None:
    limits = LogLimits(invocation_bytes=10, total_bytes=2**20, retention_s=60)
    store = await LogStore.open(tmp_path / "logs", limits)
    logs = await _started(store, "chatty")
    await logs.write("stdout", b"0123456")
    await logs.write("stderr", b"abcdefgh")
    await logs.write("stdout", b"more")
    assert await _read(logs) == b"0123456"
    assert await _read(logs, "stderr") == b"abc"
    assert logs.cut == "invocation_limit"
    assert store.total == 10


async def test_the_total_bound_evicts_the_largest_ended_logs_over_their_share_never_a_live_one(
    tmp_path: Path,
) -> None:
    limits = LogLimits(invocation_bytes=100, total_bytes=25, retention_s=3600)
    store = await LogStore.open(tmp_path / "logs", limits)
    old = await _started(store, "old")
    await old.write("stdout", b"x" * 10)
    await old.close()
    newer = await _started(store, "newer")
    await newer.write("stdout", b"y" * 10)
    await newer.close()
    live = await _started(store, "live")
    await live.write("stdout", b"z" * 10)  # 30 > 25, shares of 8: the older of equals goes
    assert store.find("old") is None and not old.path("stdout").exists()
    assert old.cut == "evicted"
    assert store.find("newer") is newer and newer.path("stdout").exists()
    await live.write("stdout", b"z" * 20)  # shares of 12: "newer" is within its own
    assert store.find("newer") is newer and newer.cut is None
    assert await _read(newer) == b"y" * 10
    assert await _read(live) == b"z" * 15
    assert live.cut == "total_limit" and store.total == 25


async def test_another_tenants_output_never_evicts_logs_within_their_share(
    tmp_path: Path,
) -> None:
    # The finding, scaled down: 17 invocations each writing past the per-invocation
    # bound (66 of 64 KiB) into a 1 MiB total, after a victim's small logs ended.
    limits = LogLimits(invocation_bytes=64 * 1024, total_bytes=2**20, retention_s=3600)
    store = await LogStore.open(tmp_path / "logs", limits)
    victim = await _started(store, "victim")
    await victim.write("stdout", b"result: 42\n")
    await victim.close()
    noisy = []
    for n in range(17):
        logs = await _started(store, f"noisy-{n}")
        for _ in range(66):
            await logs.write("stdout", b"n" * 1024)
        await logs.close()
        noisy.append(logs)
    assert store.find("victim") is victim and victim.cut is None
    assert await _read(victim) == b"result: 42\n"
    # Room came from the noisy ones' oldest logs (17 x 64 KiB > 1 MiB), which say so.
    assert [logs.cut for logs in noisy[:2]] == ["evicted", "evicted"]
    assert store.find("noisy-0") is None and not noisy[0].path("stdout").exists()
    for logs in noisy[2:]:
        assert store.find(logs.id) is logs and logs.cut == "invocation_limit"
    assert store.total <= limits.total_bytes


async def test_a_writer_over_its_share_is_cut_rather_than_evicting_others(
    tmp_path: Path,
) -> None:
    limits = LogLimits(invocation_bytes=2**20, total_bytes=2**20, retention_s=3600)
    store = await LogStore.open(tmp_path / "logs", limits)
    kept = []
    for n in range(3):
        logs = await _started(store, f"small-{n}")
        await logs.write("stderr", b"s" * (100 * 1024))
        await logs.close()
        kept.append(logs)
    noisy = await _started(store, "noisy")
    for _ in range(40):  # 2.5 MiB against a 1 MiB total
        await noisy.write("stdout", b"n" * (64 * 1024))
    assert noisy.cut == "total_limit"
    assert noisy.bytes == limits.total_bytes - 300 * 1024 and store.total == limits.total_bytes
    for logs in kept:
        assert store.find(logs.id) is logs and logs.cut is None
        assert await _read(logs, "stderr") == b"s" * (100 * 1024)


async def test_evicted_logs_say_so_in_their_status(tmp_path: Path) -> None:
    limits = LogLimits(invocation_bytes=2**20, total_bytes=2**20, retention_s=3600)
    store = await LogStore.open(tmp_path / "logs", limits)
    big = await _started(store, "big")
    await big.write("stdout", b"b" * (700 * 1024))
    await big.close()
    small = await _started(store, "small")
    await small.write("stdout", b"s" * 1024)
    await small.close()
    writer = await _started(store, "writer")
    await writer.write("stdout", b"w" * (400 * 1024))  # "big" is the largest over-share
    assert big.cut == "evicted" and store.find("big") is None
    assert small.cut is None and writer.cut is None
    assert store.total == 401 * 1024 and store.holders == 2


async def test_logs_forgotten_for_the_count_bound_say_so_unless_they_were_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervisor.logstore, "MAX_KEPT", 2)
    store = await LogStore.open(tmp_path / "logs", LIMITS)
    first = await _started(store, "first")
    await first.write("stdout", b"x")
    await first.close()
    quiet = await _started(store, "quiet")
    await quiet.close()
    for n in range(2):
        await (await _started(store, f"later-{n}")).close()
    assert store.find("first") is None and store.find("quiet") is None
    assert first.cut == "evicted" and quiet.cut is None  # nothing of it was lost
    assert store.holders == 0 and store.total == 0


async def test_a_full_disk_cuts_the_logs_and_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await LogStore.open(tmp_path / "logs", LIMITS)
    logs = await _started(store, "full")
    await logs.write("stdout", b"kept\n")

    def full(path: Path, data: bytes, victims: list[Path], first: bool) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(supervisor.logstore, "_append", full)
    await logs.write("stdout", b"lost\n")
    await logs.write("stdout", b"lost too\n")
    await logs.close()
    assert logs.cut == "write_failed: disk full"
    assert await _read(logs) == b"kept\n"


async def test_a_disk_that_refuses_even_the_files_cuts_the_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await LogStore.open(tmp_path / "logs", LIMITS)

    def full(path: Path, data: bytes, victims: list[Path], first: bool) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(supervisor.logstore, "_append", full)
    logs = await _started(store, "nofile")
    await logs.write("stdout", b"lost\n")
    await logs.close()
    assert logs.cut == "write_failed: disk full"
    assert await _read(logs) == b""


async def test_an_invocation_that_writes_nothing_costs_no_file_and_reads_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await LogStore.open(tmp_path / "logs", LIMITS)
    calls: list[object] = []
    in_thread = store.in_thread

    async def counted(fn: object, *args: object) -> None:
        calls.append(fn)
        await in_thread(fn, *args)

    monkeypatch.setattr(store, "in_thread", counted)
    monkeypatch.setattr(supervisor.logstore, "MAX_KEPT", 2)
    for n in range(4):  # past MAX_KEPT: the oldest are forgotten, with no file to remove
        logs = await _started(store, f"quiet-{n}")
        await logs.write("stdout", b"")
        await logs.close()
    assert calls == [] and list((tmp_path / "logs").iterdir()) == []
    found = store.find("quiet-3")
    assert found is not None and store.find("quiet-0") is None
    assert await _read(found) == b"" and await _read(found, "stderr") == b""
    with trio.fail_after(5):  # a follower of closed, empty logs ends at once
        assert [c async for c in read_log(found, "stdout", 0, follow=True)] == []


async def test_a_follower_waits_for_a_stream_that_has_no_file_yet(tmp_path: Path) -> None:
    store = await LogStore.open(tmp_path / "logs", LIMITS)
    logs = await _started(store, "late")
    got: list[bytes] = []
    async with trio.open_nursery() as nursery:

        async def follow() -> None:
            got.extend([c async for c in read_log(logs, "stderr", 0, follow=True)])

        nursery.start_soon(follow)
        await trio.testing.wait_all_tasks_blocked()
        assert not logs.path("stderr").exists() and got == []
        await logs.write("stderr", b"at last\n")
        await logs.close()
    assert got == [b"at last\n"]


async def test_a_rerun_of_an_id_never_shows_the_older_runs_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await LogStore.open(tmp_path / "logs", LIMITS)
    old = await _started(store, "again")
    await old.write("stdout", b"old run\n")
    await old.close()
    rerun = await _started(store, "again")  # writes nothing
    await rerun.close()
    assert await _read(rerun) == b"" and store.total == 0
    assert rerun.path("stdout").read_bytes() == b""  # emptied, not left behind

    def full(paths: list[Path]) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    third = store.begin("again")
    third.path("stdout").write_bytes(b"older\n")
    monkeypatch.setattr(supervisor.logstore, "_create", full)
    await third.create()
    await third.write("stdout", b"lost\n")
    assert third.cut == "create_failed: disk full"
    assert await _read(third) == b""


async def test_logs_are_read_after_a_restart_and_removed_after_their_retention(
    tmp_path: Path,
) -> None:
    store = await LogStore.open(tmp_path / "logs", LIMITS)
    logs = await _started(store, "before")
    await logs.write("stdout", b"from the last run\n")
    await logs.write("stderr", b"warn\n")
    await logs.close()
    (tmp_path / "logs" / "unrelated.txt").write_text("left alone")

    again = await LogStore.open(tmp_path / "logs", LIMITS)
    found = again.find("before")
    assert found is not None and found.closed
    assert await _read(found) == b"from the last run\n"
    assert again.total == len(b"from the last run\nwarn\n")
    with trio.fail_after(5):  # a follower of ended logs ends at their end
        chunks = [c async for c in read_log(found, "stderr", 0, follow=True)]
    assert chunks == [b"warn\n"]

    await again.remove(again._over_bounds(time.time() + LIMITS.retention_s + 1))
    assert again.find("before") is None and again.total == 0
    assert not found.path("stdout").exists()
    assert (tmp_path / "logs" / "unrelated.txt").exists()


async def test_logs_past_their_retention_are_gone_at_start(tmp_path: Path) -> None:
    store = await LogStore.open(tmp_path / "logs", LIMITS)
    logs = await _started(store, "stale")
    await logs.write("stdout", b"x")
    await logs.write("stderr", b"y")
    await logs.close()
    long_ago = time.time() - LIMITS.retention_s - 10
    for stream in ("stdout", "stderr"):
        os.utime(logs.path(stream), (long_ago, long_ago))
    again = await LogStore.open(tmp_path / "logs", LIMITS)
    assert again.find("stale") is None and not logs.path("stdout").exists()


class _CountingOrder(OrderedDict[str, InvocationLogs]):
    """The store's ended logs, counting how many entries its bounds look at."""

    looked = 0

    def items(self):  # type: ignore[no-untyped-def, override]
        for item in super().items():
            self.looked += 1
            yield item


async def test_an_ending_looks_only_at_the_oldest_kept_logs_not_all_of_them(
    tmp_path: Path,
) -> None:
    limits = LogLimits(invocation_bytes=100, total_bytes=2**20, retention_s=3600)
    store = await LogStore.open(tmp_path / "logs", limits)
    counted = _CountingOrder()
    store._ended = counted
    for n in range(200):
        logs = await _started(store, f"kept-{n}")
        await logs.close()
    # Nothing was over a bound: each ending looked at the oldest entry and stopped.
    assert len(counted) == 200
    assert counted.looked <= 200


async def test_the_largest_first_index_stays_bounded_by_the_kept_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervisor.logstore, "MAX_KEPT", 4)
    store = await LogStore.open(tmp_path / "logs", LIMITS)
    for n in range(300):
        logs = await _started(store, f"kept-{n}")
        await logs.write("stdout", b"x" * (n + 1))
        await logs.close()
    assert len(store._ended) == 4 and store.holders == 4
    assert len(store._largest) <= 2 * 4 + 64
    assert store.total == sum(range(297, 301))


BLOCK = 4096


def _fixed_disk(tmp_path: Path, free_blocks: int, floor_blocks: int) -> DiskFloor:
    """A floor over a disk that always shows `free_blocks` free, read once (the clock
    never moves): every byte granted since counts."""

    def statvfs(path: Path) -> SimpleNamespace:
        return SimpleNamespace(f_bavail=free_blocks, f_frsize=BLOCK)

    return DiskFloor(tmp_path, floor_blocks * BLOCK, statvfs=statvfs, clock=lambda: 0.0)


async def test_a_write_that_would_cross_the_disk_floor_is_cut_and_says_so(
    tmp_path: Path,
) -> None:
    floor = _fixed_disk(tmp_path, free_blocks=110, floor_blocks=100)  # 10 blocks of room
    store = await LogStore.open(tmp_path / "logs", LIMITS, floor)
    small = await _started(store, "small")
    await small.write("stdout", b"kept\n")  # one block of the ten
    await small.close()
    assert small.cut is None and await _read(small) == b"kept\n"
    big = await _started(store, "big")
    await big.write("stdout", b"b" * (20 * BLOCK))  # nine blocks fit, the rest would not
    assert big.cut == "disk_floor"
    assert await _read(big) == b"b" * (9 * BLOCK)
    await big.write("stderr", b"later\n")  # cut for good: nothing more is stored
    await big.close()
    assert await _read(big, "stderr") == b"" and not big.on_disk("stderr")
    assert big.bytes == 9 * BLOCK and floor.room() == 0
    assert small.cut is None and await _read(small) == b"kept\n"  # kept whole


async def test_the_disk_floor_counts_whole_blocks_as_the_filesystem_allocates_them(
    tmp_path: Path,
) -> None:
    floor = _fixed_disk(tmp_path, free_blocks=12, floor_blocks=10)  # 2 blocks of room
    store = await LogStore.open(tmp_path / "logs", LIMITS, floor)
    logs = await _started(store, "lines")
    for _ in range(81):  # 8,100 bytes: the rest of the first block is used, not charged
        await logs.write("stdout", b"x" * 100)
    assert logs.cut is None and floor.room() == 0
    await logs.write("stdout", b"y" * 100)  # 92 bytes are left of the second block
    assert logs.cut == "disk_floor"
    assert await _read(logs) == b"x" * 8100 + b"y" * 92


async def test_a_free_space_reading_that_fails_cuts_the_logs_like_a_failing_disk(
    tmp_path: Path,
) -> None:
    def broken(path: Path) -> SimpleNamespace:
        raise OSError(errno.EIO, "Input/output error")

    store = await LogStore.open(tmp_path / "logs", LIMITS, DiskFloor(tmp_path, 1, statvfs=broken))
    logs = await _started(store, "blind")
    await logs.write("stdout", b"lost\n")
    await logs.close()
    assert logs.cut == "write_failed: [Errno 5] Input/output error"
    assert await _read(logs) == b""


async def test_on_a_small_disk_logs_stop_above_the_floor_and_leave_it_free(
    tmp_path: Path,
) -> None:
    # The finding, on a real filesystem: output past the free space (10 MiB into 8)
    # once filled the disk under the journal (`write_failed: disk full`).
    with small_tmpfs(tmp_path / "state", "8m") as state:
        floor_bytes = 2 * 2**20
        store = await LogStore.open(state / "logs", LIMITS, DiskFloor(state, floor_bytes))
        logs = await _started(store, "chatty")
        for _ in range(160):
            await logs.write("stdout", b"x" * 65536)
        await logs.close()
        assert logs.cut == "disk_floor"
        free = free_bytes(state)
        block = os.statvfs(state).f_frsize
        assert floor_bytes <= free < floor_bytes + block  # stopped at the floor
        assert logs.path("stdout").stat().st_size == logs.bytes > 5 * 2**20
        # The floor is the journal's: a large batch appended and fsynced still fits.
        fd = os.open(state / "journal", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            assert os.write(fd, b"j" * (floor_bytes // 2)) == floor_bytes // 2
            os.fsync(fd)
        finally:
            os.close(fd)
