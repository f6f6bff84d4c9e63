"""Lane owners through the supervisor: token checks, opaque buffers within budget,
bounded queues, a lane session per invocation, lane faults with bounded intensity, and
faults that reach work."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from capabilities import Isolation as TokenIsolation
from capabilities import LaneOp, TokenRefusal, TokenRefused
from machine.lanes import Isolation, LaneKind
from supervisor.admission import AdmissionRefused
from supervisor.lane_owner import LaneBusy, LaneWorkError
from supervisor.lane_session import CLOSE_SECONDS
from supervisor.lane_work import (
    Download,
    Execute,
    MemoryRelease,
    MemoryReserve,
    Upload,
)
from supervisor.wire import InvocationRequest, InvocationState, SubmitResponse
from tests.lane_doubles import InProcessHost
from tests.supervisor_fixtures import GiB, Rig, builtin, gpu_builtin, only_lane, open_rig

S = InvocationState
BUFFER = r"^buf_[0-9a-f]{32}$"


def gpu_work(invocation_id: str, vram: int = 4 * GiB, **kw: Any) -> InvocationRequest:
    return gpu_builtin(invocation_id, vram_bytes=vram, seconds=1000, **kw)


async def send(rig: Rig, lane_id: str, token: str, work: Any) -> object:
    """Lane work through the supervisor's entry for it: downloads answer with bytes."""
    if isinstance(work, Download):
        return await rig.sup.lane_download(lane_id, token, work)
    return await rig.sup.lane_work(lane_id, token, work)


async def holder_of_a_buffer(rig: Rig) -> tuple[str, SubmitResponse]:
    """Admits GPU work "holder" and reserves a 4 KiB buffer for it in its lane's host;
    returns that lane and the admission."""
    response = await rig.sup.submit(gpu_work("holder"))
    lane_id, holder = only_lane(response)
    await rig.sup.lane_work(lane_id, holder, MemoryReserve(dtype="float32", shape=[1024]))
    return lane_id, response


# -- memory -------------------------------------------------------------------------------


