"""Reconcile ends the whole process group a dead daemon left, and never someone else's."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import struct
import subprocess
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import psutil  # type: ignore[import-untyped,unused-ignore]
import pytest
import trio

import machine.procgroup
import machine.reconcile
from machine.cgroups import CgroupLimits, Cgroups, system_cgroups
from machine.journal import JOURNAL_FILENAME, Journal
from machine.proc import process_start_ticks
from machine.reconcile import Spared, SpareReason, reconcile
from tests.unit.machine.test_journal import reservation

# The grandchild ignores SIGTERM (inherited across exec) and says so once it does.
STUBBORN = "(trap '' TERM; echo ready; exec sleep 60)"
# The leader itself ignores SIGTERM: only SIGKILL ends it.
STUBBORN_LEADER = "trap '' TERM; echo ready; exec sleep 60"


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
async def group(script: str) -> AsyncIterator[tuple[trio.Process, int]]:
    """`sh -c script` leading its own group (as the supervisor starts it), once it
    printed "ready"; the whole group is killed afterwards whatever happened."""
    leader = await trio.lowlevel.open_process(
        ["sh", "-c", script], stdout=subprocess.PIPE, start_new_session=True
    )
    assert leader.stdout is not None
    try:
        # Unreaped, so readable even if it already exited.
        start = process_start_ticks(leader.pid)
        assert start is not None
        with trio.fail_after(5):
            assert await leader.stdout.receive_some() == b"ready\n"
        yield leader, start
    finally:
        with trio.CancelScope(shield=True):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(leader.pid, signal.SIGKILL)
            await leader.wait()
            await leader.stdout.aclose()


def journal_with(tmp_path: Path, pid: int, start: int) -> Journal:
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
        later = start + 100 * os.sysconf("SC_CLK_TCK")
        with journal_with(tmp_path, leader.pid, later) as journal:
            report = await reconcile(journal, grace=0.5, kill_wait=0.5)
            assert report.spared == (Spared(leader.pid, SpareReason.GROUP_REUSED),)
            assert report.terminated == ()
            assert report.released == ("inv",)  # ours is gone: its resources are free
        assert live_members(leader.pid) == [member]
        assert psutil.Process(member).status() != psutil.STATUS_STOPPED


async def test_group_surviving_sigkill_keeps_its_reservation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = machine.procgroup.signal_group

    def no_sigkill(pgid: int, signum: int) -> bool:  # as if stuck in the kernel
        return True if signum == signal.SIGKILL else real(pgid, signum)

    monkeypatch.setattr(machine.procgroup, "signal_group", no_sigkill)
    async with group(f"{STUBBORN} & wait") as (leader, start):
        with journal_with(tmp_path, leader.pid, start) as journal:
            report = await reconcile(journal, grace=0.3, kill_wait=0.3)
            assert report.unkillable == (leader.pid,) and report.kept == ("inv",)
            assert report.released == ()
            assert set(journal.reservations()) == {"inv"}
            assert set(journal.processes()) == {leader.pid}  # retried on the next start
        assert "survived SIGKILL" in caplog.text
        assert len(live_members(leader.pid)) == 1


@contextlib.contextmanager
def no_signals_sent(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """Every os.kill/os.killpg is recorded (as (target, signal); a group as -pgid) and
    nothing is sent: what a wrong target would hit here is the test run itself."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: sent.append((-pgid, sig)))
    yield sent
    monkeypatch.undo()


async def test_record_naming_pid_0_or_1_signals_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # kill(0) is the daemon's own group, kill(-1) every process; pid 1 is init.
    caplog.set_level(logging.INFO, logger="machine.reconcile")
    journal, _ = Journal.open(tmp_path)
    journal.record_reserve(reservation("inv"))
    for pid in (0, 1, -1):
        journal.record_process_started("inv", pid, process_start_ticks(1) or 0)
    with no_signals_sent(monkeypatch) as sent:
        report = await reconcile(journal, grace=0.2, kill_wait=0.2)
    assert [s for s in sent if s[1] != 0] == []
    assert report.spared == tuple(Spared(p, SpareReason.INVALID_PID) for p in (0, 1, -1))
    assert report.terminated == () and report.released == ("inv",)
    assert journal.processes() == {}  # judged once, not again on every start
    assert "spared pid 0 of reservation inv: invalid_pid" in caplog.text
    journal.close()


