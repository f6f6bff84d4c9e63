"""The transport: what a client can do to a connection must not reach the server.

The daemon speaks HTTP/1.1 only. A cleartext HTTP/2 client (prior knowledge or
`Upgrade: h2c`) gets no HTTP/2; a fault inside one connection ends that
connection, never `serve_http`, the supervisor or running work.
"""

from __future__ import annotations

import logging
import pathlib

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h11
import pytest
import quart
import trio
from hypercorn.protocol.h11 import H11Protocol
from quart_trio import QuartTrio

from api.server import serve_http
from api.settings import HttpSettings
from tests.adversarial.fixtures import (
    host_port,
    http_request,
    raw_request,
    running_node,
    sleep_request,
)

pytestmark = pytest.mark.hostile("exhaustion")

BODY = 100 * 1024  # more than HTTP/2's initial 64 KiB flow-control window


async def _h2c_post(url: str, path: str, headers: list[tuple[str, str]]) -> list[object]:
    """A prior-knowledge h2c POST of BODY bytes, sending the body even after an answer,
    as an attacker would. Returns the h2 events seen until the server stops."""
    host, port = host_port(url)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    stream_id = conn.get_next_available_stream_id()
    conn.send_headers(
        stream_id,
        [(":method", "POST"), (":path", path), (":scheme", "http"), (":authority", host), *headers],
    )
    seen: list[object] = []
    sent = 0
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        with trio.move_on_after(3):
            try:
                while True:
                    room = min(conn.local_flow_control_window(stream_id), BODY - sent)
                    room = min(room, conn.max_outbound_frame_size)
                    if room > 0:
                        conn.send_data(stream_id, b"x" * room, end_stream=sent + room == BODY)
                        sent += room
                    await stream.send_all(conn.data_to_send())
                    data = await stream.receive_some(65536)
                    if not data:
                        break
                    events = conn.receive_data(data)
                    seen.extend(events)
                    if any(isinstance(e, h2.events.ConnectionTerminated) for e in events):
                        break
            except (trio.BrokenResourceError, h2.exceptions.ProtocolError):
                pass  # the server hung up or refused: fine, so long as it lives
    return seen


async def test_transport_h2c_prior_knowledge_with_a_large_body_leaves_the_daemon_running(
    tmp_path: pathlib.Path,
) -> None:
    async with running_node(tmp_path) as node:
        await node.submit(sleep_request("survivor"))
        before = await node.state()
        for path, headers in (
            ("/v1/invocations", []),  # answered early: 401
            ("/v1/invocations", [("content-length", str(BODY))]),  # answered early: 413
            ("/v1/lanes/lane_0000000000000000/work", [("authorization", "Bearer v4.public.x")]),
        ):
            seen = await _h2c_post(node.url, path, headers)
            # HTTP/2 is refused outright: GOAWAY(HTTP_1_1_REQUIRED), no response.
            goaway = [e for e in seen if isinstance(e, h2.events.ConnectionTerminated)]
            assert goaway and goaway[0].error_code == h2.errors.ErrorCodes.HTTP_1_1_REQUIRED
            assert not any(isinstance(e, h2.events.ResponseReceived) for e in seen)
        # Still serving, the supervisor still runs, and running work is untouched.
        assert (await node.client.get("/healthz")).status_code == 200
        assert node.daemon.supervisor is not None and node.daemon.supervisor.accepting
        assert await node.state() == before
        status = await node.client.get("/v1/invocations/survivor", headers=node.op)
        assert status.json()["state"] == "running"


async def test_transport_h2c_upgrade_is_answered_over_http_1_1(tmp_path: pathlib.Path) -> None:
    async with running_node(tmp_path) as node:
        request = http_request(
            "GET",
            "/healthz",
            headers={
                "Connection": "Upgrade, HTTP2-Settings",
                "Upgrade": "h2c",
                "HTTP2-Settings": "AAMAAABkAAQAAP__",
            },
        )
        reply = await raw_request(node.url, request)
        assert reply.status == 200 and reply.json() == {"status": "ok"}


