"""Floods, oversized bodies and slow clients: every bound holds and says so.

A refusal for load is 429 with Retry-After; a body over the cap is 413 before
anything is read into a handler; a client that stops sending is disconnected
by the server's own timeouts. After each flood the node is back to its
baseline: capacity, live tokens, lane memory, ledger and journal.
"""

from __future__ import annotations

import contextlib
import math
import pathlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import trio

import node.daemon
from api.app import MAX_BODY_BYTES
from api.server import hypercorn_config
from node.daemon import http_settings
from tests.adversarial.fixtures import (
    MiB,
    bearer,
    config_for,
    error_code,
    gpu_request,
    host_port,
    http_request,
    raw_request,
    rss,
    sleep_request,
    subprocess_node,
)
from tests.adversarial.shared_daemon import SharedDaemon, SharedNode, shared_daemon, until
from tests.lane_doubles import InProcessHost, InProcessHosts

# The in-process tests share two daemons (one with short HTTP timeouts), each handed
# back as it was found (`SharedDaemon.node`): one worker runs them all.
pytestmark = [pytest.mark.hostile("exhaustion"), pytest.mark.xdist_group("exhaustion")]

FLOOD = 500
RSS_BOUND = 32 * MiB


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedDaemon]:
    """The module's daemon. Its lanes get in-process test hosts, whose `sleep` kernel
    holds a lane (a real host has none); every other test here is refused or answered
    before any lane host is asked anything."""
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as patch:  # the factory is taken at start
            patch.setattr(node.daemon, "lane_host_factory", lambda *_a, **_k: InProcessHosts())
            shared = stack.enter_context(shared_daemon(tmp_path_factory.mktemp("exhaustion")))
        yield shared


# --- submissions ------------------------------------------------------------------------


