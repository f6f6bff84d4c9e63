"""The journal's reserve: on a full disk, acknowledged work can still be recorded as
ended, the node says why it admits nothing new, and takes the room back once the
disk has it. Against a real (small) filesystem."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from machine.disk_reserve import RESERVE_SUFFIX, DiskReserve
from machine.journal import JOURNAL_FILENAME, Journal, release_reserve
from tests.disk_fixtures import free_bytes, small_tmpfs
from tests.unit.machine.test_journal import ended, reservation

RESERVE = 1 << 20


def fill(folder: Path) -> Path:
    """Write zeros until the filesystem has no room left, as another writer would."""
    path = folder / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    try:
        while True:  # the last few bytes of the last block
            os.write(fd, b"\0")
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return path


def test_a_full_disk_leaves_room_for_endings_and_a_restart(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "state", "4m") as state:
        journal, _ = Journal.open(state, reserve_bytes=RESERVE)
        reserve_file = state / (JOURNAL_FILENAME + RESERVE_SUFFIX)
        assert journal.reserve_problem is None
        assert reserve_file.stat().st_blocks * 512 >= RESERVE
        journal.record_reserve(reservation("admitted"))
        filler = fill(state)
        # The finding: endings of admitted work failed with ENOSPC and were lost.
        journal.record_release("admitted")
        journal.record_ended(ended("admitted"))
        written = 0
        while journal.reserve_problem is None and written < 20_000:  # past the last page
            journal.record_ended(ended(f"more-{written}"))
            written += 1
        assert journal.ended("admitted") is not None and journal.ended(f"more-{written - 1}")
        assert journal.reserve_problem is not None and "disk is full" in journal.reserve_problem
        assert str(reserve_file) in journal.reserve_problem
        filler.unlink()
        journal.recover()  # the disk has room again: the reserve is taken back
        assert journal.reserve_problem is None
        assert reserve_file.stat().st_blocks * 512 >= RESERVE
        journal.close()
        _, replay = Journal.open(state, reserve_bytes=RESERVE)
        assert {"admitted", f"more-{written - 1}"} <= set(replay.ended)


def test_a_restart_on_a_disk_that_filled_while_down_opens_not_ready(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "state", "4m") as state:
        journal, _ = Journal.open(state, reserve_bytes=RESERVE)
        journal.record_reserve(reservation("kept"))
        journal.close()
        filler = fill(state)
        # As the daemon starts: the reserve is the room its own start-up writes need.
        assert release_reserve(state)
        assert free_bytes(state) >= RESERVE
        journal, replay = Journal.open(state, reserve_bytes=RESERVE)
        assert set(replay.reservations) == {"kept"}
        reserve_file = state / (JOURNAL_FILENAME + RESERVE_SUFFIX)
        assert journal.reserve_problem is not None
        assert (
            str(reserve_file) in journal.reserve_problem and "MiB free" in journal.reserve_problem
        )
        journal.recover()  # still no room: still not held, and says so
        assert journal.reserve_problem is not None
        filler.unlink()
        journal.recover()
        assert journal.reserve_problem is None
        assert reserve_file.stat().st_blocks * 512 >= RESERVE
        journal.close()


def test_a_disk_too_full_for_the_reserve_opens_the_journal_not_ready(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "state", "2m") as state:
        journal, _ = Journal.open(state, reserve_bytes=4 << 20)  # more than the disk
        assert journal.reserve_problem is not None
        assert "no room to preallocate" in journal.reserve_problem
        journal.record_reserve(reservation("written"))  # the journal itself still writes
        assert (state / (JOURNAL_FILENAME + RESERVE_SUFFIX)).stat().st_size == 0
        journal.close()


def test_a_reserve_file_that_is_not_ours_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r"
    os.symlink(tmp_path / "elsewhere", path)
    with pytest.raises(OSError):
        DiskReserve(path, RESERVE).restore()
    with pytest.raises(OSError):
        DiskReserve(path, RESERVE).release()
    assert not (tmp_path / "elsewhere").exists()