async def test_record_naming_the_daemon_itself_signals_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal, _ = Journal.open(tmp_path)
    journal.record_reserve(reservation("inv"))
    ours = {os.getpid(), os.getpgrp(), os.getsid(0)} - {0, 1}
    for pid in ours:  # each with its true start time, as anyone can read it from /proc
        journal.record_process_started("inv", pid, process_start_ticks(pid))
    with no_signals_sent(monkeypatch) as sent:
        report = await reconcile(journal, grace=0.2, kill_wait=0.2)
    assert [s for s in sent if s[1] != 0] == []
    assert set(report.spared) == {Spared(p, SpareReason.DAEMON_ITSELF) for p in ours}
    journal.close()


async def test_unrelated_process_with_its_true_start_time_is_not_killed(tmp_path: Path) -> None:
    # Not started the way the supervisor starts work (a session of its own): not ours.
    other = await trio.lowlevel.open_process(["sleep", "60"])
    try:
        with journal_with(tmp_path, other.pid, process_start_ticks(other.pid) or 0) as journal:
            report = await reconcile(journal, grace=0.3, kill_wait=0.3)
            assert other.poll() is None
            assert report.spared == (Spared(other.pid, SpareReason.NOT_SESSION_LEADER),)
            assert report.terminated == () and report.released == ("inv",)
    finally:
        with trio.CancelScope(shield=True):
            other.kill()
            await other.wait()


@pytest.mark.parametrize(
    ("cgroups", "ended"),
    [
        (["/system.slice/node.service/litegraph-other"], False),
        (["/", "/litegraph-other", "/"], False),  # cgroup v1: memory hierarchy only
        (["/x/litegraph-inv", "/x/litegraph-other"], False),
        (["/x/litegraph-inv"], True),
        (["/", "/litegraph-inv"], True),
        (["/user.slice"], True),  # no invocation cgroup (none could be made)
    ],
)
async def test_only_a_process_outside_other_invocations_cgroups_is_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cgroups: list[str], ended: bool
) -> None:
    monkeypatch.setattr(machine.reconcile, "process_cgroups", lambda pid: cgroups)
    async with group("echo ready; exec sleep 60") as (leader, start):
        with journal_with(tmp_path, leader.pid, start) as journal:
            report = await reconcile(journal, grace=0.5, kill_wait=0.5)
        if ended:
            assert report.terminated == (leader.pid,)
            assert await leader.wait() == -signal.SIGTERM
        else:
            assert leader.poll() is None and live_members(leader.pid) == [leader.pid]
            assert report.spared == (Spared(leader.pid, SpareReason.OTHER_CGROUP),)


async def test_a_wall_clock_step_does_not_spare_a_real_orphan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with group("echo ready; exec sleep 60") as (leader, start):
        journal = journal_with(tmp_path, leader.pid, start)
        journal.close()
        # The clock is stepped 1 s before the restart: every wall-clock start time
        # read from now on is 1 s off.
        real = psutil.Process.create_time
        monkeypatch.setattr(psutil.Process, "create_time", lambda self: real(self) + 1.0)
        real_boot = psutil.boot_time
        monkeypatch.setattr(psutil, "boot_time", lambda: real_boot() + 1.0)
        with Journal.open(tmp_path)[0] as journal:
            report = await reconcile(journal, grace=0.5, kill_wait=0.5)
        assert report.terminated == (leader.pid,)
        assert await leader.wait() == -signal.SIGTERM


async def test_a_record_from_before_start_ticks_is_still_read_and_matched(tmp_path: Path) -> None:
    class OlderProcessStarted(msgspec.Struct, tag="process_started"):
        reservation_id: str
        pid: int
        start_time: float  # psutil create_time(), as the journal once held it

    async with group("echo ready; exec sleep 60") as (leader, _start):
        with journal_with(tmp_path, leader.pid, 0) as journal:
            journal.record_process_ended("inv", leader.pid)
        payload = msgspec.msgpack.encode(
            OlderProcessStarted("inv", leader.pid, psutil.Process(leader.pid).create_time())
        )
        with (tmp_path / JOURNAL_FILENAME).open("ab") as file:
            file.write(struct.pack(">II", len(payload), zlib.crc32(payload)) + payload)
        journal, replay = Journal.open(tmp_path)
        with journal:
            assert replay.problem is None and replay.processes[leader.pid].start_ticks is None
            report = await reconcile(journal, grace=0.5, kill_wait=0.5)
        assert report.terminated == (leader.pid,) and report.released == ("inv",)