async def _flood(
    url: str, headers: dict[str, str], bodies: list[dict[str, Any]], concurrency: int = 32
) -> list[httpx.Response]:
    replies: list[httpx.Response] = []
    limiter = trio.CapacityLimiter(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def one(body: dict[str, Any]) -> None:
            async with limiter:
                replies.append(await client.post("/v1/invocations", json=body, headers=headers))

        async with trio.open_nursery() as nursery:
            for body in bodies:
                nursery.start_soon(one, body)
    return replies


async def test_exhaustion_submission_flood_429_retry_after_rss_bounded(
    tmp_path: pathlib.Path,
) -> None:
    state = tmp_path / "state"
    with subprocess_node(state, "--max-queued", "4", "--max-running", "1") as (proc, url, op):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            baseline = (await client.get("/v1/snapshot", headers=op)).json()["capacity"]
            # Warm up the code paths (and allocator) before measuring.
            warm = await _flood(url, op, [sleep_request(f"warm-{i}") for i in range(60)])
            for reply in warm:
                if reply.status_code == 202:
                    await client.delete(f"/v1/invocations/{reply.json()['id']}", headers=op)
            before = rss(proc.pid)
            replies = await _flood(url, op, [sleep_request(f"flood-{i}") for i in range(FLOOD)])
            after = rss(proc.pid)
            statuses = [r.status_code for r in replies]
            accepted = [r.json()["id"] for r in replies if r.status_code == 202]
            refused = [r for r in replies if r.status_code == 429]
            assert len(replies) == FLOOD and not [s for s in statuses if s >= 500]
            assert len(accepted) + len(refused) == FLOOD, sorted(set(statuses))
            assert 1 <= len(accepted) <= 4 + 1, accepted
            for reply in refused:
                assert error_code(reply) == "queue_full"
                assert int(reply.headers["Retry-After"]) >= 1
            assert after - before < RSS_BOUND, f"RSS grew {(after - before) / MiB:.1f} MiB"
            listed = {
                i["id"]
                for i in (await client.get("/v1/invocations", headers=op)).json()["invocations"]
            }
            assert {i for i in listed if i.startswith("flood-")} == set(accepted)
            for ident in accepted:
                await client.delete(f"/v1/invocations/{ident}", headers=op)
            capacity = (await client.get("/v1/snapshot", headers=op)).json()["capacity"]
            assert capacity == baseline


async def test_exhaustion_resubmitting_one_id_reserves_once(daemon: SharedDaemon) -> None:
    async with daemon.node() as node:
        base = await node.capacity()
        replies = await _flood(node.url, node.op, [sleep_request("same")] * 100)
        assert {r.status_code for r in replies} == {202}
        assert node.ledger_reservations() == {"same"}
        assert (await node.capacity())["cpu_millis"]["allocated"] == base["cpu_millis"][
            "allocated"
        ] + 10
        conflict = await node.client.post(
            "/v1/invocations", json=sleep_request("same", 61), headers=node.op
        )
        assert conflict.status_code == 409 and error_code(conflict) == "id_conflict"
        assert node.ledger_reservations() == {"same"}


# --- event subscribers ----------------------------------------------------------------


@contextlib.asynccontextmanager
async def _subscribe(url: str, secret: str) -> AsyncIterator[tuple[int, dict[str, str]]]:
    host, port = host_port(url)
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(
            f"GET /v1/events HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer {secret}\r\n\r\n".encode()
        )
        buffer = b""
        with trio.fail_after(10):
            while b"\r\n\r\n" not in buffer:
                data = await stream.receive_some(65536)
                assert data, buffer
                buffer += data
        head = buffer.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        yield int(head[0].split(" ")[1]), headers


def _subscribers(running: SharedNode) -> int:
    hub = running.daemon.context.events
    assert hub is not None
    return running.inside(lambda: hub.subscriber_count)


async def test_exhaustion_event_subscribers_beyond_cap_429(daemon: SharedDaemon) -> None:
    cap = node.daemon.EVENT_SUBSCRIBERS
    async with daemon.node() as running, contextlib.AsyncExitStack() as stack:
        assert _subscribers(running) == 0
        for _ in range(cap):
            status, _ = await stack.enter_async_context(_subscribe(running.url, running.scheduler))
            assert status == 200
        assert _subscribers(running) == cap
        for _ in range(cap):  # a flood beyond the cap: each refused at once
            async with _subscribe(running.url, running.scheduler) as (status, headers):
                assert status == 429
                assert int(headers["retry-after"]) >= 1
        assert _subscribers(running) == cap
        await stack.aclose()
        # The server notices the hang-ups.
        await until(lambda: _subscribers(running) == 0, "every hang-up noticed", 5)
        async with _subscribe(running.url, running.scheduler) as (status, _):
            assert status == 200


async def test_exhaustion_unauthenticated_subscribers_take_no_slot(daemon: SharedDaemon) -> None:
    async with daemon.node() as running:
        for _ in range(node.daemon.EVENT_SUBSCRIBERS + 5):
            async with _subscribe(running.url, "not-a-secret") as (status, _):
                assert status == 401
        assert _subscribers(running) == 0


# --- lane queue ---------------------------------------------------------------------------


def _kernel_running(node: SharedNode, lane: str) -> Callable[[], bool]:
    """Whether a kernel has started on one of the lane's in-process hosts."""
    sup = node.daemon.supervisor
    assert sup is not None
    hosts = node.inside(lambda: sup.owners[lane]._host_factory)
    assert isinstance(hosts, InProcessHosts)

    def started() -> bool:
        made: list[InProcessHost] = hosts.made[lane]
        return any(host.deadlines for host in made)

    return lambda: node.inside(started)


async def _lane_flood(
    node: SharedNode, invocation_id: str, extra: int
) -> tuple[list[httpx.Response], str, str]:
    accepted = await node.submit(gpu_request(invocation_id))
    lane, token = next(iter(accepted["tokens"].items()))
    sup = node.daemon.supervisor
    assert sup is not None
    queue = node.inside(lambda: sup.owners[lane].share)
    replies: list[httpx.Response] = []
    limits = httpx.Limits(max_connections=queue + extra + 8)
    async with httpx.AsyncClient(base_url=node.url, timeout=30, limits=limits) as client:

        async def work(body: dict[str, Any]) -> None:
            replies.append(
                await client.post(f"/v1/lanes/{lane}/work", json=body, headers=bearer(token))
            )

        async with trio.open_nursery() as nursery:
            # One long kernel holds the owner; everything else queues behind it.
            nursery.start_soon(work, {"op": "execute", "kernel": "sleep", "args": {"seconds": 1.5}})
            await until(_kernel_running(node, lane), "the long kernel running in the owner")
            for _ in range(queue + extra):
                nursery.start_soon(work, {"op": "execute", "kernel": "noop"})
    return replies, lane, token


async def test_exhaustion_lane_queue_flood_429_lane_busy(daemon: SharedDaemon) -> None:
    async with daemon.node() as node:
        replies, lane, _ = await _lane_flood(node, "lane-flood", extra=40)
        statuses = sorted({r.status_code for r in replies})
        assert statuses == [200, 429], statuses
        busy = [r for r in replies if r.status_code == 429]
        assert len(busy) >= 40 - 1
        assert {error_code(r) for r in busy} == {"lane_busy"}
        assert node.lane_bytes()[lane] == 0


async def test_exhaustion_lane_busy_has_retry_after(daemon: SharedDaemon) -> None:
    async with daemon.node() as node:
        replies, _, _ = await _lane_flood(node, "lane-busy", extra=10)
        busy = [r for r in replies if r.status_code == 429]
        assert busy
        for reply in busy:
            assert int(reply.headers["Retry-After"]) >= 1


async def test_exhaustion_junk_tokens_take_no_place_in_a_lane_queue(
    daemon: SharedDaemon,
) -> None:
    # An in-process host's `sleep` holds the owner (a real host has no such kernel).
    async with daemon.node() as node:
        lane, running = next(iter((await node.submit(gpu_request("running")))["tokens"].items()))
        tenant = (await node.submit(gpu_request("tenant")))["tokens"][lane]
        junk: list[httpx.Response] = []
        limits = httpx.Limits(max_connections=128)
        async with httpx.AsyncClient(base_url=node.url, timeout=30, limits=limits) as client:

            async def work(token: str, body: dict[str, Any]) -> httpx.Response:
                return await client.post(f"/v1/lanes/{lane}/work", json=body, headers=bearer(token))

            async def junk_work() -> None:
                junk.append(await work("v4.public.junk", {"op": "execute"}))

            held: list[httpx.Response] = []

            async def hold(body: dict[str, Any]) -> None:
                held.append(await work(running, body))

            async with trio.open_nursery() as nursery:
                # A long kernel holds the owner while the junk arrives.
                slow = {"op": "execute", "kernel": "sleep", "args": {"seconds": 1.5}}
                nursery.start_soon(hold, slow)
                await until(_kernel_running(node, lane), "the long kernel running in the owner")
                # Refused, never queued: queued junk would meet a full queue (429).
                with trio.fail_after(10):
                    async with trio.open_nursery() as flood:
                        for _ in range(100):
                            flood.start_soon(junk_work)
                assert [r.status_code for r in junk] == [401] * 100
                assert {error_code(r) for r in junk} == {"bad_encoding"}
                served = await work(tenant, {"op": "execute", "kernel": "noop"})
                assert served.status_code == 200, served.text
        assert [r.status_code for r in held] == [200], [r.text for r in held]


async def test_exhaustion_lane_work_without_a_valid_token_is_refused_before_the_body(
    daemon: SharedDaemon,
) -> None:
    async with daemon.node() as node:
        lane = (await node.lanes("gpu"))[0]
        target = f"/v1/lanes/{lane}/work"
        for headers, body in (
            ({}, b"{not json"),
            ({}, b"x" * (MAX_BODY_BYTES + 1)),
            ({"Authorization": "Bearer v4.public.junk"}, b"{not json"),
            ({"Authorization": "Bearer v4.public.junk"}, b"x" * (MAX_BODY_BYTES + 1)),
            ({"Authorization": "Bearer "}, b"[]"),
        ):
            reply = await raw_request(
                node.url, http_request("POST", target, headers=headers, body=body)
            )
            assert reply.status == 401, (headers, reply.body[:200])


# --- oversized bodies ---------------------------------------------------------------------


def _chunked(target: str, headers: dict[str, str], size: int) -> bytes:
    head = [f"POST {target} HTTP/1.1", "Host: x", "Connection: close"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    head += ["Content-Type: application/json", "Transfer-Encoding: chunked"]
    chunk = b"a" * 8192
    body = b""
    for _ in range(math.ceil(size / len(chunk))):
        body += f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body + b"0\r\n\r\n"


async def test_exhaustion_oversized_bodies_413(daemon: SharedDaemon) -> None:
    async with daemon.node() as node:
        accepted = await node.submit(sleep_request("holder"))
        lane, token = next(iter(accepted["tokens"].items()))
        before = await node.state()
        targets = {
            "/v1/invocations": {"Authorization": f"Bearer {node.scheduler}"},
            f"/v1/lanes/{lane}/work": {"Authorization": f"Bearer {token}"},
        }
        for target, headers in targets.items():
            big = http_request("POST", target, headers=headers, body=b" " * (MAX_BODY_BYTES + 1))
            reply = await raw_request(node.url, big)
            assert reply.status == 413, (target, reply.status, reply.body)
            assert reply.json()["error"]["code"] == "request_entity_too_large"
            # A Content-Length that lies about a huge body: refused before it is read.
            lie = http_request("POST", target, headers={**headers, "X-Pad": "1"}, body=b"{}")
            lie = lie.replace(b"Content-Length: 2", b"Content-Length: 1000000000000")
            reply = await raw_request(node.url, lie)
            assert reply.status == 413, (target, reply.status, reply.body)
            chunked = _chunked(target, headers, 4 * MAX_BODY_BYTES)
            reply = await raw_request(node.url, chunked)
            assert reply.status == 413, (target, reply.status, reply.body)
        assert await node.state() == before


async def test_exhaustion_oversized_headers_refused_server_survives(
    daemon: SharedDaemon,
) -> None:
    async with daemon.node() as node:
        before = await node.state()
        huge = http_request(
            "GET", "/v1/snapshot", headers={"Authorization": "Bearer " + "a" * 64 * 1024}
        )
        with contextlib.suppress(EOFError, trio.BrokenResourceError):
            reply = await raw_request(node.url, huge)
            assert 400 <= reply.status < 500, reply.status
        many = http_request("GET", "/healthz", headers={f"X-H{i}": "v" * 100 for i in range(400)})
        with contextlib.suppress(EOFError, trio.BrokenResourceError):
            reply = await raw_request(node.url, many)
            assert reply.status < 500, reply.status
        assert (await node.client.get("/healthz")).status_code == 200
        assert await node.state() == before


# --- slow clients ---------------------------------------------------------------------------


def test_exhaustion_server_timeouts_are_finite(tmp_path: pathlib.Path) -> None:
    config = hypercorn_config(http_settings(config_for(tmp_path)))
    assert config.read_timeout is not None and config.h11_max_incomplete_size is not None
    assert 0 < config.read_timeout <= 30
    assert 0 < config.keep_alive_timeout <= 30
    assert config.h11_max_incomplete_size <= 64 * 1024
    assert 0 < config.graceful_timeout <= 30


SHORT = 1.0


@pytest.fixture(scope="module")
def short_timeouts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedDaemon]:
    """A daemon with its own timeout options shortened (tests cannot wait 30 s)."""
    with shared_daemon(
        tmp_path_factory.mktemp("short-timeouts"),
        "--http-read-timeout",
        str(SHORT),
        "--http-keep-alive",
        str(SHORT),
        "--http-body-timeout",
        str(2 * SHORT),
    ) as shared:
        yield shared


class Cut:
    """How the server ended a slow client: seconds to the hang-up, and what it sent."""

    def __init__(self, seconds: float, received: bytes, answered_at: float | None) -> None:
        self.seconds = seconds
        self.received = received
        self.answered_at = answered_at

    @property
    def status(self) -> int | None:
        if not self.received.startswith(b"HTTP/1.1 "):
            return None
        return int(self.received.split(b" ", 2)[1])


async def _slow_client(url: str, first: bytes, drip: bytes, seconds: float) -> Cut:
    """Send `first`, then `drip` one byte every 0.2 s, until the server hangs up."""
    host, port = host_port(url)
    stream = await trio.open_tcp_stream(host, port)
    started = trio.current_time()
    received = b""
    answered_at: float | None = None
    async with stream:
        await stream.send_all(first)
        with trio.fail_after(seconds):
            async with trio.open_nursery() as nursery:

                async def dripper() -> None:
                    for byte in drip:
                        await trio.sleep(0.2)
                        try:
                            await stream.send_all(bytes([byte]))
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            return

                nursery.start_soon(dripper)
                try:
                    while data := await stream.receive_some(65536):
                        if answered_at is None:
                            answered_at = trio.current_time() - started
                        received += data
                except trio.BrokenResourceError:
                    pass
                nursery.cancel_scope.cancel()
    return Cut(trio.current_time() - started, received, answered_at)


async def test_exhaustion_idle_connection_disconnected(
    short_timeouts: SharedDaemon,
) -> None:
    async with short_timeouts.node() as node:
        cut = await _slow_client(node.url, b"", b"", 5 * SHORT)
        assert cut.seconds < 3 * SHORT and cut.received == b""


async def test_exhaustion_slowloris_header_drip_disconnected(
    short_timeouts: SharedDaemon,
) -> None:
    async with short_timeouts.node() as node:
        drip = b"X-Slow: " + b"a" * 200  # 40 s of headers at one byte per 0.2 s
        cut = await _slow_client(node.url, b"GET /healthz HTTP/1.1\r\nHost: x\r\n", drip, 10)
        assert cut.seconds < 4 * SHORT and cut.status in (None, 408)


async def test_exhaustion_body_never_finished_disconnected(
    short_timeouts: SharedDaemon,
) -> None:
    async with short_timeouts.node() as node:
        before = await node.state()
        head = http_request(
            "POST",
            "/v1/invocations",
            headers={"Authorization": f"Bearer {node.scheduler}"},
            body=b"{" + b" " * 99,
        )
        cut = await _slow_client(node.url, head[:-90], b"", 10)
        assert cut.seconds < 4 * SHORT and cut.status in (None, 408)
        assert await node.state() == before


async def test_exhaustion_body_drip_cut_by_body_timeout(
    short_timeouts: SharedDaemon,
) -> None:
    async with short_timeouts.node() as node:
        before = await node.state()
        head = http_request(
            "POST",
            "/v1/invocations",
            headers={"Authorization": f"Bearer {node.scheduler}"},
            body=b" " * 1000,
        )
        start = head[: -1000 + 1]
        cut = await _slow_client(node.url, start, b" " * 15, 15)
        assert cut.status == 408 and cut.answered_at is not None
        assert cut.answered_at < 2 * SHORT + 2
        assert b"request_timeout" in cut.received
        assert await node.state() == before


async def test_exhaustion_body_drip_hung_up_after_408(
    short_timeouts: SharedDaemon,
) -> None:
    async with short_timeouts.node() as node:
        head = http_request(
            "POST",
            "/v1/invocations",
            headers={"Authorization": f"Bearer {node.scheduler}"},
            body=b" " * 1000,
        )
        cut = await _slow_client(node.url, head[: -1000 + 1], b" " * 20, 15)
        assert cut.status == 408 and cut.answered_at is not None
        assert cut.seconds < cut.answered_at + SHORT
