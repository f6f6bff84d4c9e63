"""The wired Machine: discovery + health + ledger + journal, and a restart."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import trio
import trio.lowlevel
import trio.testing

from machine import Machine
from machine.health import HealthState, HealthTransition
from machine.journal import Journal, JournalUnsafe, Record
from machine.lanes import Isolation, Requirement
from machine.ledger import RefusalReason, ReservationRefused, ReservationRequest
from machine.model import JOURNAL_RETRY_INTERVAL
from machine.readiness import Readiness

GiB = 1 << 30
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "sim-workstation.toml"
G1 = "GPU-5e1d0a3c-0000-4000-8000-5157a0000001"


async def open_machine(state: Path, sim_file: Path | None = None, **kw: object) -> Machine:
    return await Machine.open(
        node_id="node-t",
        devices="sim",
        sim_file=sim_file,
        state_dir=state,
        reserved_cpu_millis=1000,
        reserved_memory_bytes=GiB,
        vram_headroom_bytes=GiB // 2,
        recovery_probes=2,
        **kw,  # type: ignore[arg-type]
    )


async def test_reserve_release_and_restart(tmp_path: Path) -> None:
    machine = await open_machine(tmp_path)
    assert machine.recovery is not None and machine.recovery.released == ()
    r = await machine.reserve(
        ReservationRequest(
            reservation_id="inv-1",
            cpu_millis=2000,
            requirement=Requirement.GPU,
            isolation=Isolation.DEDICATED,
        )
    )
    assert r.visible_devices == (G1,)
    with pytest.raises(ReservationRefused) as info:
        await machine.reserve(ReservationRequest(reservation_id="inv-1"))
    assert info.value.reason is RefusalReason.DUPLICATE_RESERVATION
    await machine.reserve(ReservationRequest(reservation_id="inv-2", cpu_millis=500))
    assert await machine.release("inv-2") is not None
    assert await machine.release("inv-2") is None
    first = machine.snapshot()
    second = machine.snapshot()
    assert (first.sequence, second.sequence) == (1, 2)
    assert first.capacity.cpu_millis.allocated == 2000
    await machine.aclose()  # the daemon stops with inv-1 still held (no process recorded)

    again = await open_machine(tmp_path)
    assert set(again.replay.reservations) == {"inv-1"}
    assert again.recovery is not None and again.recovery.released == ("inv-1",)
    assert again.snapshot().capacity.cpu_millis.allocated == 0
    await again.aclose()


async def test_unsafe_journal_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "reservations.journal").symlink_to(target)
    with pytest.raises(JournalUnsafe):
        await open_machine(tmp_path / "state")


async def test_health_reaches_the_ledger(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    events: list[HealthTransition] = []
    # Journal I/O runs in a thread: jump the clock only once that is done.
    machine = await open_machine(tmp_path, EXAMPLE, on_transition=events.append)
    mock_clock.autojump_threshold = 0
    dedicated = ReservationRequest(
        reservation_id="d", requirement=Requirement.GPU, isolation=Isolation.DEDICATED
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: machine.monitor(interval=1.0))
        await trio.sleep(62)  # past xid 48 at t=60
        assert machine.health.state(G1) is HealthState.UNHEALTHY
        with pytest.raises(ReservationRefused) as info:
            machine.ledger.reserve(dedicated)
        assert info.value.reason is RefusalReason.LANE_UNHEALTHY
        await trio.sleep(40)  # recovered at t=90, plus the good probes
        assert machine.health.state(G1) is HealthState.HEALTHY
        assert machine.ledger.reserve(dedicated).visible_devices == (G1,)
        nursery.cancel_scope.cancel()
    assert any(e.to_state is HealthState.UNHEALTHY for e in events)
    mock_clock.autojump_threshold = float("inf")
    await machine.aclose()


async def test_aclose_waits_for_an_abandoned_journal_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    machine = await open_machine(tmp_path)
    journal = machine.journal
    real_append = journal.append_framed
    started, gate = threading.Event(), threading.Event()

    def slow_append(batch: Sequence[tuple[Record, bytes]]) -> None:
        started.set()
        gate.wait(10)  # a disk that takes its time
        real_append(batch)

    monkeypatch.setattr(journal, "append_framed", slow_append)
    try:
        # The caller gives up once its write is under way (not after a fixed time, which
        # a loaded machine may spend before the write starts); the thread runs on.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                machine.reserve, ReservationRequest(reservation_id="late", cpu_millis=100)
            )
            assert await trio.to_thread.run_sync(started.wait, 10)
            nursery.cancel_scope.cancel()
        closed = trio.Event()

        async def close() -> None:
            await machine.aclose()
            closed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(close)
            await trio.testing.wait_all_tasks_blocked()
            assert not closed.is_set()  # not closed under the running write
            gate.set()
            with trio.fail_after(10):
                await closed.wait()
    finally:
        gate.set()
    # The late write landed whole; the next start releases it (it has no process).
    again = await open_machine(tmp_path)
    assert again.recovery is not None and again.recovery.released == ("late",)
    await again.aclose()


async def test_aclose_leaves_a_stuck_write_its_descriptor(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    mock_clock: trio.testing.MockClock,
) -> None:
    # Virtual time: the journal's 0.1 s deadline and shutdown's 0.2 s wait pass only
    # once the write is stuck in its thread, however long a loaded machine takes to
    # open the journal and start that write.
    machine = await open_machine(tmp_path, journal_timeout=0.1)
    journal = machine.journal
    real_append = journal.append_framed
    started, gate, finished = threading.Event(), threading.Event(), threading.Event()

    def stuck_append(batch: Sequence[tuple[Record, bytes]]) -> None:
        started.set()
        gate.wait(10)  # a hung disk
        real_append(batch)
        finished.set()

    await machine.reserve(ReservationRequest(reservation_id="held", cpu_millis=100))
    monkeypatch.setattr(journal, "append_framed", stuck_append)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(machine.release, "held")  # times out, logged; the write runs on
            assert await trio.to_thread.run_sync(started.wait, 10)
            mock_clock.autojump_threshold = 0
        assert "journal release of held failed" in caplog.text
        await machine.aclose(journal_wait=0.2)
        assert "still running" in caplog.text
    finally:
        gate.set()
    # The descriptor was left to the write, which still reaches the journal.
    assert await trio.to_thread.run_sync(finished.wait, 10)
    journal.close()
    replayed, replay = Journal.open(tmp_path)
    replayed.close()
    assert replay.reservations == {}


async def _until(condition: Callable[[], bool]) -> None:
    """Checkpoint until `condition()` (a worker thread may be finishing), bounded in real time."""
    end = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < end, "condition never held"
        await trio.lowlevel.checkpoint()


async def test_a_full_disk_is_a_readiness_reason_until_the_retry_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mock_clock: trio.testing.MockClock
) -> None:
    machine = await open_machine(tmp_path)
    fd, real_write, full = machine.journal._fd, os.write, [False]

    def write(target: int, data: bytes | memoryview) -> int:
        if target != fd or not full[0]:
            return real_write(target, data)
        real_write(target, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", write)
    readiness = Readiness(())
    readiness.check("journal", machine.journal_problem)
    assert readiness.ready
    await machine.reserve(ReservationRequest(reservation_id="held", cpu_millis=100))
    full[0] = True
    with pytest.raises(OSError):
        await machine.reserve(ReservationRequest(reservation_id="x", cpu_millis=100))
    assert set(machine.ledger.reservations()) == {"held"}  # the refused grant was given back
    reason = readiness.reasons()["journal"]
    assert str(machine.journal.path) in reason and "No space left" in reason
    retries = [0]
    real_recover = machine.journal.recover

    def recover() -> None:
        retries[0] += 1
        real_recover()

    monkeypatch.setattr(machine.journal, "recover", recover)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(machine.watch_journal)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(JOURNAL_RETRY_INTERVAL)
        await _until(lambda: retries[0] == 1)
        await trio.testing.wait_all_tasks_blocked()
        assert not readiness.ready  # still full: still not ready
        full[0] = False
        mock_clock.jump(JOURNAL_RETRY_INTERVAL)
        await _until(lambda: readiness.ready)
        nursery.cancel_scope.cancel()
    await machine.aclose()
    journal, replay = Journal.open(tmp_path)
    journal.close()
    assert set(replay.reservations) == {"held"} and replay.problem is None


async def test_a_standing_reservation_outlives_a_restart_and_only_its_release_ends_it(
    tmp_path: Path,
) -> None:
    machine = await open_machine(tmp_path)
    claim = ReservationRequest(
        reservation_id="claim:c1/0",
        requirement=Requirement.GPU,
        isolation=Isolation.DEDICATED,
        standing=True,
    )
    held = await machine.reserve(claim)
    await machine.reserve(ReservationRequest(reservation_id="inv-1", cpu_millis=500))
    await machine.aclose()

    again = await open_machine(tmp_path)
    assert again.recovery is not None
    assert again.recovery.released == ("inv-1",)  # an invocation ends with its daemon
    assert again.recovery.standing == ("claim:c1/0",)
    assert again.ledger.get("claim:c1/0") == held
    assert again.ledger.is_exclusive(held.lanes[0].lane_id)
    assert await again.release("claim:c1/0") == held
    await again.aclose()

    third = await open_machine(tmp_path)
    assert third.ledger.get("claim:c1/0") is None and third.recovery is not None
    assert third.recovery.standing == () and third.recovery.released == ()
    await third.aclose()


async def test_a_standing_release_the_journal_refuses_stays_held(tmp_path: Path) -> None:
    machine = await open_machine(tmp_path)
    held = await machine.reserve(
        ReservationRequest(reservation_id="claim:c1/0", cpu_millis=500, standing=True)
    )

    seen_while_writing: list[object] = []

    async def refused(*_args: object, **_kw: object) -> None:
        # Never free while its release is not durable: nothing else may take it meanwhile.
        seen_while_writing.append(machine.ledger.get("claim:c1/0"))
        raise OSError(errno.EIO, "injected")

    machine.group_commit.commit = refused  # type: ignore[method-assign]
    with pytest.raises(OSError, match="injected"):
        await machine.release("claim:c1/0")
    assert seen_while_writing == [held]
    assert machine.ledger.get("claim:c1/0") == held  # a restart would keep it: so does this
    assert machine.snapshot().capacity.cpu_millis.allocated == 500
    await machine.aclose()


async def test_a_standing_reserve_whose_record_landed_too_late_is_released_after_it(
    tmp_path: Path,
) -> None:
    machine = await open_machine(tmp_path)
    commit = machine.group_commit.commit
    calls: list[str] = []

    async def late(*records: Record, shield: bool = False) -> None:
        # The reserve record lands, but its caller has given up on it (its deadline).
        await commit(*records, shield=shield)
        calls.append(type(records[0]).__name__)
        if len(calls) == 1:
            raise trio.TooSlowError

    machine.group_commit.commit = late  # type: ignore[method-assign]
    with pytest.raises(trio.TooSlowError):
        await machine.reserve(
            ReservationRequest(reservation_id="claim:c1/0", cpu_millis=500, standing=True)
        )
    assert calls == ["ReserveRecord", "ReleaseRecord"]
    assert machine.ledger.get("claim:c1/0") is None
    await machine.aclose()
    again = await open_machine(tmp_path)
    assert again.ledger.get("claim:c1/0") is None  # not held after a restart either
    assert again.recovery is not None and again.recovery.standing == ()
    await again.aclose()