async def test_stubborn_groups_are_ended_together_within_one_grace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="machine.reconcile")
    grace, count = 0.5, 6
    async with contextlib.AsyncExitStack() as stack:
        groups = [await stack.enter_async_context(group(STUBBORN_LEADER)) for _ in range(count)]
        journal, _ = Journal.open(tmp_path)
        for i, (leader, start) in enumerate(groups):
            journal.record_reserve(reservation(f"inv-{i}"))
            journal.record_process_started(f"inv-{i}", leader.pid, start)
        began = time.monotonic()
        report = await reconcile(journal, grace=grace, kill_wait=2.0)
        took = time.monotonic() - began
        journal.close()
        # One grace for all of them (one after another would be count * grace = 3 s).
        assert grace <= took < 2 * grace
        assert sorted(report.terminated) == sorted(leader.pid for leader, _ in groups)
        assert len(report.released) == count
        for leader, _ in groups:
            assert live_members(leader.pid) == []
            assert await leader.wait() == -signal.SIGKILL
    assert caplog.text.count("reconcile: ended process group") == count
    assert caplog.text.count("reconcile: released reservation") == count


@pytest.mark.parametrize("pgid", [0, 1, -1, os.getpgrp()])
def test_signal_group_refuses_every_process_and_our_own_group(pgid: int) -> None:
    # killpg(0) is our own group, kill(-1) every process we may signal.
    with pytest.raises(ValueError, match="refusing to signal"):
        machine.procgroup.signal_group(pgid, 0)


@pytest.mark.parametrize("ours", [False, True])
async def test_a_real_invocation_cgroup_decides_whose_process_it_is(
    tmp_path: Path, ours: bool
) -> None:
    found = system_cgroups()
    if os.geteuid() != 0 or not isinstance(found, Cgroups):
        pytest.skip(f"needs root and usable cgroups: {found}")
    name = f"t{os.getpid()}-{'inv' if ours else 'other'}"
    limits = CgroupLimits(memory_bytes=64 << 20, cpu_millis=500, pids_max=16)
    cgroup = found.create(name, limits)
    try:
        leader = await trio.lowlevel.open_process(
            ["sleep", "60"], start_new_session=True, preexec_fn=cgroup.preexec_join()
        )
        try:
            rid = name if ours else f"t{os.getpid()}-inv"
            journal, _ = Journal.open(tmp_path)
            journal.record_reserve(reservation(rid))
            journal.record_process_started(rid, leader.pid, process_start_ticks(leader.pid))
            with journal:
                report = await reconcile(journal, grace=0.5, kill_wait=0.5)
            if ours:
                assert await leader.wait() == -signal.SIGTERM
                assert report.terminated == (leader.pid,)
            else:
                assert leader.poll() is None
                assert report.spared == (Spared(leader.pid, SpareReason.OTHER_CGROUP),)
        finally:
            with trio.CancelScope(shield=True):
                leader.kill()
                await leader.wait()
    finally:
        with trio.CancelScope(shield=True):
            assert await cgroup.remove()


async def test_start_ticks_survive_compaction_and_a_restart(tmp_path: Path) -> None:
    async with group("echo ready; exec sleep 60") as (leader, start):
        with journal_with(tmp_path, leader.pid, start) as journal:
            journal.compact()
        journal, replay = Journal.open(tmp_path)
        with journal:
            assert replay.processes[leader.pid].start_ticks == start
            report = await reconcile(journal, grace=0.5, kill_wait=0.5)
        assert report.terminated == (leader.pid,)
        assert await leader.wait() == -signal.SIGTERM


async def test_a_record_without_a_start_time_is_spared(tmp_path: Path) -> None:
    # /proc could not be read at spawn: nothing tells our process from another.
    async with group("echo ready; exec sleep 60") as (leader, _start):
        journal, _ = Journal.open(tmp_path)
        journal.record_reserve(reservation("inv"))
        journal.record_process_started("inv", leader.pid, None)
        with journal:
            report = await reconcile(journal, grace=0.3, kill_wait=0.3)
        assert leader.poll() is None
        assert report.spared == (Spared(leader.pid, SpareReason.NO_START_TIME),)
        assert report.released == ("inv",)
