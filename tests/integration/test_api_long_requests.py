"""Requests that outlive the read timeout: long lane work answers, the event
stream stays open with heartbeats and resumes from `Last-Event-ID`.

The read timeout guards reading a request; these daemons run with a 1 s one,
so each test waits a few real seconds (Hypercorn's socket timers run on trio's
real clock here, beyond a MockClock's reach).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import trio

from supervisor.wire import EventKind, NodeEvent
from tests.api_fixtures import (
    SSE_CONNECTED,
    RunningDaemon,
    bearer,
    builtin_request,
    event_run,
    running_daemon,
    sse_connect,
)

READ_TIMEOUT = ("--http-read-timeout", "1")


async def _submit(client: httpx.AsyncClient, node: RunningDaemon, invocation_id: str) -> Any:
    body = builtin_request(invocation_id, args={"seconds": 60})
    reply = await client.post("/v1/invocations", json=body, headers=bearer(node.scheduler))
    assert reply.status_code == 202, reply.text
    return reply.json()


async def test_lane_work_running_longer_than_the_read_timeout_is_answered(
    tmp_path: pathlib.Path, in_process_lane_hosts: None
) -> None:
    async with (
        running_daemon(tmp_path, *READ_TIMEOUT) as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        accepted = await _submit(client, node, "long")
        lane, token = next(iter(accepted["tokens"].items()))
        started = trio.current_time()
        work = await client.post(
            f"/v1/lanes/{lane}/work",
            json={"op": "execute", "kernel": "sleep", "args": {"seconds": 2.5}},
            headers=bearer(token),
        )
        assert work.status_code == 200, work.text
        assert work.json()["result"] == {"seconds": 2.5}
        assert trio.current_time() - started >= 2.5


async def test_event_stream_outlives_the_read_timeout_with_heartbeats(
    tmp_path: pathlib.Path,
) -> None:
    async with (
        running_daemon(tmp_path, *READ_TIMEOUT) as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
        sse_connect(node.url, node.scheduler) as stream,
    ):
        assert stream.status == 200
        assert await stream.next_block() == SSE_CONNECTED
        heartbeats = 0
        with trio.move_on_after(3):  # three read timeouts without an event
            while True:
                assert await stream.next_block() == {"": "heartbeat"}
                heartbeats += 1
        assert heartbeats >= 4  # one every half read timeout
        # Still open, and still delivering.
        await _submit(client, node, "after-quiet")
        with trio.fail_after(5):
            while "data" not in (block := await stream.next_block()):
                pass
        assert msgspec.json.decode(block["data"])["invocation"]["id"] == "after-quiet"


async def test_event_stream_resumes_after_last_event_id(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        async with sse_connect(node.url, node.scheduler) as stream:
            assert await stream.next_block() == SSE_CONNECTED
            await _submit(client, node, "first")
            seen = await stream.next_block()
            assert msgspec.json.decode(seen["data"])["invocation"]["id"] == "first"
        # Disconnected: these happen while nobody listens.
        await _submit(client, node, "missed-1")
        await _submit(client, node, "missed-2")
        async with sse_connect(node.url, node.scheduler, last_event_id=seen["id"]) as stream:
            assert await stream.next_block() == SSE_CONNECTED
            replayed = []
            with trio.fail_after(5):
                while len(replayed) < 2:
                    block = await stream.next_block()
                    event = msgspec.json.decode(block["data"])
                    if event["kind"] == "invocation" and event["invocation"]["state"] == "queued":
                        replayed.append(event["invocation"]["id"])
            assert replayed == ["missed-1", "missed-2"]


async def test_event_stream_from_an_unknown_last_event_id_says_resync(
    tmp_path: pathlib.Path,
) -> None:
    async with running_daemon(tmp_path) as node:
        for unknown in ("another-run-7", f"{event_run(node)}-999999", "garbage"):
            async with sse_connect(node.url, node.scheduler, last_event_id=unknown) as stream:
                assert stream.status == 200
                assert await stream.next_block() == SSE_CONNECTED
                block = await stream.next_block()
                assert block["event"] == "resync"
                assert msgspec.json.decode(block["data"]) == {
                    "reason": "not_kept",
                    "snapshot": "/v1/snapshot",
                }


async def _until(condition: Callable[[], bool], seconds: float) -> None:
    with trio.fail_after(seconds):
        while True:
            if condition():
                return
            await trio.sleep(0.02)


async def test_an_event_stream_nobody_reads_is_closed_and_frees_its_slot(
    tmp_path: pathlib.Path,
) -> None:
    async with running_daemon(tmp_path, *READ_TIMEOUT) as node:
        hub = node.daemon.context.events
        assert hub is not None
        host, port = node.url.removeprefix("http://").rsplit(":", 1)
        sock = trio.socket.socket()
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
        await sock.connect((host, int(port)))
        with sock:
            request = f"GET /v1/events HTTP/1.0\r\nAuthorization: Bearer {node.scheduler}\r\n\r\n"
            await sock.send(request.encode())
            await _until(lambda: hub.subscriber_count == 1, 5)
            # Far more than the socket buffers hold, in waves the subscriber keeps up
            # with until its writes block; then nothing is read at all.
            big = NodeEvent(kind=EventKind.lane, at="now", reasons=["x" * 4000])
            for _ in range(20):
                for _ in range(50):
                    hub.publish(big)
                await trio.sleep(0.02)
            await _until(lambda: hub.subscriber_count == 0, 4)  # a read timeout, and slack
