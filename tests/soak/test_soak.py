"""Soak: one daemon (a child process), mixed concurrent load for a bounded time.

Snapshot readers, submitters (builtin and process work), cancellers, lane
workers holding capability tokens, and an event subscriber, all at once for
SOAK_SECONDS (10 s by default, as CI runs it; about 60 s for the full run).
Then: zero 5xx, every reservation released (capacity equals the baseline), no
live invocation or child process left, and RSS growth under a bound.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import pathlib
import random
from typing import Any

import httpx
import pytest
import trio
import trio.lowlevel

from tests.adversarial.fixtures import (
    MiB,
    bearer,
    guest_command_lines,
    host_port,
    rss,
    subprocess_node,
)

SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "10"))
RSS_GROWTH_BOUND = 50 * MiB
TERMINAL = {"succeeded", "failed", "cancelled", "timed_out", "rejected"}


class Load:
    def __init__(self, client: httpx.AsyncClient, op: dict[str, str], seed: int) -> None:
        self.client = client
        self.op = op
        self.rng = random.Random(seed)
        self.statuses: collections.Counter[int] = collections.Counter()
        self.server_errors: list[str] = []
        self.ids = itertools.count()
        self.submitted: set[str] = set()
        # HTTP workers stop between requests at this time: a request cancelled
        # mid-flight would leave httpx's body generator unfinalised.
        self.until = math.inf

    def record(self, what: str, reply: httpx.Response) -> httpx.Response:
        self.statuses[reply.status_code] += 1
        if reply.status_code >= 500 and reply.status_code != 503:
            self.server_errors.append(f"{what}: {reply.status_code} {reply.text[:200]}")
        elif reply.status_code == 503 and "lane_unhealthy" not in reply.text:
            self.server_errors.append(f"{what}: {reply.status_code} {reply.text[:200]}")
        return reply

    def new_id(self, prefix: str) -> str:
        ident = f"{prefix}-{next(self.ids)}"
        self.submitted.add(ident)
        return ident

    async def submit(self, body: dict[str, Any]) -> httpx.Response:
        return self.record(
            "submit", await self.client.post("/v1/invocations", json=body, headers=self.op)
        )

    # -- the workers ------------------------------------------------------------------------
    async def reader(self) -> None:
        while trio.current_time() < self.until:
            self.record("snapshot", await self.client.get("/v1/snapshot", headers=self.op))
            if self.rng.random() < 0.2:
                self.record("list", await self.client.get("/v1/invocations", headers=self.op))
            await trio.lowlevel.checkpoint()

    async def submitter(self) -> None:
        while trio.current_time() < self.until:
            kind = self.rng.choice(["sleep", "echo", "fail", "process"])
            ident = self.new_id(kind)
            if kind == "process":
                work: dict[str, Any] = {"kind": "process", "argv": ["/bin/true"]}
                memory = 256 * MiB
            else:
                args = {"sleep": {"seconds": self.rng.uniform(0, 0.3)}, "echo": {"text": "x" * 64}}
                work = {"kind": "builtin", "name": kind, "args": args.get(kind, {})}
                memory = MiB
            await self.submit(
                {"id": ident, "work": work, "resources": {"cpu_millis": 10, "memory_bytes": memory}}
            )
            await trio.sleep(self.rng.uniform(0, 0.02))

    async def canceller(self) -> None:
        while trio.current_time() < self.until:
            ident = self.new_id("cancel")
            body = {
                "id": ident,
                "work": {"kind": "builtin", "name": "sleep", "args": {"seconds": 30}},
                "resources": {"cpu_millis": 10, "memory_bytes": MiB},
            }
            if (await self.submit(body)).status_code == 202:
                await trio.sleep(self.rng.uniform(0, 0.1))
                reply = self.record(
                    "cancel",
                    await self.client.delete(f"/v1/invocations/{ident}", headers=self.op),
                )
                assert reply.json()["state"] in TERMINAL
            else:
                await trio.sleep(0.05)

    async def lane_worker(self) -> None:
        while trio.current_time() < self.until:
            ident = self.new_id("lane")
            body = {
                "id": ident,
                "work": {"kind": "builtin", "name": "sleep", "args": {"seconds": 30}},
                "requirement": "gpu",
                "resources": {
                    # Its lane session's host is charged to it: at 10 millicores its
                    # start alone would take seconds.
                    "cpu_millis": 200,
                    "memory_bytes": MiB,
                    "gpus": 1,
                    "vram_bytes": 64 * MiB,
                },
            }
            reply = await self.submit(body)
            if reply.status_code != 202:
                await trio.sleep(0.05)
                continue
            lane, token = next(iter(reply.json()["tokens"].items()))
            work = f"/v1/lanes/{lane}/work"
            for _ in range(self.rng.randint(1, 10)):
                reserved = self.record(
                    "reserve",
                    await self.client.post(
                        work,
                        json={"op": "memory_reserve", "dtype": "uint8", "shape": [MiB]},
                        headers=bearer(token),
                    ),
                )
                self.record(
                    "execute",
                    await self.client.post(
                        work, json={"op": "execute", "kernel": "noop"}, headers=bearer(token)
                    ),
                )
                if reserved.status_code == 200 and self.rng.random() < 0.7:
                    self.record(
                        "release",
                        await self.client.post(
                            work,
                            json={
                                "op": "memory_release",
                                "buffer_id": reserved.json()["buffer_id"],
                            },
                            headers=bearer(token),
                        ),
                    )
            # Ending the invocation frees whatever buffers it still holds.
            self.record(
                "cancel", await self.client.delete(f"/v1/invocations/{ident}", headers=self.op)
            )
            after = await self.client.post(
                work, json={"op": "execute", "kernel": "noop"}, headers=bearer(token)
            )
            self.statuses[after.status_code] += 1
            assert after.status_code == 401, after.text  # revoked once ended

    async def subscriber(self, url: str, secret: str) -> None:
        host, port = host_port(url)
        while True:
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                await stream.send_all(
                    f"GET /v1/events HTTP/1.0\r\nHost: x\r\n"
                    f"Authorization: Bearer {secret}\r\n\r\n".encode()
                )
                while await stream.receive_some(65536):
                    pass  # a dropped (lagging) subscriber is closed; reconnect


async def _run_load(load: Load, url: str, secret: str, seconds: float) -> None:
    load.until = trio.current_time() + seconds
    async with trio.open_nursery() as outer:
        outer.start_soon(load.subscriber, url, secret)  # raw socket: safe to cancel
        async with trio.open_nursery() as workers:
            for _ in range(3):
                workers.start_soon(load.reader)
            for _ in range(2):
                workers.start_soon(load.submitter)
                workers.start_soon(load.lane_worker)
            workers.start_soon(load.canceller)
        outer.cancel_scope.cancel()


@pytest.mark.soak
async def test_soak_mixed_load_no_5xx_no_leak_rss_bounded(tmp_path: pathlib.Path) -> None:
    state = tmp_path / "state"
    # A keep-alive longer than the run: an idle pooled connection the server closes just as
    # the client reuses it is a client-side race of HTTP/1.1, not what this test measures.
    argv = ("--max-queued", "64", "--max-running", "32", "--http-keep-alive", "120")
    with subprocess_node(state, *argv) as (proc, url, op):
        secret = op["Authorization"].removeprefix("Bearer ")
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
            baseline = (await client.get("/v1/snapshot", headers=op)).json()["capacity"]
            load = Load(client, op, seed=1234)
            await _run_load(load, url, secret, min(2.0, SOAK_SECONDS / 5))  # warm-up
            before = rss(proc.pid)
            await _run_load(load, url, secret, SOAK_SECONDS)
            # Wind down: cancel what is still live, wait (bounded) until all has ended.
            with trio.fail_after(60):
                while True:
                    listed = (await client.get("/v1/invocations", headers=op)).json()
                    live = [i["id"] for i in listed["invocations"] if i["state"] not in TERMINAL]
                    if not live:
                        break
                    for ident in live:
                        await client.delete(f"/v1/invocations/{ident}", headers=op)
                    await trio.sleep(0.05)
            after = rss(proc.pid)
            capacity = (await client.get("/v1/snapshot", headers=op)).json()["capacity"]
            requests = sum(load.statuses.values())
            assert not load.server_errors, load.server_errors[:10]
            assert load.statuses[202] > 0 and load.statuses[200] > 0, load.statuses
            assert capacity == baseline, "a reservation leaked"
            assert after - before < RSS_GROWTH_BOUND, (
                f"RSS grew {(after - before) / MiB:.1f} MiB over {requests} requests"
            )
            for _ in range(200):  # no child process outlives its invocation (10 s bound)
                if not guest_command_lines(proc.pid):
                    break
                await trio.sleep(0.05)
            assert not guest_command_lines(proc.pid)
            print(
                f"soak: {SOAK_SECONDS:.0f}s, {requests} requests, statuses {dict(load.statuses)}, "
                f"RSS {before / MiB:.1f} -> {after / MiB:.1f} MiB"
            )