@pytest.mark.parametrize(
    "host",
    ["a" * 64, "a" * 64 + ".example:7380", "b." + "c" * 70, "x..y", ".", "127.0.0.1:80"],
    ids=["label-64", "label-64-port", "second-label-70", "empty-label", "dot", "port-80"],
)
async def test_transport_a_host_idna_refuses_is_400_in_the_envelope_and_logs_no_traceback(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, host: str
) -> None:
    """A Host label over 63 characters (or an empty one) once made every request 500
    with a 40-line traceback in the log, before any credential was checked."""
    async with running_node(tmp_path) as node:
        before = await node.state()
        caplog.clear()
        with caplog.at_level(logging.INFO):
            for target in ("/healthz", "/v1/snapshot", "/no/such/route"):
                request = f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
                reply = await raw_request(node.url, request.encode())
                if host == "127.0.0.1:80":  # a good one still reaches the routes
                    assert reply.status in (200, 401, 404), reply.body
                    continue
                assert reply.status == 400, (target, reply.status, reply.body)
                assert reply.json()["error"]["code"] == "bad_host", reply.body
        noisy = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
        assert not noisy, [r.getMessage() for r in noisy]
        assert await node.state() == before
        assert (await node.client.get("/healthz")).status_code == 200


async def test_transport_an_error_inside_one_connection_closes_only_that_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    create_stream = H11Protocol._create_stream

    async def fail_on_boom(self: H11Protocol, request: h11.Request) -> None:
        if request.target == b"/boom":
            raise RuntimeError("a fault inside the HTTP/1.1 protocol")
        await create_stream(self, request)

    monkeypatch.setattr(H11Protocol, "_create_stream", fail_on_boom)
    app = QuartTrio("transport")

    @app.get("/ok")
    async def ok() -> str:
        return "ok"

    settings = HttpSettings("127.0.0.1:0", 5.0, 5.0, 5.0, metrics_auth=False)
    stop = trio.Event()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve_http, app, settings, stop)
            url = binds[0]
            with pytest.raises((EOFError, trio.BrokenResourceError)):
                await raw_request(url, http_request("GET", "/boom"))
            for _ in range(3):
                assert (await raw_request(url, http_request("GET", "/ok"))).body == b"ok"
            stop.set()


async def _answer(stream: trio.SocketStream, client: h11.Connection) -> h11.Response:
    """Read one whole response on `stream`; its head."""
    response: h11.Response | None = None
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            client.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.EndOfMessage):
            assert response is not None
            return response


@pytest.mark.parametrize("body_first", [True, False], ids=["body-sent", "body-not-sent-yet"])
async def test_transport_an_answer_before_the_whole_body_says_the_connection_closes(
    body_first: bool,
) -> None:
    # A client reuses a connection whose answer did not say "close". An answer given
    # before the request's body has all arrived (a refusal that reads no body) ends the
    # connection, so it must say so; otherwise the client's next request on it finds
    # the connection closed with no answer.
    app = QuartTrio("transport")

    @app.post("/early")
    async def early() -> tuple[str, int]:
        return "refused", 401  # the body is never read

    @app.post("/read")
    async def read() -> bytes:
        return await quart.request.get_data()

    settings = HttpSettings("127.0.0.1:0", 5.0, 5.0, 5.0, metrics_auth=False)
    stop = trio.Event()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            host, port = host_port((await nursery.start(serve_http, app, settings, stop))[0])
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                client = h11.Connection(h11.CLIENT)
                head = [("Host", "x"), ("Content-Length", "4")]
                for target in ("/read", "/read"):  # a body read whole: the connection stays
                    request = h11.Request(method="POST", target=target, headers=head)
                    await stream.send_all(client.send(request) + client.send(h11.Data(b"ping")))
                    await stream.send_all(client.send(h11.EndOfMessage()))
                    assert (await _answer(stream, client)).status_code == 200
                    assert client.our_state is h11.DONE and client.their_state is h11.DONE
                    client.start_next_cycle()
                await stream.send_all(
                    client.send(h11.Request(method="POST", target="/early", headers=head))
                )
                if body_first:
                    await stream.send_all(client.send(h11.Data(b"pi")))  # half the body
                answer = await _answer(stream, client)
                assert answer.status_code == 401
                assert (b"connection", b"close") in answer.headers, answer.headers
                assert await stream.receive_some(65536) == b""  # and it does close
            stop.set()