async def test_memory_reserve_gives_opaque_ids_within_the_token_budget(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, token = only_lane(await rig.sup.submit(gpu_work("m", vram=4 * GiB)))
        owner = rig.sup.owners[lane_id]
        first = await rig.sup.lane_work(
            lane_id, token, MemoryReserve(dtype="uint8", shape=[3 * GiB])
        )
        assert first.buffer_id is not None
        assert re.fullmatch(BUFFER, first.buffer_id)
        assert (first.bytes_held, first.invocation_id, first.op) == (3 * GiB, "m", "memory_reserve")
        assert owner.held_by("m") == 3 * GiB
        with pytest.raises(TokenRefused) as refused:
            await rig.sup.lane_work(lane_id, token, MemoryReserve(dtype="uint8", shape=[GiB + 1]))
        assert refused.value.reason is TokenRefusal.VRAM_OVER_BUDGET
        assert owner.held_by("m") == 3 * GiB
        second = await rig.sup.lane_work(lane_id, token, MemoryReserve(dtype="uint8", shape=[GiB]))
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
        theirs = await rig.sup.lane_work(lane_a, token_a, MemoryReserve(dtype="uint8", shape=[GiB]))
        assert theirs.buffer_id is not None
        with pytest.raises(LaneWorkError) as refused:
            await rig.sup.lane_work(lane_b, token_b, MemoryRelease(buffer_id=theirs.buffer_id))
        assert (refused.value.status, refused.value.code) == (404, "buffer_not_found")
        assert rig.sup.owners[lane_a].held_by("a") == GiB


async def test_the_lane_refuses_more_than_its_free_vram(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        request = gpu_builtin("mig", isolation=Isolation.PARTITIONED, seconds=100)
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
        await rig.sup.lane_work(
            lane_id, big, MemoryReserve(dtype="uint8", shape=[lane.vram_bytes - GiB])
        )
        with pytest.raises(LaneWorkError) as refused:
            await rig.sup.lane_work(lane_id, big, MemoryReserve(dtype="uint8", shape=[2 * GiB]))
        assert (refused.value.status, refused.value.code) == (409, "insufficient_vram")
        await rig.sup.cancel("mig")
        with pytest.raises(TokenRefused) as revoked:
            await rig.sup.lane_work(lane_id, big, MemoryReserve(dtype="uint8", shape=[1]))
        assert revoked.value.reason is TokenRefusal.REVOKED
        assert rig.sup.owners[lane_id].used_bytes == 0


# -- execute ------------------------------------------------------------------------------


async def test_execute_runs_real_kernels_on_the_invocations_buffers(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, token = only_lane(await rig.sup.submit(gpu_work("x")))
        noop = await rig.sup.lane_work(lane_id, token, Execute(kernel="noop"))
        assert (noop.op, noop.result) == ("execute", {})
        rng = np.random.default_rng(7)
        a = rng.standard_normal((3, 4), dtype=np.float32)
        b = rng.standard_normal((4, 2), dtype=np.float32)
        ids = {}
        for name, shape in (("a", [3, 4]), ("b", [4, 2]), ("out", [3, 2])):
            reply = await rig.sup.lane_work(
                lane_id, token, MemoryReserve(dtype="float32", shape=shape)
            )
            assert reply.buffer_id is not None
            ids[name] = reply.buffer_id
        for name, array in (("a", a), ("b", b)):
            await rig.sup.lane_work(
                lane_id, token, Upload(buffer_id=ids[name], offset=0, data=array.tobytes())
            )
        await rig.sup.lane_work(lane_id, token, Execute(kernel="matmul", buffers=ids))
        got = await rig.sup.lane_download(
            lane_id, token, Download(buffer_id=ids["out"], offset=0, length=3 * 2 * 4)
        )
        np.testing.assert_allclose(np.frombuffer(got, np.float32).reshape(3, 2), a @ b, rtol=1e-5)
        replies: list[Any] = []

        async def kernel(name: str, args: dict[str, Any]) -> None:
            replies.append(await rig.sup.lane_work(lane_id, token, Execute(kernel=name, args=args)))

        async with trio.open_nursery() as nursery:  # the lane owner serialises work
            nursery.start_soon(kernel, "sleep", {"seconds": 2})
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(kernel, "noop", {})
            await trio.testing.wait_all_tasks_blocked()
            assert replies == []
            mock_clock.jump(2)
        assert [r.result for r in replies] == [{"seconds": 2}, {}]
        for name, work, code in (
            ("nope", Execute(kernel="nope"), "unknown_kernel"),
            ("args", Execute(kernel="fill", args={"value": 1.0}), "bad_args"),
            (
                "shape",
                Execute(kernel="matmul", buffers={"a": ids["a"], "b": ids["a"], "out": ids["out"]}),
                "shape_mismatch",
            ),
        ):
            with pytest.raises(LaneWorkError) as refused:
                await rig.sup.lane_work(lane_id, token, work)
            assert (refused.value.status, refused.value.code) == (422, code), name


async def test_buffers_bound_uploads_and_downloads(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, token = only_lane(await rig.sup.submit(gpu_work("u")))
        reply = await rig.sup.lane_work(lane_id, token, MemoryReserve(dtype="uint8", shape=[8]))
        assert reply.buffer_id is not None
        buf = reply.buffer_id
        await rig.sup.lane_work(lane_id, token, Upload(buffer_id=buf, offset=6, data=b"xy"))
        for work in (
            Upload(buffer_id=buf, offset=7, data=b"xy"),
            Download(buffer_id=buf, offset=4, length=5),
        ):
            with pytest.raises(LaneWorkError) as refused:
                await send(rig, lane_id, token, work)
            assert (refused.value.status, refused.value.code) == (416, "out_of_range")
        got = await rig.sup.lane_download(
            lane_id, token, Download(buffer_id=buf, offset=0, length=8)
        )
        assert got == bytes(6) + b"xy"  # a refused write changed nothing


async def test_a_cpu_token_executes_but_cannot_reserve_memory(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, token = only_lane(await rig.sup.submit(builtin("c", "sleep", seconds=100)))
        assert lane_id == rig.cpu_lane
        await rig.sup.lane_work(lane_id, token, Execute(kernel="noop"))
        with pytest.raises(TokenRefused) as refused:
            await rig.sup.lane_work(lane_id, token, MemoryReserve(dtype="uint8", shape=[1]))
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
            await rig.sup.lane_work(lane_id, token, MemoryReserve(dtype="uint8", shape=[GiB]))
        assert owner.held_by("end") == 3 * GiB
        await rig.sup.cancel("end")
        assert owner.held_by("end") == 0 and owner.used_bytes == 0
        for work in (MemoryReserve(dtype="uint8", shape=[1]), Execute(kernel="noop")):
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
        finished: list[tuple[str, float]] = []
        started = trio.current_time()

        async def work(who: str, token: str) -> None:
            try:
                await rig.sup.lane_work(
                    lane_id, token, Execute(kernel="sleep", args={"seconds": 1})
                )
            except LaneBusy as refused:
                busy.append(refused.status)
                return
            finished.append((who, trio.current_time() - started))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(work, "flood", flooder)
            await trio.testing.wait_all_tasks_blocked()  # running in its session
            for _ in range(64):
                nursery.start_soon(work, "flood", flooder)
            await trio.testing.wait_all_tasks_blocked()
            # One running and 8 queued in the flood's own session; the rest refused at once.
            assert busy == [429] * 56
            nursery.start_soon(work, "tenant", tenant)
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(10):
                mock_clock.jump(1)
                await trio.testing.wait_all_tasks_blocked()
        # The tenant's kernel ran in its own session beside the flood's first one: it
        # waited for none of the flood's kernels.
        assert ("tenant", 1) in finished and len(finished) == 10
        assert [t for who, t in finished if who == "flood"] == list(range(1, 10))
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


async def test_a_kernel_that_crashes_its_session_ends_its_invocation_alone(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """Code that faults while it runs an invocation's work takes down that invocation's
    lane session, not the lane: its neighbour's buffer and work go on."""
    async with open_rig(tmp_path) as rig:
        lane_id, _ = await holder_of_a_buffer(rig)
        _, token = only_lane(await rig.sup.submit(gpu_work("crash")))
        owner = rig.sup.owners[lane_id]
        with pytest.raises(LaneWorkError) as crashed:
            await rig.sup.lane_work(lane_id, token, Execute(kernel="boom"))
        assert (crashed.value.status, crashed.value.code) == (503, "lane_session_failed")
        assert await rig.wait_terminal("crash") is S.cancelled
        assert rig.sup.get("crash").reason == "lane_session_failed"
        assert not owner.restarts and not owner.faulted and owner.host_starts == 1
        assert rig.sup.get("holder").state is S.running and owner.held_by("holder") == 4096
        assert rig.machine.ledger.available(lane_id)


async def test_six_tenants_crashing_their_own_sessions_never_fault_the_lane(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """The report: six crashes in a minute by one tenant took the lane out of service
    for everyone. A session's crash is its invocation's, never the lane's."""
    async with open_rig(tmp_path) as rig:
        lane_id, _ = await holder_of_a_buffer(rig)
        owner = rig.sup.owners[lane_id]
        for n in range(6):
            _, token = only_lane(await rig.sup.submit(gpu_work(f"hostile-{n}")))
            with pytest.raises(LaneWorkError) as crashed:
                await rig.sup.lane_work(lane_id, token, Execute(kernel="crash"))
            assert crashed.value.code == "lane_session_failed"
            assert await rig.wait_terminal(f"hostile-{n}") is S.cancelled
        assert not owner.faulted and not owner.restarts and owner.host_status == "ready"
        assert rig.sup.get("holder").state is S.running and owner.held_by("holder") == 4096
        assert rig.machine.ledger.available(lane_id) and "unhealthy" not in rig.lane_events(lane_id)


async def test_too_many_lane_host_failures_fault_the_lane_and_cancel_its_work(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        response = await rig.sup.submit(gpu_work("victim"))
        lane_id, token = only_lane(response)
        await rig.sup.submit(builtin("bystander", "sleep", seconds=100))
        owner = rig.sup.owners[lane_id]
        await rig.sup.lane_work(lane_id, token, Execute(kernel="noop"))  # it has a session
        for n in range(6):  # five restarts are allowed within the window, the sixth faults
            sentinel = owner.sentinel
            assert isinstance(sentinel, InProcessHost)
            sentinel.die()
            await trio.testing.wait_all_tasks_blocked()
            assert owner.faulted is (n == 5)
        assert await rig.wait_terminal("victim") is S.cancelled
        assert rig.sup.get("victim").reason == "lane_unhealthy"
        assert not rig.machine.ledger.available(lane_id) and not owner.sessions
        await trio.testing.wait_all_tasks_blocked()
        assert rig.sup.get("bystander").state is S.running
        assert rig.lane_events(lane_id) == ["unhealthy"]
        with pytest.raises(LaneWorkError) as refused:
            await rig.sup.lane_work(lane_id, token, Execute(kernel="noop"))
        assert (refused.value.status, refused.value.code) == (503, "lane_unhealthy")
        # New dedicated work cannot land on the faulted lane.
        dedicated = gpu_builtin("next", "echo", isolation=Isolation.DEDICATED)
        with pytest.raises(AdmissionRefused) as admission:
            await rig.sup.submit(dedicated)
        assert admission.value.reason == "lane_unhealthy"
        assert len(rig.machine.ledger) == 1  # the bystander only
        await rig.sup.cancel("bystander")
        assert rig.sup.owners[lane_id].used_bytes == 0


async def test_a_faulted_cpu_lane_host_refuses_its_lane_work_but_not_the_cpu_pool(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """Processes and builtins on the CPU pool never use its lane hosts: a lane whose
    host fails too often takes out the kernels it serves, not the pool's other work."""
    async with open_rig(tmp_path) as rig:
        lane_id, token = only_lane(await rig.sup.submit(builtin("kernels", seconds=1000)))
        assert rig.machine.ledger.lane(lane_id).kind is LaneKind.CPU  # type: ignore[union-attr]
        await rig.sup.submit(builtin("bystander", seconds=1000))
        await rig.fault_lane(lane_id)
        # Fail closed for what the hosts serve: lane work is refused with its reason...
        with pytest.raises(LaneWorkError) as refused:
            await rig.sup.lane_work(lane_id, token, Execute(kernel="noop"))
        assert (refused.value.status, refused.value.code) == (503, "lane_unhealthy")
        assert rig.sup.faulted_lanes() == f"lane hosts failed too often: {lane_id}"
        # ...while the pool's running work goes on and new work is still admitted.
        await trio.testing.wait_all_tasks_blocked()
        for invocation_id in ("kernels", "bystander"):
            assert rig.sup.get(invocation_id).state is S.running
            assert rig.sup.get(invocation_id).reason is None
        assert rig.machine.ledger.available(lane_id)
        await rig.sup.submit(builtin("echo", "echo", text="hi"))
        assert await rig.wait_terminal("echo") is S.succeeded
        for invocation_id in ("kernels", "bystander"):
            await rig.sup.cancel(invocation_id)


async def test_host_failures_spread_beyond_the_window_do_not_fault(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, _ = only_lane(await rig.sup.submit(gpu_work("slowcrash")))
        owner = rig.sup.owners[lane_id]
        for _ in range(12):
            sentinel = owner.sentinel
            assert isinstance(sentinel, InProcessHost)
            sentinel.die()
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(15)  # four failures a minute at most
            await trio.testing.wait_all_tasks_blocked()
        assert not owner.faulted and owner.host_starts == 13
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
                await rig.sup.lane_work(
                    lane_id, token, MemoryReserve(dtype="uint8", shape=[3 * GiB])
                )
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
        again = await rig.sup.lane_work(
            lane_id, token, MemoryReserve(dtype="uint8", shape=[4 * GiB])
        )
        assert again.bytes_held == 4 * GiB  # the whole budget is still there


async def test_ending_the_invocation_ends_its_session_and_its_running_kernel_at_once(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """The invocation's kernel runs in its own session: ending the invocation ends that
    session at once, and no other tenant's buffers are in it to lose."""
    async with open_rig(tmp_path) as rig:
        hosts = rig.in_process_hosts
        lane_id, _ = await holder_of_a_buffer(rig)
        _, token = only_lane(await rig.sup.submit(gpu_work("m")))
        await rig.sup.lane_work(lane_id, token, MemoryReserve(dtype="uint8", shape=[GiB]))
        refused: list[str] = []

        async def long_kernel() -> None:
            with pytest.raises(LaneWorkError) as ended_under_it:
                await rig.sup.lane_work(
                    lane_id, token, Execute(kernel="sleep", args={"seconds": 3})
                )
            refused.append(ended_under_it.value.code)

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_kernel)
            await trio.testing.wait_all_tasks_blocked()
            ended = await rig.sup.cancel("m")
        assert trio.current_time() == started  # the kernel's 3 s were not waited for
        assert ended.state is S.cancelled and refused == ["lane_session_failed"]
        owner = rig.sup.owners[lane_id]
        assert owner.used_bytes == 4096 and hosts.used(lane_id) == 4096  # the holder's
        assert owner.held_by("holder") == 4096 and rig.sup.get("holder").state is S.running
        assert owner.host_starts == 1 and "m" not in owner.sessions


async def test_a_crashed_session_ends_only_its_own_invocation(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        hosts = rig.in_process_hosts
        lane_id, holder = await holder_of_a_buffer(rig)
        response = await rig.sup.submit(gpu_work("crasher"))
        _, crasher = only_lane(response)
        with pytest.raises(LaneWorkError) as failed:
            await rig.sup.lane_work(lane_id, crasher, Execute(kernel="crash"))
        assert (failed.value.status, failed.value.code) == (503, "lane_session_failed")
        assert await rig.wait_terminal("crasher") is S.cancelled
        assert rig.sup.get("crasher").reason == "lane_session_failed"
        owner = rig.sup.owners[lane_id]
        assert owner.held_by("holder") == 4096 and hosts.used(lane_id) == 4096
        assert owner.host_starts == 1 and not owner.restarts
        # The neighbour's session serves on, its buffer intact.
        assert rig.sup.get("holder").state is S.running
        _, token = only_lane(holder)
        assert (await rig.sup.lane_work(lane_id, token, Execute(kernel="noop"))).result == {}
        await rig.sup.cancel("holder")
        rig.assert_released("crasher", response.tokens)


async def test_a_session_host_that_dies_idle_ends_its_invocation_at_once(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, response = await holder_of_a_buffer(rig)
        owner = rig.sup.owners[lane_id]
        assert owner.used_bytes == 4096 and rig.sup.lane_hosts_problem() is None
        host = owner.sessions["holder"].host
        assert isinstance(host, InProcessHost)
        host.die()  # its process exits; nobody asks the lane anything
        assert await rig.wait_terminal("holder") is S.cancelled
        assert trio.current_time() == 0  # not at the next heartbeat: at once
        assert rig.sup.get("holder").reason == "lane_session_failed"
        assert owner.used_bytes == 0 and owner.host_starts == 1 and not owner.restarts
        assert owner.host_status == "ready" and rig.sup.lane_hosts_problem() is None
        rig.assert_released("holder", response.tokens)


async def test_hosts_dying_idle_count_against_the_restart_limit(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        hosts = rig.in_process_hosts
        lane_id, _ = only_lane(await rig.sup.submit(gpu_work("g")))
        owner = rig.sup.owners[lane_id]
        for _ in range(6):  # the default limit: more than 5 restarts within the window
            hosts.current(lane_id).die()
            await trio.testing.wait_all_tasks_blocked()
        assert owner.faulted and owner.host_starts == 6 and owner.host_status == "faulted"
        assert rig.sup.lane_hosts_problem() is None  # out of service, not on its way back
        assert rig.sup.faulted_lanes() == f"lane hosts failed too often: {lane_id}"


async def test_another_invocations_buffer_cannot_be_used_in_any_way(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, owner_token = only_lane(await rig.sup.submit(gpu_work("a")))
        _, other = only_lane(await rig.sup.submit(gpu_work("b")))
        reply = await rig.sup.lane_work(
            lane_id, owner_token, MemoryReserve(dtype="float32", shape=[4])
        )
        assert reply.buffer_id is not None
        theirs = reply.buffer_id
        await rig.sup.lane_work(
            lane_id, owner_token, Upload(buffer_id=theirs, offset=0, data=b"\x01" * 16)
        )
        attempts: list[Any] = [
            Upload(buffer_id=theirs, offset=0, data=b"\x00" * 16),
            Execute(kernel="fill", args={"value": 0.0}, buffers={"out": theirs}),
            Download(buffer_id=theirs, offset=0, length=16),
        ]
        for work in attempts:
            with pytest.raises(LaneWorkError) as refused:
                await send(rig, lane_id, other, work)
            assert (refused.value.status, refused.value.code) == (404, "buffer_not_found")
        mine = await rig.sup.lane_download(
            lane_id, owner_token, Download(buffer_id=theirs, offset=0, length=16)
        )
        assert mine == b"\x01" * 16  # untouched


async def test_a_deadline_ending_frees_the_host_memory(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        hosts = rig.in_process_hosts
        lane_id, token = only_lane(await rig.sup.submit(gpu_work("late", vram=GiB, timeout_s=5)))
        await rig.sup.lane_work(lane_id, token, MemoryReserve(dtype="float16", shape=[1024, 8]))
        assert hosts.used(lane_id) == 1024 * 8 * 2
        mock_clock.jump(5)
        assert await rig.wait_terminal("late") is S.timed_out
        assert hosts.used(lane_id) == 0 and rig.sup.owners[lane_id].free_bytes == (
            rig.machine.ledger.lane(lane_id).vram_bytes  # type: ignore[union-attr]
        )


async def test_a_second_ending_of_an_invocation_waits_for_its_session_to_be_gone(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """Two cleanups of one invocation (a lane fault and its own ending, say): neither
    returns, and the lane still counts it as held, until its host is gone."""
    async with open_rig(tmp_path) as rig:
        lane_id, _ = await holder_of_a_buffer(rig)
        owner = rig.sup.owners[lane_id]
        host = owner.sessions["holder"].host
        assert isinstance(host, InProcessHost)
        host.close_gate = gate = trio.Event()
        returned: list[int] = []

        async def free() -> None:
            returned.append(await owner.free_invocation("holder"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(free)
            nursery.start_soon(free)
            await trio.testing.wait_all_tasks_blocked()
            try:
                assert returned == [] and owner.holds("holder")
            finally:
                gate.set()  # (so that a failure here still tears down)
        assert returned == [4096, 4096] and host.closed and not owner.holds("holder")
        await rig.sup.cancel("holder")


async def test_a_lane_fault_ends_its_sessions_together_within_a_bound(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """Session hosts that will not die do not hold the faulting owner for long: they end
    side by side, and the owner waits CLOSE_SECONDS at most for all of them."""
    async with open_rig(tmp_path) as rig:
        lane_id, _ = await holder_of_a_buffer(rig)
        _, other = only_lane(await rig.sup.submit(gpu_work("other")))
        await rig.sup.lane_work(lane_id, other, Execute(kernel="noop"))
        owner = rig.sup.owners[lane_id]
        stuck = [owner.sessions[i].host for i in ("holder", "other")]
        gates = []
        for host in stuck:
            assert isinstance(host, InProcessHost)
            host.close_gate = trio.Event()  # not set while the owner faults
            gates.append(host.close_gate)
        started = trio.current_time()
        try:
            await rig.fault_lane(lane_id)
            for _ in range(int(CLOSE_SECONDS) + 1):
                if owner.next_probe_at is not None:  # the owner got past ending them
                    break
                mock_clock.jump(1)
                await trio.testing.wait_all_tasks_blocked()
            assert owner.next_probe_at is not None, "the sessions' ending held the owner"
            assert trio.current_time() - started <= CLOSE_SECONDS + 1
            assert not owner.sessions and owner.used_bytes == 0
        finally:
            for gate in gates:
                gate.set()  # (so that a failure here still tears down)
