"""The disk floor: more bytes are granted only while free space minus them stays at or
above the floor; one statvfs reading serves a short while, and every byte granted
since (or still being written when it was taken) counts against it."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from machine.disk_floor import DiskFloor

BLOCK = 4096


class _Disk:
    """A statvfs double: `free` bytes free, `reads` counted; a clock the test moves."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.reads = 0
        self.now = 0.0

    def statvfs(self, path: Path) -> SimpleNamespace:
        self.reads += 1
        return SimpleNamespace(f_bavail=self.free // BLOCK, f_frsize=BLOCK)

    def clock(self) -> float:
        return self.now


def _floor(disk: _Disk, floor: int, max_age: float = 1.0) -> DiskFloor:
    return DiskFloor(Path("/state"), floor, statvfs=disk.statvfs, clock=disk.clock, max_age=max_age)


def test_a_write_that_would_cross_the_floor_is_refused_one_above_it_granted() -> None:
    disk = _Disk(free=100 * BLOCK)
    floor = _floor(disk, 90 * BLOCK)
    assert floor.allows(4 * BLOCK)  # 96 blocks left of 90
    assert floor.room() == 6 * BLOCK and floor.block == BLOCK
    assert not floor.allows(6 * BLOCK + 1)  # one byte under the floor
    assert floor.room() == 6 * BLOCK  # a refusal takes nothing
    assert floor.allows(6 * BLOCK) and floor.room() == 0
    assert not floor.allows(1)


def test_one_reading_serves_until_stale_and_a_burst_counts_against_it() -> None:
    disk = _Disk(free=100 * BLOCK)
    floor = _floor(disk, 90 * BLOCK, max_age=1.0)
    grants = [floor.allows(BLOCK) for _ in range(12)]
    assert grants == [True] * 10 + [False] * 2  # the disk's figure never moved: counted
    assert disk.reads == 1
    for _ in range(10):
        floor.done(BLOCK)
    disk.free -= 10 * BLOCK  # what those writes took
    disk.now = 0.99
    assert not floor.stale() and not floor.allows(BLOCK) and disk.reads == 1
    disk.now = 1.0
    assert floor.stale()
    disk.free += 5 * BLOCK  # something else freed room meanwhile
    assert floor.allows(5 * BLOCK) and disk.reads == 2
    assert not floor.allows(1)


def test_bytes_still_being_written_count_against_the_next_reading() -> None:
    disk = _Disk(free=100 * BLOCK)
    floor = _floor(disk, 90 * BLOCK)
    assert floor.allows(8 * BLOCK)  # granted; its write has not reached the disk
    disk.now = 5.0
    floor.read()  # the disk still shows 100 blocks free
    assert floor.room() == 2 * BLOCK
    floor.done(8 * BLOCK)
    disk.free -= 8 * BLOCK
    disk.now = 10.0
    floor.read()
    assert floor.room() == 2 * BLOCK  # now in the reading, and no longer pending


def test_no_room_before_the_first_reading_and_a_failed_one_keeps_none() -> None:
    def broken(path: Path) -> os.statvfs_result:
        raise OSError(5, "Input/output error")

    floor = DiskFloor(Path("/state"), BLOCK, statvfs=broken)
    assert floor.stale() and floor.room() == 0 and not floor.reserve(1)
    with pytest.raises(OSError):
        floor.read()
    assert floor.stale() and floor.room() == 0


def test_a_floor_of_zero_grants_everything_and_never_reads() -> None:
    disk = _Disk(free=0)
    floor = _floor(disk, 0)
    assert not floor.enabled and not floor.stale()
    assert floor.allows(2**40) and floor.reserve(2**40)
    floor.done(2**40)
    assert disk.reads == 0


def test_the_real_statvfs_reads_the_filesystem_of_the_path(tmp_path: Path) -> None:
    info = os.statvfs(tmp_path)
    free = info.f_bavail * info.f_frsize
    floor = DiskFloor(tmp_path, max(1, free // 2))
    assert floor.allows(1)
    assert 0 < floor.room() <= free - free // 2
    assert floor.block == info.f_frsize
