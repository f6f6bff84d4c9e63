"""The supervisor when the journal is slow or fails: admission races with faults and
cancels, and journal errors at process start/end never take the supervisor down."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import pytest
import trio
import trio.testing

from machine import Machine
from machine.health import Signal
from machine.journal import JournalError, Record
from supervisor.admission import AdmissionRefused
from supervisor.core import UnknownInvocation
from supervisor.wire import InvocationState
from tests.supervisor_fixtures import (
    SIM_GPU,
    TREE,
    FaultyJournalMachine,
    GiB,
    Rig,
    builtin,
    gpu_builtin,
    kill_leftovers,
    open_rig,
    open_unstarted,
    process,
    session_members,
    tree_pid,
)

S = InvocationState


def machine(rig: Rig) -> FaultyJournalMachine:
    assert isinstance(rig.machine, FaultyJournalMachine)
    return rig.machine


async def cancel_during_admission(
    m: FaultyJournalMachine,
    submit: Callable[[], Awaitable[None]],
    cancel: Callable[[], Awaitable[None]],
) -> None:
    """`submit` runs until its journal write waits at `m.gate`, then `cancel` runs until
    it waits as well; then the gate opens and both run to their end."""
    assert m.gate is not None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(cancel)
        await trio.testing.wait_all_tasks_blocked()
        m.gate.set()


async def test_a_journal_failure_at_admission_is_a_typed_503_and_reserves_nothing(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, machine_cls=FaultyJournalMachine) as rig:
        machine(rig).fail = True
        with pytest.raises(AdmissionRefused) as refused:
            await rig.sup.submit(builtin("j", "echo"))
        assert (refused.value.status, refused.value.reason) == (503, "journal_unavailable")
        assert len(rig.machine.ledger) == 0 and rig.tokens.live_tokens == 0
        with pytest.raises(UnknownInvocation):
            rig.sup.get("j")
        machine(rig).fail = False
        await rig.sup.submit(builtin("j", "echo"))  # the id was not kept
        assert await rig.wait_terminal("j") is S.succeeded


async def test_a_cancel_during_a_failing_admission_answers_at_once(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, machine_cls=FaultyJournalMachine) as rig:
        m = machine(rig)
        m.gate, m.fail = trio.Event(), True
        outcome: list[object] = []

        async def submit() -> None:
            with pytest.raises(AdmissionRefused):
                await rig.sup.submit(builtin("slow", "sleep", seconds=10))
            outcome.append("refused")

        async def cancel() -> None:
            try:
                await rig.sup.cancel("slow")
            except UnknownInvocation:
                outcome.append("unknown")

        await cancel_during_admission(m, submit, cancel)
        # No waiting out the cleanup deadline: the frozen clock never moved.
        assert trio.current_time() == 0
        assert sorted(map(str, outcome)) == ["refused", "unknown"]
        rig.assert_baseline()


async def test_a_cancel_during_admission_cancels_once_admitted(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, machine_cls=FaultyJournalMachine) as rig:
        m = machine(rig)
        m.gate = trio.Event()
        answers: list[object] = []

        async def submit() -> None:
            answers.append(await rig.sup.submit(builtin("c", "sleep", seconds=10)))

        async def cancel() -> None:
            answers.append(await rig.sup.cancel("c"))

        await cancel_during_admission(m, submit, cancel)
        status = rig.sup.get("c")
        assert (status.state, status.reason, status.started_at) == (
            S.cancelled,
            "cancel_requested",
            None,
        )
        rig.assert_baseline()


async def test_a_device_fault_while_admission_is_journaled_still_cancels_the_work(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, machine_cls=FaultyJournalMachine) as rig:
        m = machine(rig)
        m.gate = trio.Event()
        responses: list[object] = []
        request = gpu_builtin("race", vram_bytes=GiB, seconds=100)

        async def submit() -> None:
            responses.append(await rig.sup.submit(request))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit)
            await trio.testing.wait_all_tasks_blocked()
            assert m.writes_waiting == 1  # reserved in the ledger, not yet journaled
            rig.machine.health.apply(SIM_GPU, Signal.FATAL_XID, "xid_79", at=0.0)
            m.gate.set()
        assert await rig.wait_terminal("race") is S.cancelled
        assert rig.sup.get("race").reason == "lane_unhealthy"
        assert len(rig.machine.ledger) == 0


class StartGateMachine(Machine):
    """Holds the journaling of a process start until the test opens the gate, or fails it."""

    start_gate = trio.Event()
    starts_waiting = 0
    fail_start = False

    async def process_started(self, reservation_id: str, pid: int, start_ticks: int | None) -> None:
        type(self).starts_waiting += 1
        await self.start_gate.wait()
        if self.fail_start:
            raise JournalError("injected: the start record cannot be written")
        await super().process_started(reservation_id, pid, start_ticks)


async def test_a_process_whose_start_cannot_be_journaled_never_runs(tmp_path: Path) -> None:
    # A process a crash could leave unrecorded must not run: its argv waits for the record.
    marker = tmp_path / "ran"
    StartGateMachine.start_gate = gate = trio.Event()
    gate.set()
    StartGateMachine.fail_start = True
    async with open_rig(tmp_path, machine_cls=StartGateMachine) as rig:
        first = await rig.sup.submit(process("p1", "sh", "-c", f"touch {marker}"))
        assert await rig.wait_terminal("p1") is S.failed
        assert "JournalError" in (rig.sup.get("p1").reason or "")
        assert not marker.exists()
        assert len(rig.machine.ledger) == 0
        rig.assert_revoked(first.tokens)
        StartGateMachine.fail_start = False
        second = await rig.sup.submit(process("p2", "true"))
        assert await rig.wait_terminal("p2") is S.succeeded
        rig.assert_revoked(second.tokens)


async def test_a_process_runs_only_once_its_start_is_durable(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    StartGateMachine.start_gate = gate = trio.Event()
    StartGateMachine.starts_waiting, StartGateMachine.fail_start = 0, False
    async with open_rig(tmp_path, machine_cls=StartGateMachine) as rig:
        await rig.sup.submit(process("p1", "sh", "-c", f"touch {marker}; sleep 60"))
        with trio.fail_after(10):
            while StartGateMachine.starts_waiting == 0:  # noqa: ASYNC110
                await trio.sleep(0.01)
        await trio.sleep(0.3)  # time enough for an ungated child to run
        assert not marker.exists()
        assert not rig.machine.journal.processes()
        gate.set()
        with trio.fail_after(10):
            while not marker.exists():  # noqa: ASYNC110
                await trio.sleep(0.01)
        assert [p.reservation_id for p in rig.machine.journal.processes().values()] == ["p1"]
        await rig.sup.cancel("p1")


async def test_a_journal_failure_at_process_end_is_survived(tmp_path: Path) -> None:
    async with open_rig(tmp_path, machine_cls=FaultyJournalMachine) as rig:
        m = machine(rig)
        await rig.sup.submit(process("p", *TREE))
        sid = await tree_pid(rig, "p")
        try:
            with trio.fail_after(5):
                while not rig.machine.journal.processes():  # noqa: ASYNC110
                    await trio.sleep(0.01)
            m.fail = True
            status = await rig.sup.cancel("p")
            assert status.state is S.cancelled
            assert session_members(sid) == []
            assert len(rig.machine.ledger) == 0
        finally:
            kill_leftovers(sid)
        m.fail = False
        await rig.sup.submit(builtin("after", "echo"))
        assert await rig.wait_terminal("after") is S.succeeded


async def test_a_supervisor_stopping_during_admission_refuses_and_releases(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    unstarted = open_unstarted(tmp_path, machine_cls=FaultyJournalMachine, max_running=1)
    async with unstarted as (m, sup, tokens):
        assert isinstance(m, FaultyJournalMachine)
        outcome: list[AdmissionRefused] = []

        async def submit() -> None:
            with pytest.raises(AdmissionRefused) as refused:
                await sup.submit(builtin("late", "sleep", seconds=10))
            outcome.append(refused.value)

        async with trio.open_nursery() as outer:
            with trio.CancelScope() as run_scope:
                async with trio.open_nursery() as inner:
                    await inner.start(sup.run)
                    gate = m.gate = trio.Event()
                    outer.start_soon(submit)
                    await trio.testing.wait_all_tasks_blocked()
                    assert m.writes_waiting == 1
                    run_scope.cancel()
            gate.set()
        assert [(r.status, r.reason) for r in outcome] == [(503, "shutting_down")]
        assert len(m.ledger) == 0 and m.journal.reservations() == {}
        assert tokens.live_tokens == 0


async def test_a_cancel_journals_the_release_and_the_outcome_in_one_fsync(
    tmp_path: Path,
) -> None:
    async with open_rig(tmp_path) as rig:
        await rig.sup.submit(builtin("c", seconds=60))
        await rig.wait_state("c", InvocationState.running)
        before = rig.machine.group_commit.batches
        status = await rig.sup.cancel("c")
        assert status.state is InvocationState.cancelled
        # Both records were durable when DELETE answered, and they shared one fsync.
        assert rig.machine.group_commit.batches - before == 1
        assert "c" not in rig.machine.journal.reservations()
        assert rig.machine.journal.ended("c") is not None


async def test_a_process_end_journals_release_process_end_and_outcome_in_one_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_rig(tmp_path) as rig:
        journal = rig.machine.journal
        real = journal.append_framed
        batches: list[list[str]] = []

        def append_framed(batch: Sequence[tuple[Record, bytes]]) -> None:
            batches.append([type(record).__name__ for record, _framed in batch])
            real(batch)

        monkeypatch.setattr(journal, "append_framed", append_framed)
        await rig.sup.submit(process("p", "true"))
        assert await rig.wait_terminal("p") is S.succeeded
        ending = [b for b in batches if "EndedRecord" in b]
        # One write (one fsync) carries all three, so DELETE and the terminal state
        # wait for one fsync, and a crash never keeps one of them without the others.
        assert ending == [["ReleaseRecord", "ProcessEndedRecord", "EndedRecord"]]
        assert journal.reservations() == {} and journal.processes() == {}
        assert journal.ended("p") is not None


async def test_an_unexpected_error_journaling_an_ending_still_ends_the_invocation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_rig(tmp_path) as rig:
        group = rig.machine.group_commit
        real = group.commit

        async def commit(*records: Record, shield: bool = False) -> None:
            if shield:  # the ending's records
                raise RuntimeError("something unforeseen")
            await real(*records, shield=shield)

        monkeypatch.setattr(group, "commit", commit)
        await rig.sup.submit(builtin("odd", "echo"))
        assert await rig.wait_terminal("odd") is S.succeeded  # logged, not fatal
        assert len(rig.machine.ledger) == 0
        monkeypatch.setattr(group, "commit", real)
        await rig.sup.submit(builtin("after", "echo"))
        assert await rig.wait_terminal("after") is S.succeeded


async def test_endings_cut_off_by_a_stopping_supervisor_are_still_journaled(
    tmp_path: Path,
) -> None:
    """The supervisor's nursery is cancelled while the endings wait for the disk:
    each ending still waits for its records (release and outcome) to be durable."""
    async with open_unstarted(tmp_path, machine_cls=FaultyJournalMachine) as (m, sup, tokens):

        async def open_the_gate_once_an_ending_waits(gate: trio.Event) -> None:
            with trio.move_on_after(5):  # an ending that gave up never reaches the gate
                while m.writes_waiting == 0:  # noqa: ASYNC110
                    await trio.sleep(0.001)
            gate.set()

        async with trio.open_nursery() as helper:
            async with trio.open_nursery() as outer:
                await outer.start(sup.run)
                for name in ("a", "b"):
                    await sup.submit(builtin(name, seconds=60))
                while sup.counts()[S.running] < 2:  # noqa: ASYNC110
                    await trio.sleep(0.001)
                m.gate = gate = trio.Event()
                helper.start_soon(open_the_gate_once_an_ending_waits, gate)
                outer.cancel_scope.cancel()
        assert len(m.ledger) == 0 and m.journal.reservations() == {}
        assert tokens.live_tokens == 0
        for name in ("a", "b"):
            recorded = m.journal.ended(name)
            assert recorded is not None
            assert sup.get(name).state is S.cancelled
