"""A journal that lost acknowledged records (emptied, cut mid-file, missing) is refused
on open, naming the file and what is missing, unless the operator accepts the loss;
a torn tail beyond the last acknowledged record still opens, as a crash leaves it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import trio

from machine.journal import (
    JOURNAL_FILENAME,
    Journal,
    JournalLost,
    ReleaseRecord,
)
from machine.journal_mark import MARK_SUFFIX
from tests.unit.machine.test_journal import reservation, unacknowledged
from tests.unit.machine.test_model import open_machine

MARK = JOURNAL_FILENAME + MARK_SUFFIX


def _acknowledged(state: Path, count: int) -> tuple[Path, bytes]:
    """A journal that acknowledged `count` records; its path and bytes."""
    journal, _ = Journal.open(state)
    for i in range(count):
        journal.record_reserve(reservation(f"r{i}"))
    journal.close()
    path = state / JOURNAL_FILENAME
    return path, path.read_bytes()


def _refused(state: Path, held: int, acknowledged: int) -> JournalLost:
    """Opening refuses with one line naming both files and counts; nothing changes."""
    path, mark = state / JOURNAL_FILENAME, state / MARK
    before = {p: p.read_bytes() for p in (path, mark) if p.exists()}
    with pytest.raises(JournalLost) as info:
        Journal.open(state)
    message = str(info.value)
    assert message == (
        f"journal {path} holds {held} records, {mark} says {acknowledged} were acknowledged;"
        " --accept-journal-loss to start anyway"
    )
    assert {p: p.read_bytes() for p in (path, mark) if p.exists()} == before
    assert not list(state.glob("*.torn"))
    return info.value


def test_a_journal_truncated_to_zero_after_acknowledged_records_is_refused(
    tmp_path: Path,
) -> None:
    path, _ = _acknowledged(tmp_path, 3)
    os.truncate(path, 0)
    lost = _refused(tmp_path, 0, 3)
    assert (lost.held, lost.acknowledged) == (0, 3)


def test_a_missing_journal_after_acknowledged_records_is_refused_and_not_created(
    tmp_path: Path,
) -> None:
    path, _ = _acknowledged(tmp_path, 2)
    path.unlink()
    _refused(tmp_path, 0, 2)
    assert not path.exists()


def test_a_journal_cut_mid_file_before_the_mark_is_refused(tmp_path: Path) -> None:
    path, data = _acknowledged(tmp_path, 3)
    record = len(data) // 3
    path.write_bytes(data[:record])  # cut between records: no torn tail at all
    _refused(tmp_path, 1, 3)
    path.write_bytes(data[: record + 5])  # shaped like a torn write, yet acknowledged
    _refused(tmp_path, 1, 3)


def test_a_torn_tail_after_the_last_acknowledged_record_still_opens(tmp_path: Path) -> None:
    path, data = _acknowledged(tmp_path, 2)
    unacknowledged(tmp_path, ReleaseRecord(reservation_id="r0"))
    path.write_bytes(path.read_bytes()[:-3])  # the crash cut the unacknowledged write
    journal, replay = Journal.open(tmp_path)
    journal.close()
    assert replay.problem == "torn_record" and replay.records == 2
    assert set(replay.reservations) == {"r0", "r1"} and path.read_bytes() == data


def test_with_the_flag_it_opens_with_a_warning_and_the_mark_is_rewritten(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, data = _acknowledged(tmp_path, 3)
    record = len(data) // 3
    path.write_bytes(data[: record + 5])
    journal, replay = Journal.open(tmp_path, accept_loss=True)
    journal.close()
    assert set(replay.reservations) == {"r0"} and path.read_bytes() == data[:record]
    warning = next(r for r in caplog.records if r.levelno == logging.WARNING and "accept" in r.msg)
    assert f"journal {path} holds 1 records, {tmp_path / MARK} says 3 were acknowledged" in (
        warning.getMessage()
    )
    journal, replay = Journal.open(tmp_path)  # the mark now says what is there
    journal.close()
    assert replay.records == 1


def test_an_unreadable_mark_is_refused_unless_accepted(tmp_path: Path) -> None:
    _acknowledged(tmp_path, 1)
    (tmp_path / MARK).write_bytes(b"\x01" * 1024)
    with pytest.raises(JournalLost, match="is unreadable; --accept-journal-loss"):
        Journal.open(tmp_path)
    journal, replay = Journal.open(tmp_path, accept_loss=True)
    journal.close()
    assert replay.records == 1
    Journal.open(tmp_path)[0].close()


def test_the_mark_follows_every_write_and_compaction_never_over_claims(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal, _ = Journal.open(tmp_path, compact_every=8)
    for i in range(20):  # compacts along the way: the journal gets shorter
        journal.record_reserve(reservation(f"c{i}"))
        journal.record_release(f"c{i}")
        journal.close()
        journal, replay = Journal.open(tmp_path, compact_every=8)
        assert replay.records == journal.record_count
    # A crash between lowering the mark and renaming the compacted file: the longer
    # journal stays at the name, which the lowered mark does not over-claim.
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(5, "EIO")))
    with pytest.raises(OSError):
        journal.compact()
    monkeypatch.setattr(os, "replace", real_replace)
    journal.close()
    Journal.open(tmp_path)[0].close()


def test_a_mark_that_cannot_be_written_keeps_the_records_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal, _ = Journal.open(tmp_path)
    real = os.pwrite

    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    journal.record_reserve(reservation("kept"))  # durable in the journal: it stands
    assert journal.write_problem is not None and "mark" in journal.write_problem
    monkeypatch.setattr(os, "pwrite", real)
    journal.record_release("kept")
    assert journal.write_problem is None
    journal.close()
    assert Journal.open(tmp_path)[1].records == 2


async def test_machine_open_refuses_a_journal_that_lost_records_unless_accepted(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    path, _ = _acknowledged(state, 2)
    await trio.to_thread.run_sync(os.truncate, path, 0)
    with pytest.raises(JournalLost):
        await open_machine(state)
    machine = await open_machine(state, accept_journal_loss=True)
    try:
        assert machine.replay.records == 0
    finally:
        await machine.aclose()
