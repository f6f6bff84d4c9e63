"""Telemetry push: a real collector on loopback, and the pusher's timing on a fake clock."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import pathlib
import random
from collections.abc import AsyncIterator

import httpx
import msgspec
import trio
import trio.testing

from api.telemetry import TelemetryPusher
from machine.snapshot import NodeSnapshot
from node.daemon import Daemon
from tests.api_fixtures import (
    START_SECONDS,
    STOP_SECONDS,
    bearer,
    builtin_request,
    daemon_config,
    get_snapshot,
    running_daemon,
)
from tests.scheduler_double import read_request, serve_loopback


@dataclasses.dataclass
class Push:
    at: float
    node_id: str
    content_type: str
    body: bytes


@dataclasses.dataclass
class Collector:
    """A minimal HTTP/1.1 server that records every POST and answers 204.
    `blackhole` makes it accept connections and never answer."""

    url: str = ""
    pushes: list[Push] = dataclasses.field(default_factory=list)
    blackhole: bool = False
    arrived: trio.Event = dataclasses.field(default_factory=trio.Event)

    def from_node(self, node_id: str) -> list[Push]:
        return [p for p in self.pushes if p.node_id == node_id]

    async def wait_for(self, count: int, node_id: str | None = None, seconds: float = 10) -> None:
        with trio.fail_after(seconds):
            while len(self.from_node(node_id) if node_id else self.pushes) < count:
                await self.arrived.wait()

    async def handle(self, stream: trio.SocketStream) -> None:
        buffer = b""
        async with stream:
            while (request := await read_request(stream, buffer)) is not None:
                headers, body, buffer = request
                if self.blackhole:
                    await trio.sleep_forever()
                self.pushes.append(
                    Push(
                        at=trio.current_time(),
                        node_id=headers.get("x-node-id", ""),
                        content_type=headers.get("content-type", ""),
                        body=body,
                    )
                )
                self.arrived.set()
                self.arrived = trio.Event()
                await stream.send_all(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n")


@contextlib.asynccontextmanager
async def collector(*, blackhole: bool = False) -> AsyncIterator[Collector]:
    state = Collector(blackhole=blackhole)
    async with trio.open_nursery() as nursery:
        state.url = await serve_loopback(nursery, state.handle)
        yield state
        nursery.cancel_scope.cancel()


async def test_daemon_pushes_its_snapshot_every_interval(tmp_path: pathlib.Path) -> None:
    async with collector() as sink:
        argv = ("--scheduler-url", sink.url, "--telemetry-interval", "0.1", "--node-id", "node-a")
        async with (
            running_daemon(tmp_path, *argv) as node,
            httpx.AsyncClient(base_url=node.url, timeout=5) as client,
        ):
            await sink.wait_for(4)
            pushes = list(sink.pushes)
            for push in pushes:
                assert push.node_id == "node-a"
                assert push.content_type == "application/json"
                assert msgspec.json.decode(push.body, type=NodeSnapshot).node_id == "node-a"
            gaps = [b.at - a.at for a, b in itertools.pairwise(pushes)]
            assert all(gap >= 0.05 for gap in gaps), gaps  # every interval, not a spin
            # A change shows up in the next push.
            body = builtin_request("t1", args={"seconds": 60})
            accepted = await client.post("/v1/invocations", json=body, headers=bearer(node.admin))
            assert accepted.status_code == 202
            served = await get_snapshot(client, node.scheduler)
            seen = len(sink.pushes)
            await sink.wait_for(seen + 1)
            pushed = msgspec.json.decode(sink.pushes[seen].body, type=NodeSnapshot)
            assert pushed.sequence >= served.sequence
            assert pushed.capacity == served.capacity


async def test_blackholed_collector_does_not_slow_the_api_or_shutdown(
    tmp_path: pathlib.Path,
) -> None:
    async with collector(blackhole=True) as sink:
        argv = ("--scheduler-url", sink.url, "--telemetry-interval", "0.05")
        async with (
            running_daemon(tmp_path, *argv) as node,
            httpx.AsyncClient(base_url=node.url, timeout=5) as client,
        ):
            assert node.daemon.telemetry is not None
            for _ in range(20):
                with trio.fail_after(1.0):  # a stuck push (5 s timeout) must not show
                    reply = await client.get("/v1/snapshot", headers=bearer(node.scheduler))
                assert reply.status_code == 200
            assert node.daemon.telemetry.sent == 0  # the push really is stuck
            stopping = trio.current_time()
        assert trio.current_time() - stopping < 5  # the stuck push did not hold the stop


async def test_three_nodes_push_to_one_collector_and_survive_one_stopping(
    tmp_path: pathlib.Path,
) -> None:
    async with collector() as sink, trio.open_nursery() as nursery:
        nodes: dict[str, Daemon] = {}
        ended = {name: trio.Event() for name in ("node-1", "node-2", "node-3")}
        try:
            for name in ("node-1", "node-2", "node-3"):
                argv = ("--scheduler-url", sink.url, "--telemetry-interval", "0.1")
                config = daemon_config(tmp_path / name, *argv, "--node-id", name)
                nodes[name] = Daemon(config, handle_signals=False)
                with trio.fail_after(START_SECONDS):
                    await nursery.start(_run_node, nodes[name], ended[name])
            for name in nodes:
                await sink.wait_for(2, node_id=name)
            nodes["node-2"].stop.set()
            with trio.fail_after(STOP_SECONDS):
                await ended["node-2"].wait()
            stopped_at = len(sink.from_node("node-2"))
            for name in ("node-1", "node-3"):
                await sink.wait_for(len(sink.from_node(name)) + 3, node_id=name)
            assert len(sink.from_node("node-2")) == stopped_at
            assert {p.node_id for p in sink.pushes} == set(nodes)
        finally:
            for daemon in nodes.values():
                daemon.stop.set()
            nursery.cancel_scope.deadline = trio.current_time() + STOP_SECONDS


async def _run_node(
    daemon: Daemon, ended: trio.Event, *, task_status: trio.TaskStatus[str]
) -> None:
    try:
        await daemon.run(task_status=task_status)
    finally:
        ended.set()


# -- the pusher alone, on a fake clock ---------------------------------------------------


class Flaky:
    """An httpx transport whose collector is down until `up_at` (fake-clock seconds)."""

    def __init__(self, up_at: float) -> None:
        self.up_at = up_at
        self.attempts: list[float] = []
        self.delivered: list[tuple[float, bytes]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        now = trio.current_time()
        self.attempts.append(now)
        if now < self.up_at:
            raise httpx.ConnectError("connection refused", request=request)
        self.delivered.append((now, request.content))
        return httpx.Response(204)


async def test_outage_backs_off_then_one_current_snapshot_and_regular_pushes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    outage, interval = 600.0, 1.0
    transport = Flaky(up_at=trio.current_time() + outage)
    state = {"version": 0}

    def snapshot() -> bytes:
        return str(state["version"]).encode()

    pusher = TelemetryPusher(
        "http://collector.invalid/v1/telemetry",
        interval,
        snapshot,
        node_id="n",
        max_backoff=30.0,
        rng=random.Random(7),
        transport=httpx.MockTransport(transport),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(pusher.run)
        # The node's state keeps changing through the outage.
        for _ in range(int(outage)):
            state["version"] += 1
            await trio.sleep(1)
        await trio.sleep(60)
        nursery.cancel_scope.cancel()
    during = [t for t in transport.attempts if t < transport.up_at]
    # Without backoff there would be one attempt per interval (600); with it, far fewer.
    assert 5 <= len(during) <= 600 / 5, len(during)
    assert pusher.failures == len(during)
    # Pushes resume within one backoff ceiling, then every interval.
    first_at, first_body = transport.delivered[0]
    assert first_at - transport.up_at <= 30.0
    # No backlog: one current snapshot, not a burst of the states it missed.
    assert first_body == str(state["version"]).encode()
    times = [t for t, _ in transport.delivered]
    assert all(abs((b - a) - interval) < 1e-6 for a, b in itertools.pairwise(times)), times
    assert len({body for _, body in transport.delivered}) == 1  # the state stopped changing
    assert pusher.consecutive_failures == 0


async def test_nudge_pushes_early_but_never_bypasses_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    transport = Flaky(up_at=trio.current_time() + 1000)
    pusher = TelemetryPusher(
        "http://collector.invalid/",
        10.0,
        lambda: b"{}",
        node_id="n",
        max_backoff=300.0,
        rng=random.Random(3),
        transport=httpx.MockTransport(transport),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(pusher.run)
        for _ in range(200):
            pusher.nudge()  # a health flap storm
            await trio.sleep(0.5)
        nursery.cancel_scope.cancel()
    # 100 s of nudges every 0.5 s: backoff still spaces the failing attempts out.
    assert len(transport.attempts) < 30, len(transport.attempts)


async def test_nudge_pushes_at_once_when_healthy(autojump_clock: trio.testing.MockClock) -> None:
    transport = Flaky(up_at=0)
    pusher = TelemetryPusher(
        "http://collector.invalid/",
        60.0,
        lambda: b"{}",
        node_id="n",
        transport=httpx.MockTransport(transport),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(pusher.run)
        await trio.sleep(1)
        start = trio.current_time()
        pusher.nudge()
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert [t - start for t, _ in transport.delivered[1:]] == [0.0]
