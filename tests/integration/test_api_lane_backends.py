"""The backend each lane computes with, through a running daemon: a real GPU's lane
(NVML, here the fake) whose host has no CuPy is unhealthy `cuda_unavailable` in
the snapshot and /readyz, and runs no lane work at all (never on NumPy); the CPU
pool and simulated lanes say `numpy`; the hosts get a CuPy cache folder of the
daemon's own."""

from __future__ import annotations

import importlib.util
import pathlib
import stat
from typing import Any

import httpx
import pytest
import trio

from node.daemon import LANE_HOST_CACHE
from supervisor.lane_host import LaneHost
from tests.api_fixtures import bearer, running_daemon
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml
from tests.integration.test_api_lane_hosts import _until
from tests.integration.test_api_lanes import gpu_request, submit

GiB = 1 << 30

needs_no_cupy = pytest.mark.skipif(
    importlib.util.find_spec("cupy") is not None,
    reason="CuPy is installed here: a lane host would not lack it",
)


async def _snapshot(client: httpx.AsyncClient, admin: str) -> dict[str, Any]:
    reply = await client.get("/v1/snapshot", headers=bearer(admin))
    assert reply.status_code == 200, reply.text
    snapshot: dict[str, Any] = reply.json()
    return snapshot


@needs_no_cupy
async def test_a_gpu_lane_without_cupy_is_unhealthy_cuda_unavailable_and_runs_nothing(
    tmp_path: pathlib.Path,
) -> None:
    """The report: with CuPy missing, `auto` served a real GPU's lane from host RAM,
    with the GPU's whole VRAM as its budget, and nothing showed it. Now the lane is
    `unhealthy` with `cuda_unavailable: ...` in the snapshot and /readyz, says
    `cupy`, and its lane work is refused: nothing runs on NumPy in its place."""
    nvml = FakeNvml([FakeGpu(uuid="GPU-aaaa", memory_total=40 * GiB)])
    async with (
        running_daemon(tmp_path, devices="nvml", pynvml_module=nvml) as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        sup = node.daemon.supervisor
        assert sup is not None

        async def gpu_lane() -> dict[str, Any] | None:
            lanes = (await _snapshot(client, node.admin))["lanes"]
            gpu = next(lane for lane in lanes if lane["device_id"] == "GPU-aaaa")
            return gpu if gpu["health"] == "unhealthy" else None

        lane = await _until(gpu_lane)
        assert lane["backend"] == "cupy"
        assert lane["health_reason"].startswith("cuda_unavailable: ")
        assert "CuPy does not import" in lane["health_reason"]
        cpu = next(
            item for item in (await _snapshot(client, node.admin))["lanes"] if item["kind"] == "cpu"
        )
        assert (cpu["backend"], cpu["health"]) == ("numpy", "healthy")
        ready = await _until(lambda: _ready(client))
        note = ready["notes"]["cuda"]
        assert note.startswith("cuda_unavailable: ") and lane["lane_id"] in note
        # Its lane work is refused; none of it ever reached a host (so no lane session
        # starts: a small grant fits any node).
        accepted = await submit(client, node, gpu_request("g1", cpu_millis=100))
        lane_id, token = next(iter(accepted["tokens"].items()))
        assert lane_id == lane["lane_id"]
        owner = sup.owners[lane_id]
        for work in (
            {"op": "execute", "kernel": "noop"},
            {"op": "memory_reserve", "dtype": "uint8", "shape": [16]},
        ):
            refused = await client.post(
                f"/v1/lanes/{lane_id}/work", json=work, headers=bearer(token)
            )
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert error["code"] == "lane_unhealthy"
            assert error["message"].startswith("cuda_unavailable: ")
        assert not owner.sessions and owner.session_starts == 0
        assert owner.faulted and owner.host_starts <= 3  # probed with backoff, no loop


async def _ready(client: httpx.AsyncClient) -> dict[str, Any] | None:
    reply = await client.get("/readyz")
    if reply.status_code != 200:
        return None
    body: dict[str, Any] = reply.json()
    return body if "cuda" in body["notes"] else None


async def test_simulated_lanes_say_numpy_and_their_hosts_get_a_private_cupy_cache(
    tmp_path: pathlib.Path,
) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        snapshot = await _snapshot(client, node.admin)
        assert {lane["backend"] for lane in snapshot["lanes"]} == {"numpy"}
        assert all(lane["health"] == "healthy" for lane in snapshot["lanes"])
        assert "cuda" not in (await client.get("/readyz")).json()["notes"]
        sup = node.daemon.supervisor
        assert sup is not None
        host = next(iter(sup.owners.values())).sentinel
        assert isinstance(host, LaneHost)
        cache = trio.Path(host._env["CUPY_CACHE_DIR"])
        root = trio.Path(node.daemon.config.state_dir) / LANE_HOST_CACHE
        assert cache.parent == root and await cache.is_dir()
        assert trio.Path(host._env["CUDA_CACHE_PATH"]).parent == root
        assert stat.S_IMODE((await root.stat()).st_mode) == 0o700  # no guest writes a kernel here
