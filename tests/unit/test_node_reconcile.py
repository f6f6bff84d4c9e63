"""Reconcile ends the whole process group a dead daemon left, and never someone else's."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import psutil  # type: ignore[import-untyped,unused-ignore]
import pytest
import trio

import node.machine.procgroup
from node.machine.journal import Journal
from node.machine.reconcile import reconcile
from tests.unit.test_node_journal import reservation

# The grandchild ignores SIGTERM (inherited across exec) and says so once it does.
STUBBORN = "(trap '' TERM; echo ready; exec sleep 60)"


def live_members(pgid: int) -> list[int]:
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


@contextlib.asynccontextmanager
async def group(script: str) -> AsyncIterator[tuple[trio.Process, float]]:
    """`sh -c script` leading its own group (as the supervisor starts it), once it
    printed "ready"; the whole group is killed afterwards whatever happened."""
    leader = await trio.lowlevel.open_process(
        ["sh", "-c", script], stdout=subprocess.PIPE, start_new_session=True
    )
    assert leader.stdout is not None
    try:
        # Unreaped, so readable even if it already exited.
        start = psutil.Process(leader.pid).create_time()
        with trio.fail_after(5):
            assert await leader.stdout.receive_some() == b"ready\n"
        yield leader, start
    finally:
        with trio.CancelScope(shield=True):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(leader.pid, signal.SIGKILL)
            await leader.wait()
            await leader.stdout.aclose()


def journal_with(tmp_path: Path, pid: int, start: float) -> Journal:
    journal, _ = Journal.open(tmp_path)
    journal.record_reserve(reservation("inv"))
    journal.record_process_started("inv", pid, start)
    return journal


async def test_grandchild_ignoring_sigterm_is_killed_with_its_leader(tmp_path: Path) -> None:
    async with group(f"{STUBBORN} & wait") as (leader, start):
        assert len(live_members(leader.pid)) == 2
        with journal_with(tmp_path, leader.pid, start) as journal:
            report = await reconcile(journal, grace=0.5, kill_wait=2.0)
            assert report.terminated == (leader.pid,) and report.released == ("inv",)
            assert journal.reservations() == {} and journal.processes() == {}
        assert live_members(leader.pid) == []
        assert await leader.wait() == -signal.SIGTERM  # the leader went at SIGTERM


async def test_group_outliving_its_leader_is_ended(tmp_path: Path) -> None:
    async with group(f"{STUBBORN} &") as (leader, start):
        await leader.wait()  # the leader is gone and reaped; its child lives on
        (survivor,) = live_members(leader.pid)
        with journal_with(tmp_path, leader.pid, start) as journal:
            report = await reconcile(journal, grace=0.5, kill_wait=2.0)
            assert report.terminated == (leader.pid,) and report.released == ("inv",)
        assert live_members(leader.pid) == []
        assert not psutil.pid_exists(survivor) or (
            psutil.Process(survivor).status() == psutil.STATUS_ZOMBIE
        )


async def test_reused_group_with_older_members_is_never_touched(tmp_path: Path) -> None:
    async with group("(echo ready; exec sleep 60) &") as (leader, start):
        await leader.wait()
        (member,) = live_members(leader.pid)
        # The journal's process started after every member of the group now holding
        # that id: the group is someone else's.
        with journal_with(tmp_path, leader.pid, start + 100.0) as journal:
            report = await reconcile(journal, grace=0.5, kill_wait=0.5)
            assert report.reused == (leader.pid,) and report.terminated == ()
            assert report.released == ("inv",)  # ours is gone: its resources are free
        assert live_members(leader.pid) == [member]
        assert psutil.Process(member).status() != psutil.STATUS_STOPPED


async def test_group_surviving_sigkill_keeps_its_reservation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = node.machine.procgroup.signal_group

    def no_sigkill(pgid: int, signum: int) -> bool:  # as if stuck in the kernel
        return True if signum == signal.SIGKILL else real(pgid, signum)

    monkeypatch.setattr(node.machine.procgroup, "signal_group", no_sigkill)
    async with group(f"{STUBBORN} & wait") as (leader, start):
        with journal_with(tmp_path, leader.pid, start) as journal:
            report = await reconcile(journal, grace=0.3, kill_wait=0.3)
            assert report.unkillable == (leader.pid,) and report.kept == ("inv",)
            assert report.released == ()
            assert set(journal.reservations()) == {"inv"}
            assert set(journal.processes()) == {leader.pid}  # retried on the next start
        assert "survived SIGKILL" in caplog.text
        assert len(live_members(leader.pid)) == 1
