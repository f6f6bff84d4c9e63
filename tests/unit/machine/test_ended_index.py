"""The on-disk index of ended invocations: node time, bounds, files, failures."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest

from machine.ended_index import INDEX_FILENAME, EndedIndex, IndexUnusable
from machine.journal import Journal, JournalUnsafe, ReleaseRecord, ReserveRecord, UnsafeReason
from tests.unit.machine.test_journal import NodeClock, ended, reservation


def test_node_time_adds_up_over_restarts_and_ignores_the_wall_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = NodeClock()
    index = EndedIndex.open(tmp_path, window_s=100, clock=clock)
    index.add([ended("a")])
    clock.now += 60
    index.close()
    # The wall clock steps a day forward while the node is down; the monotonic clock
    # starts somewhere else after a reboot.
    monkeypatch.setattr(time, "time", lambda: 1e10)
    clock.now = 5.0
    index = EndedIndex.open(tmp_path, window_s=100, clock=clock)
    assert index.node_time() == 60 and index.get("a") is not None
    clock.now += 39
    assert index.get("a") is not None and index.expire() == 0
    clock.now += 2  # 101 s of running since "a" ended
    assert index.get("a") is None and index.count == 1
    assert index.expire() == 1 and index.count == 0
    index.close()


def test_room_counts_what_is_held_and_says_when_the_oldest_leaves(tmp_path: Path) -> None:
    clock = NodeClock()
    index = EndedIndex.open(tmp_path, window_s=100, max_ids=3, clock=clock)
    index.add([ended("a"), ended("b")])
    clock.now += 30
    index.add([ended("c")])
    assert index.room() == 0
    assert index.seconds_until_room() == pytest.approx(70)
    assert [r.invocation_id for r in index.newest(2)] == ["b", "c"]
    index.close()


def test_an_index_file_that_is_not_ours_or_not_an_index_is_refused(tmp_path: Path) -> None:
    path = tmp_path / INDEX_FILENAME
    path.write_bytes(b"not a database, " * 512)
    path.chmod(0o600)
    with pytest.raises(IndexUnusable, match=str(path)):
        EndedIndex.open(tmp_path)
    path.chmod(0o644)
    with pytest.raises(JournalUnsafe) as unsafe:
        EndedIndex.open(tmp_path)
    assert unsafe.value.reason is UnsafeReason.OPEN_PERMISSIONS
    path.unlink()
    os.symlink(tmp_path / "elsewhere", path)
    with pytest.raises(JournalUnsafe) as unsafe:
        EndedIndex.open(tmp_path)
    assert unsafe.value.reason is UnsafeReason.SYMLINK
    assert not (tmp_path / "elsewhere").exists()


def test_the_index_is_created_closed_to_others(tmp_path: Path) -> None:
    journal, _ = Journal.open(tmp_path)
    journal.close()
    assert (tmp_path / INDEX_FILENAME).stat().st_mode & 0o777 == 0o600


def test_endings_the_index_cannot_take_stay_in_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk under the index: compaction keeps the endings in the journal, so a
    crash then loses none, and the next compaction moves them."""
    journal, _ = Journal.open(tmp_path, compact_every=4)

    def full(_records: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(journal.index, "add", full)
    journal.record_ended(ended("kept"))
    for i in range(4):
        journal.append_batch(
            [ReserveRecord(reservation=reservation(f"t{i}")), ReleaseRecord(reservation_id=f"t{i}")]
        )
    assert journal.record_count == 1  # compacted: only the ending is left, in the journal
    assert journal.index.count == 0 and journal.ended("kept") is not None
    journal.close()  # as a crash would leave it
    journal, replay = Journal.open(tmp_path)
    assert "kept" in replay.ended
    journal.compact()
    assert journal.index.count == 1 and journal.record_count == 0
    assert journal.ended("kept") is not None
    journal.close()


def test_expiry_forgets_only_what_left_the_window(tmp_path: Path) -> None:
    clock = NodeClock()
    index = EndedIndex.open(tmp_path, window_s=100, clock=clock)
    index.add([ended("old"), ended("older")])
    clock.now += 50
    index.add([ended("new")])
    clock.now += 60  # "old" and "older" ended 110 s ago, "new" 60 s ago
    assert index.expire() == 2 and index.count == 1
    assert index.get("old") is None and index.get("new") is not None
    assert index.expire() == 0
    clock.now += 41
    assert index.expire() == 1 and index.count == 0 and index.expire() == 0
    index.close()


def test_a_compaction_that_fails_after_the_index_took_the_endings_adds_none_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk fails every compaction's copy: retried each second, they must not
    count the same endings again (the count would fill the window with nothing)."""
    journal, _ = Journal.open(tmp_path)
    journal.record_ended(ended("kept"))
    real_open = os.open

    def no_copy(path: object, *args: object, **kw: object) -> int:
        if str(path).endswith(".tmp"):
            raise OSError(28, "No space left on device")
        return real_open(path, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", no_copy)
    for _ in range(3):
        with pytest.raises(OSError):
            journal.compact()
    assert journal.index.count == 1 and journal.room() == journal.index.max_ids - 1
    monkeypatch.setattr(os, "open", real_open)
    journal.compact()
    assert journal.index.count == 1 and journal.room() == journal.index.max_ids - 1
    assert journal.ended("kept") is not None
    journal.close()


def test_endings_added_again_after_a_crash_are_not_counted_twice(tmp_path: Path) -> None:
    """A crash between the index taking the endings and the journal dropping them: the
    next start replays them and adds them again; the count stays the number held."""
    index = EndedIndex.open(tmp_path, max_ids=3)
    index.add([ended("a"), ended("b")])
    index.add([ended("a"), ended("b"), ended("c")])
    assert index.count == 3 and index.room() == 0
    index.close()
    index = EndedIndex.open(tmp_path, max_ids=3)
    assert index.count == 3
    index.close()


def test_a_journal_that_fails_to_open_leaves_no_file_open(tmp_path: Path) -> None:
    journal, _ = Journal.open(tmp_path)
    journal.close()
    (tmp_path / INDEX_FILENAME).write_bytes(b"not a database, " * 512)
    (tmp_path / (INDEX_FILENAME + "-wal")).unlink(missing_ok=True)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(IndexUnusable):
            Journal.open(tmp_path)
    assert len(os.listdir("/proc/self/fd")) == before
