"""A fake Kubernetes API server on loopback: enough of `resource.k8s.io/v1` for the
real client library (lightkube) to read ResourceClaims and to list, create, replace and
delete ResourceSlices,
each request recorded, every stored object given a resourceVersion as the API server
does; a PUT with a stale one is refused 409."""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import shutil
import tempfile
import urllib.parse
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import trio
from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from lightkube.config.models import Cluster, User

from kubeplugin.contracts import dra_health_pb2, dra_health_pb2_grpc
from kubeplugin.health import DeviceHealthReading
from kubeplugin.server import ClaimHandler, RegistrationState, serve_plugin
from kubeplugin.sockets import DRIVER_NAME, PluginSockets

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLAIMS = re.compile(r"/apis/resource\.k8s\.io/v1/namespaces/([^/]+)/resourceclaims/([^/]+)")


class FakeApiServer:
    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        # ResourceClaims by (namespace, name), served read-only.
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        # Set: every connection is closed unanswered (an API server out of reach).
        self.unreachable = False
        # What the API server makes of an object it stores (its own form of it).
        self.normalize: Callable[[dict[str, Any]], dict[str, Any]] = lambda obj: obj
        self._version = 0
        self.url = ""

    def _stored(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = self.normalize(obj)
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)
        self.slices[obj["metadata"]["name"]] = obj
        return obj

    def answer(self, method: str, target: str, body: bytes) -> tuple[int, dict[str, Any]]:
        parsed = urllib.parse.urlsplit(target)
        self.requests.append((method, parsed.path))
        if (claim := CLAIMS.fullmatch(parsed.path)) is not None:
            found = self.claims.get((claim.group(1), claim.group(2)))
            if method != "GET" or found is None:
                return 404, _status(404, "NotFound")
            return 200, found
        name = parsed.path.removeprefix(SLICES).strip("/")
        if method == "GET" and not name:
            query = urllib.parse.parse_qs(parsed.query)
            wanted = dict(
                pair.split("=", 1) for q in query.get("fieldSelector", []) for pair in q.split(",")
            )
            items = [
                s for s in self.slices.values()
                if all(_field(s, key) == value for key, value in wanted.items())
            ]  # fmt: skip
            return 200, {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                "metadata": {"resourceVersion": str(self._version)}, "items": items,
            }  # fmt: skip
        if method == "POST" and not name:
            obj = json.loads(body)
            if obj["metadata"]["name"] in self.slices:
                return 409, _status(409, "AlreadyExists")
            return 201, self._stored(obj)
        if name not in self.slices:
            return 404, _status(404, "NotFound")
        if method == "PUT":
            obj = json.loads(body)
            if (
                obj["metadata"].get("resourceVersion")
                != self.slices[name]["metadata"]["resourceVersion"]
            ):
                return 409, _status(409, "Conflict")
            return 200, self._stored(obj)
        if method == "DELETE":
            del self.slices[name]
            return 200, _status(200, "Success")
        return 405, _status(405, "MethodNotAllowed")

    async def handle(self, stream: trio.SocketStream) -> None:
        data = b""
        async with stream:
            if self.unreachable:
                return
            while b"\r\n\r\n" not in data:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, target, _version = lines[0].split(" ", 2)
            headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
            length = int(headers.get("content-length", "0"))
            while len(body) < length:
                body += await stream.receive_some(65536)
            status, answer = self.answer(method, target, body)
            payload = json.dumps(answer).encode()
            await stream.send_all(
                f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                + payload
            )


def _field(obj: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        obj = obj.get(part, {}) if isinstance(obj, dict) else {}
    return obj


def _status(code: int, reason: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure" if code >= 400 else "Success",
            "code": code, "reason": reason, "message": reason}  # fmt: skip


def client_for(url: str) -> AsyncClient:
    config = KubeConfig.from_one(cluster=Cluster(server=url), user=User(token="test-token"))
    return AsyncClient(config)


@contextlib.asynccontextmanager
async def fake_api_server() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer()
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        server.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        nursery.start_soon(trio.serve_listeners, server.handle, listeners)
        yield server
        nursery.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def plugin(
    handler: ClaimHandler,
    call_seconds: float = 30.0,
    health: Callable[[], Sequence[DeviceHealthReading]] | None = None,
) -> AsyncIterator[tuple[PluginSockets, RegistrationState]]:
    base = pathlib.Path(tempfile.mkdtemp(prefix="lg-dra-", dir="/tmp"))  # short socket paths
    try:
        sockets = PluginSockets.for_driver(
            DRIVER_NAME, registry=base / "plugins_registry", plugins=base / "plugins"
        )
        async with trio.open_nursery() as nursery:
            state = await nursery.start(
                lambda task_status: serve_plugin(
                    sockets,
                    handler,
                    call_seconds=call_seconds,
                    health=health,
                    pool="node-a",
                    task_status=task_status,
                )
            )
            yield sockets, state
            nursery.cancel_scope.cancel()
        assert not sockets.registration.exists() and not sockets.service.exists()
    finally:
        shutil.rmtree(base)


def _call(path: pathlib.Path, stub_type: Any, method: str, request: Any) -> Any:
    """One call as kubelet makes it (blocking: run it off the trio thread)."""
    with grpc.insecure_channel(f"unix://{path}") as channel:
        return getattr(stub_type(channel), method)(request, timeout=45)


async def kubelet(path: pathlib.Path, stub_type: Any, method: str, request: Any) -> Any:
    return await trio.to_thread.run_sync(_call, path, stub_type, method, request)


def _read_health(path: pathlib.Path, messages: int, got: Callable[[Any], None]) -> None:
    """Read the first `messages` of a health stream as kubelet does (blocking), each
    handed to `got` in trio as it comes."""
    with grpc.insecure_channel(f"unix://{path}") as channel:
        stream = dra_health_pb2_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
            dra_health_pb2.NodeWatchResourcesRequest(), timeout=30
        )
        for _ in range(messages):
            trio.from_thread.run_sync(got, next(stream))
        stream.cancel()


@contextlib.asynccontextmanager
async def health_stream(path: pathlib.Path, messages: int) -> AsyncIterator[Any]:
    """kubelet's health stream on the plugin's socket: the first `messages` of it, each
    received from the channel yielded as it comes."""
    send, received = trio.open_memory_channel[Any](messages)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, _read_health, path, messages, send.send_nowait)
        yield received
