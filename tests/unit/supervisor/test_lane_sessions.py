"""A lane session per invocation: one tenant's slow or overrunning kernels on a shared
lane neither delay nor end another tenant's work there."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from supervisor.lane_host import lane_host_factory
from supervisor.lane_owner import LaneWorkError
from supervisor.lane_work import Download, Execute, MemoryReserve, Upload
from supervisor.wire import InvocationRequest, InvocationState
from tests.supervisor_fixtures import GiB, Rig, gpu_builtin, only_lane, open_rig

S = InvocationState


def gpu_work(invocation_id: str, **kw: Any) -> InvocationRequest:
    return gpu_builtin(invocation_id, vram_bytes=4 * GiB, seconds=1000, **kw)


async def test_a_tenants_noop_is_served_at_once_while_another_runs_slow_kernels(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """The report: a tenant's slow kernel held every other tenant's request behind it.
    Here the noisy tenant keeps its session full of 10 s kernels; the quiet one's
    `noop` waits for none of them."""
    async with open_rig(tmp_path) as rig:
        lane_id, noisy = only_lane(await rig.sup.submit(gpu_work("noisy")))
        lane_b, quiet = only_lane(await rig.sup.submit(gpu_work("quiet")))
        assert lane_b == lane_id
        slow = Execute(kernel="sleep", args={"seconds": 10})
        # Whatever the outcome, the clock runs again for the teardown.
        with contextlib.ExitStack() as on_exit:
            on_exit.callback(setattr, mock_clock, "autojump_threshold", 0)
            await _noisy_and_quiet(rig, lane_id, noisy, quiet, slow)
        await rig.sup.cancel("noisy")
        await rig.sup.cancel("quiet")


async def _noisy_and_quiet(rig: Rig, lane_id: str, noisy: str, quiet: str, slow: Execute) -> None:
    """The noisy tenant's session full of slow kernels, then the quiet one's 20 noops."""
    async with trio.open_nursery() as nursery:
        for _ in range(8):  # the noisy session's queue is full
            nursery.start_soon(rig.sup.lane_work, lane_id, noisy, slow)
        await trio.testing.wait_all_tasks_blocked()
        started = trio.current_time()
        served: list[str] = []

        async def quiet_noops() -> None:
            for _ in range(20):
                reply = await rig.sup.lane_work(lane_id, quiet, Execute(kernel="noop"))
                served.append(reply.invocation_id)

        nursery.start_soon(quiet_noops)
        await trio.testing.wait_all_tasks_blocked()  # the clock stands still meanwhile
        assert served == ["quiet"] * 20  # not one kernel slice of waiting
        assert trio.current_time() == started
        nursery.cancel_scope.cancel()


async def test_a_kernel_past_the_deadline_ends_its_invocation_and_the_neighbour_keeps_its_buffer(
    tmp_path: Path,
) -> None:
    """The report: one legal, slow kernel (a float16 matmul, which NumPy runs without
    BLAS) held the shared host past its deadline; the host was killed and the tenant
    holding a buffer beside it was cancelled. Real hosts, a short deadline of the
    slow tenant's own asking."""
    hosts = lane_host_factory(backend="numpy")
    async with open_rig(tmp_path, lane_hosts=hosts) as rig:
        lane_id, slow = only_lane(await rig.sup.submit(gpu_work("slow")))
        _, holder = only_lane(await rig.sup.submit(gpu_work("holder")))
        kept = await rig.sup.lane_work(lane_id, holder, MemoryReserve(dtype="uint8", shape=[8]))
        assert kept.buffer_id is not None
        data = bytes(range(8))
        await rig.sup.lane_work(
            lane_id, holder, Upload(buffer_id=kept.buffer_id, offset=0, data=data)
        )
        matrices = {}
        for name in ("a", "b", "out"):
            reply = await rig.sup.lane_work(
                lane_id, slow, MemoryReserve(dtype="float16", shape=[1024, 1024])
            )
            assert reply.buffer_id is not None
            matrices[name] = reply.buffer_id
        with pytest.raises(LaneWorkError) as overran:
            matmul = Execute(kernel="matmul", buffers=matrices, timeout_s=0.3)
            await rig.sup.lane_work(lane_id, slow, matmul)
        assert (overran.value.status, overran.value.code) == (503, "kernel_timeout")
        assert await rig.wait_terminal("slow") is S.cancelled
        assert rig.sup.get("slow").reason == "kernel_timeout"
        owner = rig.sup.owners[lane_id]
        assert rig.sup.get("holder").state is S.running and owner.held_by("holder") == 8
        assert owner.held_by("slow") == 0 and not owner.restarts and owner.host_starts == 1
        mine = await rig.sup.lane_download(
            lane_id, holder, Download(buffer_id=kept.buffer_id, offset=0, length=8)
        )
        assert mine == data
        await rig.sup.cancel("holder")


