"""Lane owners through the supervisor: token checks, opaque buffers within budget,
bounded queues, crash restarts with bounded intensity, and faults that reach work."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from capabilities import Isolation as TokenIsolation
from capabilities import LaneOp, TokenRefusal, TokenRefused
from node.machine.lanes import Isolation, Lane, LaneKind, Requirement
from supervisor.admission import AdmissionRefused
from supervisor.lane_owner import LaneBusy, LaneWorkError
from supervisor.lane_work import (
    Execute,
    MemoryRelease,
    MemoryReserve,
    SimulatedExecutor,
)
from supervisor.wire import InvocationState, SubmitResponse
from tests.supervisor_fixtures import GiB, builtin, open_rig

S = InvocationState
BUFFER = r"^buf_[0-9a-f]{32}$"


def gpu_work(invocation_id: str, vram: int = 4 * GiB, **kw: Any) -> Any:
    return builtin(
        invocation_id,
        "sleep",
        requirement=Requirement.GPU,
        gpus=1,
        vram_bytes=vram,
        seconds=1000,
        **kw,
    )


def only_lane(response: SubmitResponse) -> tuple[str, str]:
    ((lane_id, token),) = response.tokens.items()
    return lane_id, token


class CrashingExecutor(SimulatedExecutor):
    """The sim executor, except kernel `boom` raises what no kernel should."""

    async def execute(self, lane: Lane, kernel: str, args: Mapping[str, Any]) -> dict[str, Any]:
        if kernel == "boom":
            raise RuntimeError("driver bug")
        return await super().execute(lane, kernel, args)


# -- memory -------------------------------------------------------------------------------


async def test_memory_reserve_gives_opaque_ids_within_the_token_budget(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, token = only_lane(await rig.sup.submit(gpu_work("m", vram=4 * GiB)))
        owner = rig.sup.owners[lane_id]
        first = await rig.sup.lane_work(lane_id, token, MemoryReserve(bytes=3 * GiB))
        assert first.buffer_id is not None
        assert re.fullmatch(BUFFER, first.buffer_id)
        assert (first.bytes_held, first.invocation_id, first.op) == (3 * GiB, "m", "memory_reserve")
        assert owner.held_by("m") == 3 * GiB
        with pytest.raises(TokenRefused) as refused:
            await rig.sup.lane_work(lane_id, token, MemoryReserve(bytes=GiB + 1))
        assert refused.value.reason is TokenRefusal.VRAM_OVER_BUDGET
        assert owner.held_by("m") == 3 * GiB
        second = await rig.sup.lane_work(lane_id, token, MemoryReserve(bytes=GiB))
        assert second.bytes_held == 4 * GiB and second.buffer_id != first.buffer_id
        assert first.buffer_id is not None
        released = await rig.sup.lane_work(lane_id, token, MemoryRelease(buffer_id=first.buffer_id))
        assert released.bytes_held == GiB
        with pytest.raises(LaneWorkError) as again:
            await rig.sup.lane_work(lane_id, token, MemoryRelease(buffer_id=first.buffer_id))
        assert (again.value.status, again.value.code) == (404, "buffer_not_found")


async def test_another_invocations_buffer_looks_missing(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_a, token_a = only_lane(await rig.sup.submit(gpu_work("a")))
        lane_b, token_b = only_lane(await rig.sup.submit(gpu_work("b")))
        assert lane_a == lane_b  # shared work packs onto one GPU
        theirs = await rig.sup.lane_work(lane_a, token_a, MemoryReserve(bytes=GiB))
        assert theirs.buffer_id is not None
        with pytest.raises(LaneWorkError) as refused:
            await rig.sup.lane_work(lane_b, token_b, MemoryRelease(buffer_id=theirs.buffer_id))
        assert (refused.value.status, refused.value.code) == (404, "buffer_not_found")
        assert rig.sup.owners[lane_a].held_by("a") == GiB


async def test_the_lane_refuses_more_than_its_free_vram(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        request = builtin(
            "mig",
            "sleep",
            requirement=Requirement.GPU,
            isolation=Isolation.PARTITIONED,
            gpus=1,
            seconds=100,
        )
        lane_id, _ = only_lane(await rig.sup.submit(request))
        lane = rig.machine.ledger.lane(lane_id)
        assert lane is not None and lane.kind is LaneKind.MIG
        # A token whose budget is larger than the instance (minted by hand).
        big = rig.tokens.mint(
            invocation_id="mig",
            lane_id=lane_id,
            ops={LaneOp.MEMORY_RESERVE},
            vram_bytes=4 * lane.vram_bytes,
            isolation=TokenIsolation.PARTITIONED,
            deadline=time.time() + 100,
        ).token
        await rig.sup.lane_work(lane_id, big, MemoryReserve(bytes=lane.vram_bytes - GiB))
        with pytest.raises(LaneWorkError) as refused:
            await rig.sup.lane_work(lane_id, big, MemoryReserve(bytes=2 * GiB))
        assert (refused.value.status, refused.value.code) == (409, "insufficient_vram")
        await rig.sup.cancel("mig")
        with pytest.raises(TokenRefused) as revoked:
            await rig.sup.lane_work(lane_id, big, MemoryReserve(bytes=1))
        assert revoked.value.reason is TokenRefusal.REVOKED
        assert rig.sup.owners[lane_id].used_bytes == 0


# -- execute ------------------------------------------------------------------------------


async def test_execute_runs_the_sim_kernels(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, token = only_lane(await rig.sup.submit(gpu_work("x")))
        noop = await rig.sup.lane_work(lane_id, token, Execute(kernel="noop"))
        assert (noop.op, noop.result) == ("execute", {})
        replies: list[Any] = []

        async def kernel(name: str, args: dict[str, Any]) -> None:
            replies.append(await rig.sup.lane_work(lane_id, token, Execute(kernel=name, args=args)))

        async with trio.open_nursery() as nursery:  # kernels take (modelled) time
            nursery.start_soon(kernel, "sleep", {"seconds": 2})
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(kernel, "matmul", {"n": 1024})
            await trio.testing.wait_all_tasks_blocked()
            assert replies == []
            mock_clock.jump(2)
            await trio.testing.wait_all_tasks_blocked()
            assert len(replies) == 1  # the lane owner serialises: matmul runs after sleep
            mock_clock.jump(1)
        assert replies[0].result == {"seconds": 2.0}
        assert replies[1].result is not None and replies[1].result["flops"] == 2 * 1024**3
        for name, args, code in (
            ("nope", {}, "unknown_kernel"),
            ("sleep", {"seconds": -1}, "bad_kernel_args"),
            ("matmul", {"n": True}, "bad_kernel_args"),
        ):
            with pytest.raises(LaneWorkError) as refused:
                await rig.sup.lane_work(lane_id, token, Execute(kernel=name, args=args))
            assert (refused.value.status, refused.value.code) == (422, code)


async def test_a_cpu_token_executes_but_cannot_reserve_memory(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, token = only_lane(await rig.sup.submit(builtin("c", "sleep", seconds=100)))
        assert lane_id == rig.cpu_lane
        await rig.sup.lane_work(lane_id, token, Execute(kernel="noop"))
        with pytest.raises(TokenRefused) as refused:
            await rig.sup.lane_work(lane_id, token, MemoryReserve(bytes=1))
        assert refused.value.reason is TokenRefusal.OP_NOT_GRANTED


async def test_a_token_for_one_lane_is_refused_on_another(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, token = only_lane(await rig.sup.submit(gpu_work("w")))
        for other in rig.sup.owners:
            if other == lane_id:
                continue
            with pytest.raises(TokenRefused) as refused:
                await rig.sup.lane_work(other, token, Execute(kernel="noop"))
            assert refused.value.reason is TokenRefusal.WRONG_AUDIENCE
        with pytest.raises(LaneWorkError) as unknown:
            await rig.sup.lane_work("lane_0000000000000000", token, Execute(kernel="noop"))
        assert (unknown.value.status, unknown.value.code) == (404, "unknown_lane")
        with pytest.raises(TokenRefused):
            await rig.sup.lane_work(lane_id, token[:-2] + "AA", Execute(kernel="noop"))


async def test_when_the_invocation_ends_its_tokens_are_revoked_and_buffers_freed(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        response = await rig.sup.submit(gpu_work("end"))
        lane_id, token = only_lane(response)
        owner = rig.sup.owners[lane_id]
        for _ in range(3):
            await rig.sup.lane_work(lane_id, token, MemoryReserve(bytes=GiB))
        assert owner.held_by("end") == 3 * GiB
        await rig.sup.cancel("end")
        assert owner.held_by("end") == 0 and owner.used_bytes == 0
        for work in (MemoryReserve(bytes=1), Execute(kernel="noop")):
            with pytest.raises(TokenRefused) as refused:
                await rig.sup.lane_work(lane_id, token, work)
            assert refused.value.reason is TokenRefusal.REVOKED
        rig.assert_released("end", response.tokens)


async def test_one_invocation_fills_only_its_own_share_of_a_lane(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, flooder = only_lane(await rig.sup.submit(gpu_work("flood")))
        lane_b, tenant = only_lane(await rig.sup.submit(gpu_work("tenant")))
        assert lane_b == lane_id  # shared work packs onto one GPU
        busy: list[int] = []
        finished: list[str] = []

        async def work(who: str, token: str) -> None:
            try:
                await rig.sup.lane_work(
                    lane_id, token, Execute(kernel="sleep", args={"seconds": 1})
                )
            except LaneBusy as refused:
                busy.append(refused.status)
                return
            finished.append(who)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(work, "flood", flooder)
            await trio.testing.wait_all_tasks_blocked()  # in the owner's hands
            for _ in range(64):
                nursery.start_soon(work, "flood", flooder)
            await trio.testing.wait_all_tasks_blocked()
            # One in the owner's hands and 8 queued; the rest refused at once.
            assert busy == [429] * 56
            nursery.start_soon(work, "tenant", tenant)
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(10):
                mock_clock.jump(1)
                await trio.testing.wait_all_tasks_blocked()
        # Served in turn: the tenant waited for one of the flood's kernels, not eight.
        assert finished[:3] == ["flood", "flood", "tenant"] and len(finished) == 10
        await rig.sup.lane_work(lane_id, flooder, Execute(kernel="noop"))


async def test_a_token_that_is_no_authority_never_takes_a_place_in_the_queue(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, token = only_lane(await rig.sup.submit(gpu_work("running")))
        _, tenant = only_lane(await rig.sup.submit(gpu_work("tenant")))
        refused: list[TokenRefusal] = []

        async def junk(bad: str) -> None:
            with pytest.raises(TokenRefused) as info:
                await rig.sup.lane_work(lane_id, bad, Execute(kernel="noop"))
            refused.append(info.value.reason)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                rig.sup.lane_work, lane_id, token, Execute(kernel="sleep", args={"seconds": 1})
            )
            await trio.testing.wait_all_tasks_blocked()  # the owner is busy
            started = trio.current_time()
            for _ in range(100):
                nursery.start_soon(junk, "v4.public.junk")
            await trio.testing.wait_all_tasks_blocked()
            # Refused at once, while the owner is still busy: nothing was queued.
            assert trio.current_time() == started
            assert refused == [TokenRefusal.BAD_ENCODING] * 100
            mock_clock.jump(1)
        served = await rig.sup.lane_work(lane_id, tenant, Execute(kernel="noop"))
        assert served.invocation_id == "tenant"


# -- crashes and faults -----------------------------------------------------------------


async def test_a_crashing_executor_restarts_the_owner(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, executor=CrashingExecutor(lambda _: True)) as rig:
        lane_id, token = only_lane(await rig.sup.submit(gpu_work("crash")))
        owner = rig.sup.owners[lane_id]
        with pytest.raises(LaneWorkError) as crashed:
            await rig.sup.lane_work(lane_id, token, Execute(kernel="boom"))
        assert (crashed.value.status, crashed.value.code) == (503, "lane_owner_crashed")
        assert len(owner.restarts) == 1 and not owner.faulted
        reply = await rig.sup.lane_work(lane_id, token, Execute(kernel="noop"))
        assert reply.result == {}
        assert rig.sup.get("crash").state is S.running
        assert rig.machine.ledger.available(lane_id)


async def test_too_many_crashes_fault_the_lane_and_cancel_its_work(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    executor = CrashingExecutor(lambda _: True)
    async with open_rig(tmp_path, executor=executor) as rig:
        response = await rig.sup.submit(gpu_work("victim"))
        lane_id, token = only_lane(response)
        await rig.sup.submit(builtin("bystander", "sleep", seconds=100))
        owner = rig.sup.owners[lane_id]
        for n in range(6):  # five restarts are allowed within the window, the sixth faults
            with pytest.raises(LaneWorkError) as crashed:
                await rig.sup.lane_work(lane_id, token, Execute(kernel="boom"))
            assert crashed.value.code == "lane_owner_crashed"
            assert owner.faulted is (n == 5)
        assert await rig.wait_terminal("victim") is S.cancelled
        assert rig.sup.get("victim").reason == "lane_unhealthy"
        assert not rig.machine.ledger.available(lane_id)
        await trio.testing.wait_all_tasks_blocked()
        assert rig.sup.get("bystander").state is S.running
        lane_events = [e for e in rig.seen if e.lane_id == lane_id]
        assert [e.to_state for e in lane_events] == ["unhealthy"]
        with pytest.raises(LaneWorkError) as refused:
            await rig.sup.lane_work(lane_id, token, Execute(kernel="noop"))
        assert (refused.value.status, refused.value.code) == (503, "lane_unhealthy")
        # New dedicated work cannot land on the faulted lane.
        dedicated = builtin(
            "next", "echo", requirement=Requirement.GPU, isolation=Isolation.DEDICATED, gpus=1
        )
        with pytest.raises(AdmissionRefused) as admission:
            await rig.sup.submit(dedicated)
        assert admission.value.reason == "lane_unhealthy"
        assert len(rig.machine.ledger) == 1  # the bystander only
        await rig.sup.cancel("bystander")
        assert rig.sup.owners[lane_id].used_bytes == 0


async def test_crashes_spread_beyond_the_window_do_not_fault(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, executor=CrashingExecutor(lambda _: True)) as rig:
        lane_id, token = only_lane(await rig.sup.submit(gpu_work("slowcrash")))
        for _ in range(12):
            with pytest.raises(LaneWorkError):
                await rig.sup.lane_work(lane_id, token, Execute(kernel="boom"))
            mock_clock.jump(15)  # four crashes a minute at most
        assert not rig.sup.owners[lane_id].faulted
        assert rig.sup.get("slowcrash").state is S.running


async def test_a_lane_fault_during_execute_is_a_503(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, token = only_lane(await rig.sup.submit(gpu_work("f")))
        rig.machine.ledger.fault_lane(lane_id)
        with pytest.raises(LaneWorkError) as refused:
            await rig.sup.lane_work(lane_id, token, Execute(kernel="noop"))
        assert (refused.value.status, refused.value.code) == (503, "lane_unhealthy")
        rig.machine.ledger.clear_lane_fault(lane_id)


# -- abandoned work and ended invocations ------------------------------------------------


async def test_a_reserve_whose_caller_left_is_never_made(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, token = only_lane(await rig.sup.submit(gpu_work("m", vram=4 * GiB)))
        owner = rig.sup.owners[lane_id]
        gave_up: list[bool] = []

        async def impatient() -> None:
            with trio.move_on_after(0.2) as waited:
                await rig.sup.lane_work(lane_id, token, MemoryReserve(bytes=3 * GiB))
            gave_up.append(waited.cancelled_caught)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                rig.sup.lane_work, lane_id, token, Execute(kernel="sleep", args={"seconds": 1})
            )
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(impatient)  # queued behind the sleeping kernel
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(0.2)
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(1)
        assert gave_up == [True]
        assert owner.held_by("m") == 0  # no buffer whose id nobody received
        again = await rig.sup.lane_work(lane_id, token, MemoryReserve(bytes=4 * GiB))
        assert again.bytes_held == 4 * GiB  # the whole budget is still there


async def test_ending_the_invocation_stops_its_running_lane_work(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, token = only_lane(await rig.sup.submit(gpu_work("m")))
        outcome: list[LaneWorkError] = []

        async def long_kernel() -> None:
            with pytest.raises(LaneWorkError) as stopped:
                await rig.sup.lane_work(
                    lane_id, token, Execute(kernel="sleep", args={"seconds": 30})
                )
            outcome.append(stopped.value)

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_kernel)
            await trio.testing.wait_all_tasks_blocked()
            assert (await rig.sup.cancel("m")).state is S.cancelled
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()  # a kernel still running would hold the test
        # Stopped with its invocation, not left to run its 30 s on a lane now free.
        assert trio.current_time() == started
        assert [(e.status, e.code) for e in outcome] == [(409, "invocation_not_live")]
        await rig.sup.submit(gpu_work("next", isolation=Isolation.DEDICATED))
