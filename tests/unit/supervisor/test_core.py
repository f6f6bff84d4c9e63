"""The supervisor with builtin work under a frozen MockClock: every ending releases
everything (ledger, tokens, journal) before the terminal state is recorded, and
admission refuses with typed reasons while changing nothing."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing

from capabilities import LaneOp
from machine.health import HealthState, HealthTransition, Signal
from machine.lanes import Isolation, Requirement
from machine.snapshot import rfc3339
from supervisor.admission import AdmissionRefused
from supervisor.core import UnknownInvocation
from supervisor.invocation import utc_now
from supervisor.listing import ListQuery
from supervisor.wire import (
    EventKind,
    InvocationRequest,
    InvocationState,
    InvocationStatus,
)
from tests.supervisor_fixtures import (
    SIM_GPU,
    SIM_MIG_GPU,
    GiB,
    Rig,
    builtin,
    gpu_builtin,
    only_lane,
    open_rig,
    open_unstarted,
)

S = InvocationState


def gpu_sleep(invocation_id: str, **kw: object) -> InvocationRequest:
    return gpu_builtin(invocation_id, vram_bytes=2 * GiB, seconds=100, **kw)


def recover(rig: Rig, device: str) -> None:
    rig.machine.health.apply(device, Signal.RESET, at=trio.current_time())
    for _ in range(rig.machine.health.recovery_probes):
        rig.machine.health.apply(device, Signal.GOOD, at=trio.current_time())
    assert rig.machine.health.state(device) is HealthState.HEALTHY


# -- endings ---------------------------------------------------------------------------


async def test_normal_return_releases_everything(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        response = await rig.sup.submit(builtin("ok", "sleep", seconds=5))
        assert response.state is S.queued
        assert len(rig.machine.ledger) == 1
        assert "ok" in rig.machine.journal.reservations()
        await rig.wait_state("ok", S.running)
        mock_clock.jump(5)
        assert await rig.wait_terminal("ok") is S.succeeded
        status = rig.sup.get("ok")
        assert (status.exit_code, status.reason) == (0, None)
        assert status.started_at is not None and status.ended_at is not None
        rig.assert_released("ok", response.tokens)


async def test_echo_output_is_recorded(tmp_path: Path, mock_clock: trio.testing.MockClock) -> None:
    async with open_rig(tmp_path) as rig:
        response = await rig.sup.submit(builtin("e", "echo", text="hello"))
        assert await rig.wait_terminal("e") is S.succeeded
        assert rig.sup.get("e").stdout_tail == "hello"
        rig.assert_released("e", response.tokens)


async def test_the_ended_event_get_and_the_journal_tell_the_same_ending(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        await rig.sup.submit(builtin("same", "echo", text="out"))
        assert await rig.wait_terminal("same") is S.succeeded
        await trio.testing.wait_all_tasks_blocked()
        status = rig.sup.get("same")
        [announced] = [
            e.invocation
            for e in rig.seen
            if e.invocation is not None and e.invocation.state is S.succeeded
        ]
        assert announced == status and status.stdout_tail == "out"
        record = rig.machine.journal.ended("same")
        assert record is not None
        remembered = msgspec.json.decode(record.outcome, type=InvocationStatus)
        # The journal keeps all of it but the output text.
        assert remembered == msgspec.structs.replace(status, stdout_tail="", stderr_tail="")
        [listed] = rig.sup.list_page(ListQuery()).invocations
        assert listed == status


async def test_a_builtin_exception_fails_and_releases(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        response = await rig.sup.submit(builtin("f", "fail", message="boom"))
        assert await rig.wait_terminal("f") is S.failed
        assert rig.sup.get("f").reason == "BuiltinFailed: boom"
        rig.assert_released("f", response.tokens)


async def test_a_gpu_builtin_failure_releases_the_gpu(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        request = builtin("gf", "fail", requirement=Requirement.GPU, gpus=1, vram_bytes=GiB)
        response = await rig.sup.submit(request)
        assert response.lanes[0].kind == "gpu"
        assert await rig.wait_terminal("gf") is S.failed
        rig.assert_released("gf", response.tokens)


async def test_the_deadline_times_out_and_releases(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        response = await rig.sup.submit(gpu_sleep("t", timeout_s=5))
        await rig.wait_state("t", S.running)
        mock_clock.jump(4.9)
        await trio.testing.wait_all_tasks_blocked()
        assert rig.sup.get("t").state is S.running
        mock_clock.jump(0.2)
        assert await rig.wait_terminal("t") is S.timed_out
        assert rig.sup.get("t").reason == "deadline_exceeded"
        rig.assert_released("t", response.tokens)


async def test_a_cancel_answers_only_after_everything_is_released(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        response = await rig.sup.submit(gpu_sleep("c"))
        await rig.wait_state("c", S.running)
        status = await rig.sup.cancel("c")
        # The answer itself is terminal, and nothing is held any more at that moment.
        assert (status.state, status.reason) == (S.cancelled, "cancel_requested")
        rig.assert_released("c", response.tokens)
        # Cancelling again (or an ended invocation) only reads the record.
        assert (await rig.sup.cancel("c")).state is S.cancelled


async def test_cancel_of_an_unknown_id_is_refused(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        with pytest.raises(UnknownInvocation):
            await rig.sup.cancel("nope")
        with pytest.raises(UnknownInvocation):
            rig.sup.get("nope")


async def test_cancel_and_timeout_while_queued_never_start(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, max_running=1) as rig:
        first = await rig.sup.submit(builtin("run", "sleep", seconds=100))
        queued = await rig.sup.submit(builtin("q1", "sleep", seconds=1))
        timing = await rig.sup.submit(builtin("q2", "sleep", seconds=1, timeout_s=10))
        await rig.wait_state("run", S.running)
        await trio.testing.wait_all_tasks_blocked()
        assert rig.sup.get("q1").state is S.queued
        status = await rig.sup.cancel("q1")
        assert (status.state, status.reason, status.started_at) == (
            S.cancelled,
            "cancel_requested",
            None,
        )
        mock_clock.jump(10)
        assert await rig.wait_terminal("q2") is S.timed_out
        assert rig.sup.get("q2").reason == "deadline_exceeded"
        assert rig.sup.get("q2").started_at is None
        await rig.sup.cancel("run")
        rig.assert_released("q1", queued.tokens)
        rig.assert_released("q2", timing.tokens)
        rig.assert_released("run", first.tokens)


async def test_a_device_fault_cancels_work_on_it_with_lane_unhealthy(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        gpu = await rig.sup.submit(gpu_sleep("g"))
        mig = await rig.sup.submit(gpu_builtin("m", isolation=Isolation.PARTITIONED, seconds=100))
        cpu = await rig.sup.submit(builtin("cpu", "sleep", seconds=100))
        await rig.wait_state("g", S.running)
        await rig.wait_state("m", S.running)
        rig.machine.health.apply(SIM_GPU, Signal.FATAL_XID, "xid_79: fell off", at=0.0)
        assert await rig.wait_terminal("g") is S.cancelled
        assert rig.sup.get("g").reason == "lane_unhealthy"
        # Work on other devices is untouched.
        await trio.testing.wait_all_tasks_blocked()
        assert rig.sup.get("m").state is S.running
        assert rig.sup.get("cpu").state is S.running
        # A lost MIG parent takes down every instance's work.
        rig.machine.health.apply(SIM_MIG_GPU, Signal.LOST, "device_lost", at=0.0)
        assert await rig.wait_terminal("m") is S.cancelled
        assert rig.sup.get("m").reason == "lane_unhealthy"
        await rig.sup.cancel("cpu")
        recover(rig, SIM_GPU)
        # Lost needs a rediscovery before good probes count.
        rig.machine.health.apply(SIM_MIG_GPU, Signal.REDISCOVERED, at=0.0)
        recover(rig, SIM_MIG_GPU)
        rig.assert_released("g", gpu.tokens)
        rig.assert_released("m", mig.tokens)
        rig.assert_released("cpu", cpu.tokens)


async def test_a_mig_instances_own_fault_cancels_only_the_work_on_that_instance(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        first = await rig.sup.submit(
            gpu_builtin("m1", isolation=Isolation.PARTITIONED, seconds=100)
        )
        second = await rig.sup.submit(
            gpu_builtin("m2", isolation=Isolation.PARTITIONED, seconds=100)
        )
        await rig.wait_state("m1", S.running)
        await rig.wait_state("m2", S.running)
        lane_id, _ = only_lane(first)
        lane = rig.machine.ledger.lane(lane_id)
        assert lane is not None and lane.visible_uuid is not None
        assert only_lane(second)[0] != lane_id
        # A fatal XID the driver charged to that instance alone (machine/health.py).
        rig.machine.health.apply(lane.visible_uuid, Signal.FATAL_XID, "xid_94: contained", at=0.0)
        assert await rig.wait_terminal("m1") is S.cancelled
        assert rig.sup.get("m1").reason == "lane_unhealthy"
        await trio.testing.wait_all_tasks_blocked()
        assert rig.sup.get("m2").state is S.running
        assert rig.machine.ledger.lane_health(lane_id) is HealthState.UNHEALTHY
        assert rig.machine.health.state(SIM_MIG_GPU) is HealthState.HEALTHY
        await rig.sup.cancel("m2")
        recover(rig, lane.visible_uuid)
        rig.assert_released("m1", first.tokens)
        rig.assert_released("m2", second.tokens)


async def test_on_health_called_directly_cancels_and_publishes(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        response = await rig.sup.submit(gpu_sleep("h"))
        await rig.wait_state("h", S.running)
        rig.sup.on_health(
            HealthTransition(
                device_id=SIM_GPU,
                from_state=HealthState.HEALTHY,
                to_state=HealthState.UNHEALTHY,
                signal=Signal.ECC,
                reasons=("ecc",),
                at=0.0,
            )
        )
        assert await rig.wait_terminal("h") is S.cancelled
        assert rig.sup.get("h").reason == "lane_unhealthy"
        rig.assert_released("h", response.tokens)
        await trio.testing.wait_all_tasks_blocked()
        health = [e for e in rig.seen if e.kind is EventKind.health]
        assert [(e.device_id, e.to_state) for e in health] == [(SIM_GPU, "unhealthy")]


async def test_a_suspect_device_keeps_its_work(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        await rig.sup.submit(gpu_sleep("s"))
        await rig.wait_state("s", S.running)
        rig.machine.health.apply(SIM_GPU, Signal.APP_XID, "xid_13", at=0.0)
        await trio.testing.wait_all_tasks_blocked()
        assert rig.sup.get("s").state is S.running


async def test_shutdown_gives_grace_then_cancels_and_refuses_new_work(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, max_running=2) as rig:
        quick = await rig.sup.submit(builtin("quick", "sleep", seconds=1))
        slow = await rig.sup.submit(gpu_sleep("slow"))
        queued = await rig.sup.submit(builtin("queued", "sleep", seconds=1))
        await rig.wait_state("slow", S.running)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rig.sup.shutdown, 2.0)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(AdmissionRefused) as refused:
                await rig.sup.submit(builtin("late", "echo"))
            assert (refused.value.status, refused.value.reason) == (503, "shutting_down")
            mock_clock.jump(1)  # quick finishes within the grace, queued then runs
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(1.5)  # grace over
        assert rig.sup.get("quick").state is S.succeeded
        for name in ("slow", "queued"):
            assert rig.sup.get(name).state in (S.cancelled, S.succeeded)
        assert (rig.sup.get("slow").state, rig.sup.get("slow").reason) == (S.cancelled, "shutdown")
        for name, response in (("quick", quick), ("slow", slow), ("queued", queued)):
            rig.assert_released(name, response.tokens)


async def test_outer_cancellation_releases_everything(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_unstarted(tmp_path, max_running=1) as (machine, sup, tokens):
        baseline = machine.ledger.capacity()
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(sup.run)
                running = await sup.submit(gpu_sleep("r"))
                queued = await sup.submit(builtin("q", "sleep", seconds=1))
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()  # what Ctrl-C does to the daemon's top nursery
        for name in ("r", "q"):
            status = sup.get(name)
            assert (status.state, status.reason) == (S.cancelled, "shutdown")
        assert len(machine.ledger) == 0 and machine.ledger.capacity() == baseline
        assert machine.journal.reservations() == {}
        assert tokens.live_tokens == 0
        for response in (running, queued):
            for lane_id, token in response.tokens.items():
                with pytest.raises(Exception, match="revoked"):
                    sup.validator.validate(token, lane_id=lane_id, op=LaneOp.EXECUTE)


async def test_keyboard_interrupt_in_the_daemon_releases_everything(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_unstarted(tmp_path, max_running=4) as (machine, sup, tokens):

        async def interrupt() -> None:
            await trio.testing.wait_all_tasks_blocked()
            raise KeyboardInterrupt

        with pytest.raises(BaseExceptionGroup) as info:
            async with trio.open_nursery() as nursery:
                await nursery.start(sup.run)
                await sup.submit(gpu_sleep("k"))
                nursery.start_soon(interrupt)
        assert info.group_contains(KeyboardInterrupt)
        assert (sup.get("k").state, sup.get("k").reason) == (S.cancelled, "shutdown")
        assert len(machine.ledger) == 0
        assert machine.journal.reservations() == {}
        assert tokens.live_tokens == 0


async def test_a_submission_after_the_supervisor_stopped_is_refused_and_leaks_nothing(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_unstarted(tmp_path, max_running=1) as (machine, sup, tokens):
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            nursery.cancel_scope.cancel()  # torn down without shutdown() being called
        with pytest.raises(AdmissionRefused) as refused:
            await sup.submit(builtin("late", "echo"))
        assert (refused.value.status, refused.value.reason) == (503, "shutting_down")
        assert len(machine.ledger) == 0 and machine.journal.reservations() == {}
        assert tokens.live_tokens == 0
        with pytest.raises(UnknownInvocation):
            sup.get("late")


def test_utc_now_is_rfc3339_with_milliseconds_as_snapshots_write_it() -> None:
    before = datetime.datetime.now(datetime.UTC)
    stamp = utc_now()
    after = datetime.datetime.now(datetime.UTC)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", stamp), stamp
    parsed = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    assert before - datetime.timedelta(milliseconds=1) <= parsed <= after
    assert rfc3339(parsed) == stamp