async def test_each_kernels_deadline_is_its_own_requests_capped_by_the_node(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """The deadline was the lane's (30 s for everyone). Now a request names its own,
    at most --max-kernel-seconds, which is also the deadline of one that names none:
    a tenant's 1 s deadline ends only its own invocation, while a neighbour's 3 s
    kernel with a 5 s deadline runs to its end beside it."""
    async with open_rig(tmp_path, max_kernel_seconds=10.0) as rig:
        lane_id, hasty = only_lane(await rig.sup.submit(gpu_work("hasty")))
        _, patient = only_lane(await rig.sup.submit(gpu_work("patient")))
        results: dict[str, object] = {}

        async def ask(name: str, token: str, work: Execute) -> None:
            try:
                results[name] = (await rig.sup.lane_work(lane_id, token, work)).result
            except LaneWorkError as exc:
                results[name] = exc.code

        sleep = {"seconds": 3}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                ask, "hasty", hasty, Execute(kernel="sleep", args=sleep, timeout_s=1)
            )
            nursery.start_soon(
                ask, "patient", patient, Execute(kernel="sleep", args=sleep, timeout_s=5)
            )
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(1.5)  # past the hasty one's deadline, within the other's
            assert await rig.wait_terminal("hasty") is S.cancelled
            assert results == {"hasty": "kernel_timeout"}
            mock_clock.jump(2)  # the patient one's kernel is done
        assert results == {"hasty": "kernel_timeout", "patient": {"seconds": 3}}
        assert rig.sup.get("hasty").reason == "kernel_timeout"
        assert rig.sup.get("patient").state is S.running
        await rig.sup.lane_work(lane_id, patient, Execute(kernel="noop"))
        hosts = rig.in_process_hosts
        assert sorted(host.deadlines for host in hosts.made[lane_id][1:]) == [[1], [5, 10.0]]
        await rig.sup.cancel("patient")


async def test_a_deadline_above_the_nodes_cap_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    async with open_rig(tmp_path, max_kernel_seconds=10.0) as rig:
        lane_id, token = only_lane(await rig.sup.submit(gpu_work("greedy")))
        kept = await rig.sup.lane_work(lane_id, token, MemoryReserve(dtype="uint8", shape=[8]))
        with pytest.raises(LaneWorkError) as refused:
            await rig.sup.lane_work(lane_id, token, Execute(kernel="noop", timeout_s=10.5))
        assert (refused.value.status, refused.value.code) == (422, "bad_args")
        assert "max-kernel-seconds" in str(refused.value)
        owner = rig.sup.owners[lane_id]
        assert rig.sup.get("greedy").state is S.running and owner.held_by("greedy") == 8
        assert kept.buffer_id is not None
        await rig.sup.lane_work(lane_id, token, Execute(kernel="noop", timeout_s=10))
        await rig.sup.cancel("greedy")


async def test_a_session_host_that_fails_to_start_backs_off_for_its_invocation_only(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """A host of its own that cannot start (its cgroup too small for it, say) was
    spawned again for every request. Now its invocation waits 1 s, then 2 s, before
    the next is tried, and a neighbour's session starts meanwhile."""
    async with open_rig(tmp_path) as rig:
        lane_id, token = only_lane(await rig.sup.submit(gpu_work("unlucky")))
        _, neighbour = only_lane(await rig.sup.submit(gpu_work("neighbour")))
        hosts = rig.in_process_hosts
        made = len(hosts.made[lane_id])
        noop = Execute(kernel="noop")

        async def refused() -> str:
            with pytest.raises(LaneWorkError) as caught:
                await rig.sup.lane_work(lane_id, token, noop)
            assert caught.value.status == 503
            return str(caught.value)

        hosts.refuse_starts = True
        await refused()  # its host failed to start
        assert "retry in 1.0 s" in await refused()  # no host was even made for it
        assert len(hosts.made[lane_id]) == made + 1
        mock_clock.jump(1.01)
        await refused()  # the second start failed: now 2 s
        assert "retry in 2.0 s" in await refused()
        assert len(hosts.made[lane_id]) == made + 2
        hosts.refuse_starts = False
        assert (await rig.sup.lane_work(lane_id, neighbour, noop)).result == {}
        mock_clock.jump(2.01)
        assert (await rig.sup.lane_work(lane_id, token, noop)).result == {}
        assert rig.sup.get("unlucky").state is S.running
        await rig.sup.cancel("unlucky")
        await rig.sup.cancel("neighbour")
        assert not rig.sup.owners[lane_id]._start_backoff  # kept no longer than its invocation
