"""Lanes recover: a lane whose host failed too often is probed with backoff and
comes back by itself; while out, its snapshot health says so and why (the CPU
pool's too), and events tell when it leaves and returns. A host that stops
answering while idle is found by the owner's heartbeat and replaced."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from machine.lanes import Isolation
from supervisor.lane_host import LaneHost, lane_host_factory
from supervisor.lane_owner import LaneWorkError
from supervisor.lane_work import Execute, MemoryReserve
from supervisor.wire import InvocationRequest, InvocationState
from tests.lane_doubles import InProcessHost
from tests.lanehost_fixtures import process_gone, wait_gone
from tests.supervisor_fixtures import GiB, Rig, builtin, gpu_builtin, only_lane, open_rig

S = InvocationState


def gpu_work(invocation_id: str, **kw: Any) -> InvocationRequest:
    return gpu_builtin(invocation_id, vram_bytes=4 * GiB, seconds=1000, **kw)


def lane_view(rig: Rig, lane_id: str) -> dict[str, Any]:
    """The lane as the snapshot a scheduler reads shows it (JSON values)."""
    snapshot = msgspec.to_builtins(rig.machine.snapshot())
    lane: dict[str, Any] = next(item for item in snapshot["lanes"] if item["lane_id"] == lane_id)
    return lane


async def settle(mock_clock: trio.testing.MockClock, seconds: float) -> None:
    mock_clock.jump(seconds)
    await trio.testing.wait_all_tasks_blocked()


async def assert_back_in_service(rig: Rig, lane_id: str, token: str) -> None:
    """Healthy again in the snapshot and in /readyz, both changes announced, and the
    lane serves its work."""
    owner = rig.sup.owners[lane_id]
    assert not owner.faulted and owner.host_status == "ready"
    back = lane_view(rig, lane_id)
    assert (back["health"], back.get("health_reason")) == ("healthy", None)
    assert rig.sup.faulted_lanes() is None and rig.sup.lane_hosts_problem() is None
    assert rig.lane_events(lane_id) == ["unhealthy", "healthy"]
    assert (await rig.sup.lane_work(lane_id, token, Execute(kernel="noop"))).result == {}


# -- (a) a faulted lane comes back ---------------------------------------------------------


async def test_a_faulted_lane_comes_back_by_itself_once_its_host_starts_again(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        hosts = rig.in_process_hosts
        lane_id, _ = only_lane(await rig.sup.submit(gpu_work("victim")))
        assert lane_id == rig.gpu_lane
        hosts.refuse_starts = True  # the first probe will fail as well
        owner = await rig.fault_lane(lane_id)
        assert await rig.wait_terminal("victim") is S.cancelled
        assert rig.sup.get("victim").reason == "lane_unhealthy"
        # Out of service: the snapshot says so and why, the readiness note names it.
        out = lane_view(rig, lane_id)
        assert out["health"] == "unhealthy"
        assert "failed too often" in out["health_reason"]
        assert not rig.machine.ledger.available(lane_id)
        assert rig.sup.faulted_lanes() == f"lane hosts failed too often: {lane_id}"
        assert rig.lane_events(lane_id) == ["unhealthy"]
        with pytest.raises(LaneWorkError) as refused:
            await rig.sup.lane_work(lane_id, "v4.public.junk", Execute(kernel="noop"))
        assert refused.value.code == "lane_unhealthy"
        # The first probe, after 1 s, fails: still out, and the next one waits 2 s.
        starts = owner.host_starts
        await settle(mock_clock, 1)
        assert owner.host_starts == starts + 1 and owner.faulted
        assert lane_view(rig, lane_id)["health"] == "unhealthy"
        hosts.refuse_starts = False
        await settle(mock_clock, 1.5)
        assert owner.host_starts == starts + 1 and owner.faulted
        await settle(mock_clock, 0.5)
        # The probe's hello answered: back in service, with a fresh restart window.
        assert owner.host_starts == starts + 2 and not owner.faulted
        assert owner.host_status == "ready" and len(owner.restarts) == 0
        assert rig.machine.ledger.available(lane_id)
        # Lane work succeeds again, for new work the lane takes again (a whole GPU).
        response = await rig.sup.submit(gpu_work("after", isolation=Isolation.DEDICATED))
        again, token = only_lane(response)
        assert again == lane_id
        await assert_back_in_service(rig, lane_id, token)
        reserved = await rig.sup.lane_work(lane_id, token, MemoryReserve(dtype="uint8", shape=[64]))
        assert reserved.bytes_held == 64
        await rig.sup.cancel("after")


async def test_failed_probes_back_off_doubling_to_a_cap(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        hosts = rig.in_process_hosts
        lane_id = rig.gpu_lane
        owner = rig.sup.owners[lane_id]
        hosts.refuse_starts = True  # every restart fails at once: the lane faults now
        hosts.current(lane_id).die()
        await trio.testing.wait_all_tasks_blocked()
        assert owner.faulted
        faulted_at, made = trio.current_time(), len(hosts.made_at[lane_id])
        for _ in range(400):  # 200 s
            await settle(mock_clock, 0.5)
        probes = hosts.made_at[lane_id][made:]
        waits = [b - a for a, b in zip([faulted_at, *probes], probes, strict=False)]
        assert waits == [1, 2, 4, 8, 16, 32, 60, 60]
        assert owner.faulted and lane_view(rig, lane_id)["health"] == "unhealthy"
        hosts.refuse_starts = False
        for _ in range(120):
            await settle(mock_clock, 0.5)
        assert not owner.faulted and rig.machine.ledger.available(lane_id)


async def test_a_lane_that_faults_again_soon_after_coming_back_waits_longer(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id = rig.gpu_lane
        owner = await rig.fault_lane(lane_id)
        await settle(mock_clock, 1)
        assert not owner.faulted  # the first probe (after 1 s) succeeded
        await rig.fault_lane(lane_id)  # within the minute: it flaps
        await settle(mock_clock, 1)
        assert owner.faulted
        await settle(mock_clock, 1)
        assert not owner.faulted  # after 2 s this time
        await settle(mock_clock, 61)  # a minute in service: the next fault starts over
        await rig.fault_lane(lane_id)
        await settle(mock_clock, 1)
        assert not owner.faulted
        assert rig.lane_events(lane_id) == ["unhealthy", "healthy"] * 3


# -- (b) the CPU pool's lane ---------------------------------------------------------------


async def test_a_faulted_cpu_pool_lane_shows_unhealthy_in_the_snapshot(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        lane_id, token = only_lane(await rig.sup.submit(builtin("kernels", seconds=1000)))
        assert lane_id == rig.cpu_lane
        await rig.fault_lane(lane_id)
        await trio.testing.wait_all_tasks_blocked()
        out = lane_view(rig, lane_id)
        assert out["health"] == "unhealthy"
        assert "failed too often" in out["health_reason"]
        assert "lane work" in out["health_reason"]  # what is out: its lane work only
        assert rig.lane_events(lane_id) == ["unhealthy"]
        # The pool's processes and builtins still run and are still admitted.
        assert rig.machine.ledger.available(lane_id)
        assert rig.sup.get("kernels").state is S.running
        await rig.sup.submit(builtin("echo", "echo", text="hi"))
        assert await rig.wait_terminal("echo") is S.succeeded
        # It comes back like any lane.
        await settle(mock_clock, 1)
        await assert_back_in_service(rig, lane_id, token)
        await rig.sup.cancel("kernels")


# -- (c) a hung host is found while idle ---------------------------------------------------


async def test_a_hung_idle_sentinel_is_found_by_heartbeat_and_replaced_within_5_s(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        hosts = rig.in_process_hosts
        response = await rig.sup.submit(gpu_work("holder"))
        lane_id, token = only_lane(response)
        await rig.sup.lane_work(lane_id, token, MemoryReserve(dtype="float32", shape=[1024]))
        owner = rig.sup.owners[lane_id]
        hung = owner.sentinel
        assert isinstance(hung, InProcessHost)
        hung.hang()  # it neither answers nor exits; nobody asks the lane anything
        hosts.start_gate = gate = trio.Event()  # its replacement waits to greet
        stopped_at = trio.current_time()
        try:
            while owner.host_starts == 1:
                assert trio.current_time() - stopped_at < 5, "the hung host was never noticed"
                await settle(mock_clock, 0.25)
        finally:
            hung.resume()
        assert hung.closed and len(owner.restarts) == 1
        assert owner.host_status == "restarting" and owner.host_problem.startswith("timeout")
        # /readyz's lane_hosts reason names the lane until its replacement answers.
        problem = rig.sup.lane_hosts_problem()
        assert problem is not None and f"{lane_id} (restarting: timeout" in problem
        # The sentinel held nobody's buffers: the holder's session goes on.
        assert rig.sup.get("holder").state is S.running and owner.held_by("holder") == 4096
        gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert owner.host_status == "ready" and rig.sup.lane_hosts_problem() is None
        assert owner.host_starts == 2
        await rig.sup.cancel("holder")
        rig.assert_released("holder", response.tokens)


async def test_a_hung_idle_session_host_ends_its_invocation_within_5_s_and_no_other(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        response = await rig.sup.submit(gpu_work("hung"))
        lane_id, token = only_lane(response)
        _, neighbour = only_lane(await rig.sup.submit(gpu_work("neighbour")))
        for who in (token, neighbour):
            await rig.sup.lane_work(lane_id, who, MemoryReserve(dtype="float32", shape=[1024]))
        owner = rig.sup.owners[lane_id]
        hung = owner.sessions["hung"].host
        assert isinstance(hung, InProcessHost)
        hung.hang()
        stopped_at = trio.current_time()
        try:
            while not hung.closed:  # ended by its session, which found it hung
                assert trio.current_time() - stopped_at < 5, "the hung host was never noticed"
                await settle(mock_clock, 0.25)
        finally:
            hung.resume()
        assert await rig.wait_terminal("hung") is S.cancelled
        assert rig.sup.get("hung").reason == "lane_session_failed" and hung.closed
        assert rig.sup.get("neighbour").state is S.running
        assert owner.held_by("neighbour") == 4096 and owner.held_by("hung") == 0
        assert owner.host_starts == 1 and not owner.restarts and owner.host_status == "ready"
        await rig.sup.cancel("neighbour")
        rig.assert_released("hung", response.tokens)


async def test_an_idle_host_that_answers_its_heartbeats_stays(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path) as rig:
        hosts = rig.in_process_hosts
        lane_id = rig.gpu_lane
        owner = rig.sup.owners[lane_id]
        for _ in range(60):
            await settle(mock_clock, 1)
        assert hosts.current(lane_id).heartbeats == 30  # one every 2 s of idleness
        assert owner.host_starts == 1 and len(owner.restarts) == 0


async def test_a_busy_host_gets_no_heartbeat(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """The host serves one request at a time: a long kernel is bounded by its own
    deadline, not taken for a hang."""
    async with open_rig(tmp_path) as rig:
        hosts = rig.in_process_hosts
        lane_id, token = only_lane(await rig.sup.submit(gpu_work("long")))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                rig.sup.lane_work, lane_id, token, Execute(kernel="sleep", args={"seconds": 10})
            )
            await trio.testing.wait_all_tasks_blocked()  # the kernel runs from now on
            for _ in range(10):
                await settle(mock_clock, 1)
        assert hosts.current(lane_id).heartbeats == 0
        assert rig.sup.owners[lane_id].host_starts == 1
        await rig.sup.cancel("long")


async def test_a_sigstopped_idle_host_process_is_found_within_5_s_and_replaced(
    tmp_path: Path,
) -> None:
    async with open_rig(tmp_path, lane_hosts=lane_host_factory(backend="numpy")) as rig:
        lane_id = rig.gpu_lane
        owner = rig.sup.owners[lane_id]
        host = owner.sentinel
        assert isinstance(host, LaneHost) and host.pid is not None
        pid = host.pid
        os.kill(pid, signal.SIGSTOP)  # idle: nothing is asked of the lane after this
        try:
            with trio.fail_after(5):
                while owner.host_starts == 1:  # noqa: ASYNC110 - the owner's counters, polled
                    await trio.sleep(0.02)
            assert owner.host_problem.startswith("timeout: ")
            assert await wait_gone(pid)  # killed, stopped or not
            with trio.fail_after(30):
                while owner.host_status != "ready":  # noqa: ASYNC110
                    await trio.sleep(0.02)
            replacement = owner.sentinel
            assert isinstance(replacement, LaneHost) and replacement.pid not in (None, pid)
            assert len(owner.restarts) == 1 and not owner.faulted
        finally:
            if not process_gone(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
