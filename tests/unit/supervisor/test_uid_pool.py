"""The guest uid pool across restarts: its cursor file, the round it resumes, and the
uids it holds back because something still runs under them."""

from __future__ import annotations

import os
import pathlib

import pytest

from supervisor.identity import (
    UID_CURSOR_FILENAME,
    UidCursor,
    UidCursorError,
    UidPool,
    UidsExhausted,
    running_uids,
)


class CountingCursor(UidCursor):
    def __init__(self, path: pathlib.Path) -> None:
        super().__init__(path)
        self.saves = 0

    def save(self, uid: int) -> None:
        self.saves += 1
        super().save(uid)


class BrokenCursor(UidCursor):
    def save(self, uid: int) -> None:
        raise OSError(28, "No space left on device")


def _restarted(cursor_path: pathlib.Path, uids: range) -> UidPool:
    """A pool as a restarted daemon makes it: nothing but the cursor file carries over."""
    return UidPool(uids, cursor=UidCursor(cursor_path))


def test_after_each_restart_the_round_goes_on_and_wraps_only_after_the_whole_range(
    tmp_path: pathlib.Path,
) -> None:
    path, uids = tmp_path / UID_CURSOR_FILENAME, range(10, 14)
    handed = []
    for _ in range(9):  # a restart before every hand-out
        pool = _restarted(path, uids)
        uid = pool.allocate()
        pool.release(uid)
        handed.append(uid)
    assert handed == [10, 11, 12, 13, 10, 11, 12, 13, 10]
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_big_range_saves_once_per_lease_and_a_restart_resumes_past_every_uid_handed_out(
    tmp_path: pathlib.Path,
) -> None:
    uids = range(200_000, 200_000 + 64 * 1024)
    cursor = CountingCursor(tmp_path / UID_CURSOR_FILENAME)
    pool = UidPool(uids, cursor=cursor)
    assert pool.lease == 256
    handed = [pool.allocate() for _ in range(300)]
    assert cursor.saves == 2  # not one write per guest
    for uid in handed:
        pool.release(uid)
    again = _restarted(cursor.path, uids).allocate()
    assert again > max(handed)  # never back at the bottom of the range
    assert again - max(handed) <= pool.lease  # a restart skips at most one lease


def test_a_range_changed_since_the_save_starts_at_its_bottom(tmp_path: pathlib.Path) -> None:
    path = tmp_path / UID_CURSOR_FILENAME
    UidCursor(path).save(99)
    assert _restarted(path, range(10, 14)).allocate() == 10
    UidCursor(path).save(12)
    assert _restarted(path, range(10, 14)).allocate() == 12


def test_a_cursor_that_cannot_be_saved_hands_out_no_uid(tmp_path: pathlib.Path) -> None:
    pool = UidPool(range(10, 14), cursor=BrokenCursor(tmp_path / UID_CURSOR_FILENAME))
    with pytest.raises(OSError, match="No space"):
        pool.allocate()
    assert pool.in_use == frozenset()


@pytest.mark.parametrize("bad", ["garbage", "symlink", "loose"])
def test_a_cursor_file_that_is_not_the_daemons_plain_uid_is_refused(
    tmp_path: pathlib.Path, bad: str
) -> None:
    path = tmp_path / UID_CURSOR_FILENAME
    if bad == "symlink":
        (tmp_path / "elsewhere").write_text("12\n")
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.write_text("12\n" if bad == "loose" else "twelve\n")
        path.chmod(0o644 if bad == "loose" else 0o600)
    with pytest.raises(UidCursorError):
        UidCursor(path).load()


def test_uids_something_still_runs_under_are_held_back(tmp_path: pathlib.Path) -> None:
    proc = tmp_path / "proc"
    processes = {
        "1": ("S (sleeping)", "0\t0\t0\t0"),
        "41": ("D (disk sleep)", "11\t11\t11\t11"),  # survived SIGKILL
        "42": ("R (running)", "5\t13\t5\t5"),
        "43": ("Z (zombie)", "12\t12\t12\t12"),  # dead, not yet reaped: holds nothing
    }
    for pid, (state, uid_line) in processes.items():
        (proc / pid).mkdir(parents=True)
        (proc / pid / "status").write_text(f"Name:\tx\nState:\t{state}\nUid:\t{uid_line}\n")
    (proc / "self").mkdir()
    held = running_uids(range(10, 14), proc)
    assert held == {11, 13}
    pool = UidPool(range(10, 14), held=held)
    assert [pool.allocate(), pool.allocate()] == [10, 12]
    with pytest.raises(UidsExhausted):
        pool.allocate()
    # On the real /proc: this very process runs under the daemon's uid.
    assert running_uids(range(os.geteuid(), os.geteuid() + 1)) == {os.geteuid()}
