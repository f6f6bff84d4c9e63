"""The simulator's fault timeline reaches a running daemon: a GPU falling off the bus
cancels the work on it, leaves allocatable and shows in the snapshot; recovery
brings it back without a restart."""

from __future__ import annotations

import pathlib
from collections.abc import Awaitable, Callable

import httpx
import trio

from tests.api_fixtures import bearer, builtin_request, running_daemon

GPU = "GPU-5e1d0a3c-0000-4000-8000-5157a0000001"
SIM = f"""
[cpu]
logical_cores = 4
[memory]
total = "8GiB"
[[gpus]]
uuid = "{GPU}"
name = "SimGPU"
memory = "8GiB"
[[faults]]
at = 1.0
gpu = "{GPU}"
kind = "lost"
[[faults]]
at = 4.0
gpu = "{GPU}"
kind = "recovered"
"""


async def _until(read: Callable[[], Awaitable[str]], expected: str) -> None:
    """Poll a running daemon (real time: the simulator's timeline runs on it), 20 s at most."""
    for _ in range(400):
        if await read() == expected:
            return
        await trio.sleep(0.05)
    raise AssertionError(f"never became {expected!r}; last {await read()!r}")


async def test_a_lost_gpu_cancels_its_work_then_recovers(tmp_path: pathlib.Path) -> None:
    sim = tmp_path / "sim.toml"
    sim.write_text(SIM)
    argv = ("--sim-file", str(sim), "--health-interval", "0.1", "--recovery-probes", "2")
    async with (
        running_daemon(tmp_path, *argv) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        op = bearer(node.scheduler)

        async def health() -> str:
            (device,) = (await client.get("/v1/snapshot", headers=op)).json()["devices"]
            return str(device["health"])

        async def state() -> str:
            reply = await client.get("/v1/invocations/on-gpu", headers=op)
            return str(reply.json()["state"])

        body = builtin_request(
            "on-gpu",
            args={"seconds": 60},
            requirement="gpu",
            resources={"cpu_millis": 100, "memory_bytes": 2**20, "gpus": 1, "vram_bytes": 2**30},
        )
        assert (await client.post("/v1/invocations", json=body, headers=op)).status_code == 202
        await _until(health, "lost")  # the GPU falls off the bus
        await _until(state, "cancelled")
        reply = await client.get("/v1/invocations/on-gpu", headers=op)
        assert reply.json()["reason"] == "lane_unhealthy"
        lost = await client.post("/v1/invocations", json={**body, "id": "while-lost"}, headers=op)
        assert lost.status_code == 409, lost.text
        await _until(health, "healthy")  # recovered, without a restart
        again = await client.post("/v1/invocations", json={**body, "id": "after"}, headers=op)
        assert again.status_code == 202, again.text
