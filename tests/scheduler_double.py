"""A tiny scheduler on loopback that accepts only pushes a node really signed.

It knows each node's address (`register`), fetches the node's published keys
from `GET /v1/keys` when it meets a key id it does not hold, and checks every
push with `PushVerifier`; with `bearer` set it first demands that credential
(`Authorization: Bearer`, else `bad_bearer`). It answers 204 to a verified
push and 401 with `{"refused": "<reason>"}` to anything else, and records both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import msgspec
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from capabilities import KeySet
from capabilities.push_signature import (
    SIGNATURE_HEADER,
    PushRefusal,
    PushRefused,
    PushVerifier,
    keys_of,
)

MAX_HEAD = 16 * 1024
BAD_BEARER = "bad_bearer"
MAX_BODY = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Received:
    node_id: str
    headers: dict[str, str]
    body: bytes


@dataclasses.dataclass
class Scheduler:
    client: httpx.AsyncClient
    url: str = ""
    nodes: dict[str, str] = dataclasses.field(default_factory=dict)
    keys: dict[str, dict[str, Ed25519PublicKey]] = dataclasses.field(default_factory=dict)
    verifiers: dict[str, PushVerifier] = dataclasses.field(default_factory=dict)
    accepted: list[Received] = dataclasses.field(default_factory=list)
    refused: list[tuple[Received, str]] = dataclasses.field(default_factory=list)
    bearer: str | None = None
    key_fetches: int = 0
    arrived: trio.Event = dataclasses.field(default_factory=trio.Event)

    def register(self, node_id: str, node_url: str) -> None:
        self.nodes[node_id] = node_url
        self.keys[node_id] = {}
        self.verifiers[node_id] = PushVerifier(
            node_id, self.url, functools.partial(self._key, node_id)
        )

    def _key(self, node_id: str, kid: str) -> Ed25519PublicKey | None:
        return self.keys[node_id].get(kid)

    def from_node(self, node_id: str) -> list[Received]:
        return [p for p in self.accepted if p.node_id == node_id]

    async def wait_for(self, count: int, node_id: str, seconds: float = 10) -> None:
        with trio.fail_after(seconds):
            while len(self.from_node(node_id)) < count:
                await self.arrived.wait()

    async def _refresh_keys(self, node_id: str) -> None:
        self.key_fetches += 1
        with trio.fail_after(5):
            reply = await self.client.get(f"{self.nodes[node_id]}/v1/keys")
        reply.raise_for_status()
        self.keys[node_id] = keys_of(msgspec.json.decode(reply.content, type=KeySet))

    async def check(self, push: Received) -> str | None:
        if self.bearer is not None:
            given = push.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {self.bearer}".encode()):
                return BAD_BEARER
        verifier = self.verifiers.get(push.node_id)
        if verifier is None:
            return PushRefusal.UNKNOWN_KEY  # a node this scheduler never registered
        signature = push.headers.get(SIGNATURE_HEADER)
        try:
            try:
                verifier.verify(signature, push.body)
            except PushRefused as refused:
                if refused.reason is not PushRefusal.UNKNOWN_KEY:
                    raise
                # A key it does not hold yet (a restart, a rotation): fetch once, try once more.
                await self._refresh_keys(push.node_id)
                verifier.verify(signature, push.body)
        except PushRefused as refused:
            return refused.reason
        return None

    async def handle(self, stream: trio.SocketStream) -> None:
        buffer = b""
        async with stream:
            while (request := await read_request(stream, buffer)) is not None:
                headers, body, buffer = request
                push = Received(headers.get("x-node-id", ""), headers, body)
                reason = await self.check(push)
                if reason is None:
                    self.accepted.append(push)
                    answer = b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n"
                else:
                    self.refused.append((push, reason))
                    text = msgspec.json.encode({"refused": reason})
                    answer = (
                        b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(text), text)
                    )
                self.arrived.set()
                self.arrived = trio.Event()
                await stream.send_all(answer)


async def read_request(
    stream: trio.SocketStream, buffer: bytes
) -> tuple[dict[str, str], bytes, bytes] | None:
    """(headers, body, bytes left over) of the next request; None when the peer is done."""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        if not data or len(buffer) > MAX_HEAD:
            return None
        buffer += data
    head, _, buffer = buffer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    length = int(headers.get("content-length", "0"))
    if length > MAX_BODY:
        return None
    while len(buffer) < length:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buffer += data
    return headers, buffer[:length], buffer[length:]


async def serve_loopback(
    nursery: trio.Nursery, handler: Callable[[trio.SocketStream], Awaitable[None]]
) -> str:
    """Serve `handler` on 127.0.0.1, a free port; the telemetry URL on it."""
    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1/telemetry"


@contextlib.asynccontextmanager
async def scheduler(*, bearer: str | None = None) -> AsyncIterator[Scheduler]:
    async with (
        httpx.AsyncClient(timeout=5) as client,
        trio.open_nursery() as nursery,
    ):
        state = Scheduler(client, bearer=bearer)
        state.url = await serve_loopback(nursery, state.handle)
        yield state
        nursery.cancel_scope.cancel()
