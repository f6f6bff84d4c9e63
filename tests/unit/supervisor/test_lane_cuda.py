"""CUDA lanes behind their owner, with real lane host processes whose `cupy` is the
fake (tests/fakes/fake_cupy_host.py): a device lane never computes on the CPU; a
host that cannot run CUDA makes its lane unhealthy `cuda_unavailable` (probed
with backoff, not restarted in a loop); each host's CUDA context is booked as the
lane's memory and the sentinel's is kept back in the ledger; a sticky device
error ends the host and only the invocation whose request met it."""

from __future__ import annotations

import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import trio

from machine.health import HealthState
from supervisor.lane_host import LaneHost, LaneHostFailed, lane_host_factory
from supervisor.lane_owner import LaneWorkError
from supervisor.lane_work import Download, Execute, MemoryReserve, Upload
from supervisor.wire import InvocationState
from tests.lanehost_fixtures import BUDGET, HELLO_THEN, fake_host, wait_gone
from tests.supervisor_fixtures import GiB, Rig, gpu_builtin, only_lane, open_rig

MiB = 1 << 20
CONTEXT = 4 * MiB  # the fake's CUDA context (FAKE_CUPY_CONTEXT_BYTES)
FAKE_CUDA_HOST = [
    sys.executable,
    str(pathlib.Path(__file__).resolve().parents[2] / "fakes" / "fake_cupy_host.py"),
]
STICKY = 13.0  # a `fill` with this value meets a sticky error in the fake


def fake_cuda(**fake: str) -> Callable[..., Any]:
    """The daemon's factory, with every device lane's hosts on the fake CUDA."""
    env = {"FAKE_CUPY_CONTEXT_BYTES": str(CONTEXT), **fake}
    return lane_host_factory(FAKE_CUDA_HOST, backend="cupy", env=env)


async def _until(check: Callable[[], Any], seconds: float = 20.0) -> Any:
    with trio.fail_after(seconds):
        while not (found := check()):  # noqa: ASYNC110 - polled: nothing signals it
            await trio.sleep(0.02)
        return found


def gpu_work(invocation_id: str) -> Any:
    return gpu_builtin(invocation_id, vram_bytes=1 * GiB, seconds=1000)


# -- one host ---------------------------------------------------------------------------


async def test_a_cuda_host_reports_the_context_it_holds_and_serves_the_rest() -> None:
    lane = LaneHost(
        "lane_test",
        BUDGET + CONTEXT,
        visible_devices=["GPU-fake"],
        command=FAKE_CUDA_HOST,
        env={"FAKE_CUPY_CONTEXT_BYTES": str(CONTEXT)},
    )
    assert lane.backend == "cupy"  # `auto` with a device: CUDA, nothing else
    async with lane:
        hello = lane.hello
        assert (hello.backend, hello.memory_reserved) == ("cupy", CONTEXT)
        stats = await lane.stats()
        assert (stats.free, stats.reserved) == (BUDGET, CONTEXT)
        assert await lane.alloc("a", "uint8", (BUDGET,)) == BUDGET
        await lane.write("a", 0, b"\x01" * 64)
        assert await lane.read("a", 0, 4) == b"\x01" * 4


async def test_a_host_that_serves_a_device_lane_from_host_memory_is_refused(
    tmp_path: pathlib.Path,
) -> None:
    """Whatever the host command (--lane-host-command), a device lane's host that
    answers with NumPy is not used: the lane would compute on the CPU."""
    lane = LaneHost(
        "lane_test", BUDGET, visible_devices=["GPU-fake"], command=fake_host(tmp_path, HELLO_THEN)
    )
    with pytest.raises(LaneHostFailed) as caught:
        await lane.start()
    assert caught.value.reason == "cuda_unavailable"
    assert "numpy, not cupy" in caught.value.message
    assert lane.pid is not None and await wait_gone(lane.pid)


async def test_a_sticky_error_ends_the_host_typed() -> None:
    lane = LaneHost(
        "lane_test",
        BUDGET + CONTEXT,
        visible_devices=["GPU-fake"],
        command=FAKE_CUDA_HOST,
        env={"FAKE_CUPY_STICKY_FILL": str(STICKY)},
    )
    async with lane:
        await lane.alloc("a", "float32", (16,))
        pid = lane.pid
        with pytest.raises(LaneHostFailed) as caught:
            await lane.run("fill", {"value": STICKY}, {"out": "a"})
        assert caught.value.reason == "device_failed"
        assert "context is lost" in caught.value.message
        assert pid is not None and await wait_gone(pid)
        assert not lane.running


# -- behind the lane's owner -------------------------------------------------------------


def _device_lane(rig: Rig) -> str:
    return next(lane.lane_id for lane in rig.machine.ledger.lanes() if lane.is_gpu)


async def test_a_lane_whose_hosts_cannot_run_cuda_is_unhealthy_and_probed_not_restarted(
    tmp_path: pathlib.Path,
) -> None:
    """The lane is out at its sentinel's first refusal (not after five restarts), shown
    unhealthy `cuda_unavailable: <why>`, its lane work refused, and probed with the
    lane's backoff; the GPU stays allocatable for work that brings its own CUDA."""
    async with open_rig(tmp_path, lane_hosts=fake_cuda(FAKE_CUPY_MISSING="cublas")) as rig:
        lane_id = _device_lane(rig)
        owner = rig.sup.owners[lane_id]
        await _until(lambda: owner.faulted)
        assert owner.cuda_unavailable and owner.host_starts == 1 and not owner.restarts
        reason = rig.machine.ledger.lane_fault(lane_id)
        assert reason is not None and reason.startswith("cuda_unavailable: ")
        assert "matmul (cuBLAS)" in reason and "never run on the CPU" in reason
        assert rig.machine.ledger.lane_health_shown(lane_id) is HealthState.UNHEALTHY
        note = rig.sup.cuda_unavailable_lanes()
        assert note is not None and lane_id in note and "cuBLAS" in note
        assert rig.sup.faulted_lanes() is None or lane_id not in rig.sup.faulted_lanes()  # type: ignore[operator]
        assert rig.sup.lane_hosts_problem() is None or lane_id not in str(
            rig.sup.lane_hosts_problem()
        )
        # Allocatable still (its device is healthy), but no lane work runs anywhere.
        lane, token = only_lane(await rig.sup.submit(gpu_work("brings-its-own")))
        with pytest.raises(LaneWorkError) as refused:
            await rig.sup.lane_work(lane, token, Execute(kernel="noop"))
        assert (refused.value.status, refused.value.code) == (503, "lane_unhealthy")
        # Probed after 1 s, then 2 s: a few starts, never a crash loop.
        started = time.monotonic()
        await _until(lambda: owner.retry_delay == 2.0)  # the first probe failed too
        assert owner.faulted and owner.host_starts == 2 and owner.next_probe_at is not None
        assert 0.5 < time.monotonic() - started < 5
        await rig.sup.cancel("brings-its-own")


async def test_each_hosts_context_is_the_lanes_memory_and_the_sentinels_is_kept_back(
    tmp_path: pathlib.Path,
) -> None:
    async with open_rig(tmp_path, lane_hosts=fake_cuda()) as rig:
        lane_id = _device_lane(rig)
        owner = rig.sup.owners[lane_id]
        await _until(lambda: owner.host_reserved)
        ledger = rig.machine.ledger
        assert owner.host_reserved == ledger.host_reserved(lane_id) == CONTEXT
        usage = next(u for u in ledger.capacity().lanes if u.lane_id == lane_id)
        assert usage.vram.reserved == ledger.vram_headroom + CONTEXT
        before = owner.free_bytes
        lane, token = only_lane(await rig.sup.submit(gpu_work("tenant")))
        await rig.sup.lane_work(lane, token, MemoryReserve(dtype="uint8", shape=[1024]))
        # Its session's host is a context of its own on the lane.
        assert owner.free_bytes == before - CONTEXT - 1024
        assert owner.held_by("tenant") == 1024  # its vram_bytes are charged its buffers only
        await rig.sup.cancel("tenant")
        assert owner.free_bytes == before


async def test_a_sticky_error_ends_only_its_invocation_and_the_lanes_next_host_is_fresh(
    tmp_path: pathlib.Path,
) -> None:
    """Whichever request meets a sticky error, its invocation ends `device_failed`
    with its host (whose context is dead); the neighbour on the same lane keeps
    its buffer and its data; the lane is not faulted, and the next invocation's
    work runs on a fresh host."""
    async with open_rig(tmp_path, lane_hosts=fake_cuda(FAKE_CUPY_STICKY_FILL=str(STICKY))) as rig:
        lane_id, victim = only_lane(await rig.sup.submit(gpu_work("victim")))
        lane_b, neighbour = only_lane(await rig.sup.submit(gpu_work("neighbour")))
        assert lane_b == lane_id
        kept = await rig.sup.lane_work(lane_id, neighbour, MemoryReserve(dtype="uint8", shape=[8]))
        assert kept.buffer_id is not None
        upload = Upload(buffer_id=kept.buffer_id, offset=0, data=bytes(range(8)))
        await rig.sup.lane_work(lane_id, neighbour, upload)
        mine = await rig.sup.lane_work(lane_id, victim, MemoryReserve(dtype="float32", shape=[4]))
        assert mine.buffer_id is not None
        with pytest.raises(LaneWorkError) as failed:
            fill = Execute(kernel="fill", args={"value": STICKY}, buffers={"out": mine.buffer_id})
            await rig.sup.lane_work(lane_id, victim, fill)
        assert (failed.value.status, failed.value.code) == (503, "device_failed")
        assert await rig.wait_terminal("victim") is InvocationState.cancelled
        assert rig.sup.get("victim").reason == "device_failed"
        owner = rig.sup.owners[lane_id]
        assert not owner.faulted and not owner.restarts and owner.host_starts == 1
        assert rig.sup.get("neighbour").state is InvocationState.running
        got = await rig.sup.lane_download(
            lane_id, neighbour, Download(buffer_id=kept.buffer_id, offset=0, length=8)
        )
        assert got == bytes(range(8))
        lane_c, after = only_lane(await rig.sup.submit(gpu_work("after")))
        assert lane_c == lane_id
        fresh = await rig.sup.lane_work(lane_id, after, MemoryReserve(dtype="float32", shape=[4]))
        assert fresh.buffer_id is not None
        ok = Execute(kernel="fill", args={"value": 1.0}, buffers={"out": fresh.buffer_id})
        assert (await rig.sup.lane_work(lane_id, after, ok)).result == {}
        await rig.sup.cancel("neighbour")
        await rig.sup.cancel("after")
