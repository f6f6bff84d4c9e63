"""Shared helpers of the adversarial suite: daemons, raw HTTP, crafted tokens, state.

Every daemon here listens on 127.0.0.1 port 0 and is stopped (bounded) however the
test ends; subprocess daemons are killed and reaped by `tests.helpers.spawned`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import subprocess
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import psutil  # type: ignore[import-untyped]
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from capabilities import paseto
from node.config import Config
from node.daemon import Daemon
from supervisor.sandbox import STAGE_PATH
from tests.api_fixtures import bearer, daemon_config, running_daemon
from tests.helpers import clean_env, node_command, spawned, wait_for_line

LISTENING = r"listening on (http://\S+)"
GiB = 2**30
MiB = 2**20


def config_for(tmp_path: pathlib.Path, *argv: str, devices: str = "sim") -> Config:
    """A Config exactly as `serve` builds it from argv: loopback, port 0, state in tmp."""
    return daemon_config(tmp_path, *argv, devices=devices)


@dataclasses.dataclass
class Node:
    """A running in-process daemon and an HTTP client for it."""

    url: str
    scheduler: str
    admin: str
    daemon: Daemon
    client: httpx.AsyncClient

    @property
    def op(self) -> dict[str, str]:
        return bearer(self.scheduler)

    @property
    def adm(self) -> dict[str, str]:
        return bearer(self.admin)

    async def snapshot(self) -> dict[str, Any]:
        reply = await self.client.get("/v1/snapshot", headers=self.op)
        assert reply.status_code == 200, reply.text
        data: dict[str, Any] = reply.json()
        return data

    async def capacity(self) -> dict[str, Any]:
        return dict((await self.snapshot())["capacity"])

    async def invocation_ids(self) -> set[str]:
        reply = await self.client.get("/v1/invocations", headers=self.op)
        assert reply.status_code == 200, reply.text
        return {inv["id"] for inv in reply.json()["invocations"]}

    async def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        reply = await self.client.post("/v1/invocations", json=body, headers=self.op)
        assert reply.status_code == 202, reply.text
        data: dict[str, Any] = reply.json()
        return data

    async def lanes(self, kind: str) -> list[str]:
        lanes = (await self.snapshot())["lanes"]
        return [lane["lane_id"] for lane in lanes if lane["kind"] == kind]

    def live_tokens(self) -> int:
        sup = self.daemon.supervisor
        assert sup is not None
        return sup.tokens.live_tokens

    def lane_bytes(self) -> dict[str, int]:
        sup = self.daemon.supervisor
        assert sup is not None
        return {lane_id: owner.used_bytes for lane_id, owner in sup.owners.items()}

    def ledger_reservations(self) -> set[str]:
        machine = self.daemon.machine
        assert machine is not None
        return set(machine.ledger.reservations())

    def journal_reservations(self) -> set[str]:
        machine = self.daemon.machine
        assert machine is not None
        return set(machine.journal.reservations())

    async def state(self) -> NodeState:
        """Everything a refused request must leave unchanged."""
        return NodeState(
            capacity=await self.capacity(),
            invocations=frozenset(await self.invocation_ids()),
            live_tokens=self.live_tokens(),
            lane_bytes=self.lane_bytes(),
            ledger=frozenset(self.ledger_reservations()),
            journal=frozenset(self.journal_reservations()),
        )


@dataclasses.dataclass(frozen=True)
class NodeState:
    capacity: dict[str, Any]
    invocations: frozenset[str]
    live_tokens: int
    lane_bytes: dict[str, int]
    ledger: frozenset[str]
    journal: frozenset[str]


@contextlib.asynccontextmanager
async def running_node(
    tmp_path: pathlib.Path,
    *argv: str,
    devices: str = "sim",
    pynvml_module: Any = None,
    client_timeout: float = 10.0,
    limits: httpx.Limits | None = None,
) -> AsyncIterator[Node]:
    """`running_daemon` (started and stopped the same way) with an HTTP client for it."""
    async with running_daemon(
        tmp_path, *argv, devices=devices, pynvml_module=pynvml_module
    ) as running:
        async with httpx.AsyncClient(
            base_url=running.url, timeout=client_timeout, limits=limits or httpx.Limits()
        ) as client:
            yield Node(running.url, running.scheduler, running.admin, running.daemon, client)


def sleep_request(invocation_id: str, seconds: float = 60, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": invocation_id,
        "work": {"kind": "builtin", "name": "sleep", "args": {"seconds": seconds}},
        "resources": {"cpu_millis": 10, "memory_bytes": MiB},
    }
    body.update(fields)
    return body


def gpu_request(invocation_id: str, vram: int = GiB, seconds: float = 60) -> dict[str, Any]:
    return sleep_request(
        invocation_id,
        seconds,
        requirement="gpu",
        # Its lane sessions' hosts are charged to it: a fifth of a CPU starts one briskly.
        resources={"cpu_millis": 200, "memory_bytes": MiB, "gpus": 1, "vram_bytes": vram},
    )


def error_code(reply: httpx.Response) -> str:
    code: str = reply.json()["error"]["code"]
    return code


# --- raw HTTP: exact bytes on the wire, no client normalisation -----------------


@dataclasses.dataclass
class RawReply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def host_port(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


async def raw_request(url: str, data: bytes, *, seconds: float = 10.0) -> RawReply:
    """Send `data` as is on a fresh connection; read one Content-Length response."""
    host, port = host_port(url)
    with trio.fail_after(seconds):
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            await stream.send_all(data)
            buffer = b""
            while b"\r\n\r\n" not in buffer:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    raise EOFError(f"connection closed before a response: {buffer!r}")
                buffer += chunk
            head, _, body = buffer.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            while len(body) < length:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                body += chunk
            return RawReply(status, headers, body)


def http_request(
    method: str,
    target: str,
    *,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    content_type: str | None = "application/json",
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body or method in ("POST", "PUT"):
        if content_type:
            lines.append(f"Content-Type: {content_type}")
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8") + body


# --- crafted tokens ---------------------------------------------------------------


def claims_of(token: str) -> dict[str, Any]:
    parsed = paseto.parse(token)
    data: dict[str, Any] = json.loads(parsed.payload)
    return data


def footer_of(token: str) -> bytes:
    return paseto.parse(token).footer


def craft(
    secret: Ed25519PrivateKey,
    claims: dict[str, Any] | bytes,
    *,
    footer: bytes,
    node_id: str,
    header: str = paseto.HEADER,
) -> str:
    """A token signed with `secret` over exactly these claims/footer, bound to `node_id`."""
    payload = claims if isinstance(claims, bytes) else json.dumps(claims).encode()
    implicit = json.dumps({"node_id": node_id}, separators=(",", ":")).encode()
    token = paseto.sign(secret, payload, footer=footer, implicit=implicit)
    return header + token[len(paseto.HEADER) :]


def kid_footer(kid: str) -> bytes:
    return json.dumps({"kid": kid}, separators=(",", ":")).encode()


def fresh_kid() -> tuple[Ed25519PrivateKey, str]:
    key = Ed25519PrivateKey.generate()
    return key, paseto.paserk_pid(key.public_key())


# --- subprocess daemons -----------------------------------------------------------


@contextlib.contextmanager
def subprocess_node(
    state_dir: pathlib.Path, *argv: str, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], str, dict[str, str]]]:
    """(process, url, operator headers) of a `serve` child; killed however the test ends."""
    command = node_command(
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--state-dir",
        str(state_dir),
        "--devices",
        "sim",
        "--health-interval",
        "3600",
        "--shutdown-grace",
        "0",
        *argv,
    )
    with spawned(command, env or clean_env()) as proc:
        url = wait_for_line(proc, LISTENING)
        wait_ready(url)
        secret = json.loads((state_dir / "auth.json").read_text())["scheduler"]
        yield proc, url, bearer(secret)


def wait_ready(url: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=url, timeout=5) as client:
        while time.monotonic() < deadline:
            if client.get("/readyz").status_code == 200:
                return
            time.sleep(0.05)
    raise AssertionError("the daemon never became ready")


def rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def descendants(pid: int) -> list[psutil.Process]:
    try:
        children: list[psutil.Process] = psutil.Process(pid).children(recursive=True)
        return children
    except psutil.NoSuchProcess:
        return []


def live_command_lines(pid: int) -> list[list[str]]:
    """The command lines of `pid`'s descendants that still run: a zombie (ended, not yet
    reaped by its parent) holds nothing and is left out, as is one gone meanwhile."""
    lines = []
    for child in descendants(pid):
        try:
            lines.append(child.cmdline())
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return lines


def guest_command_lines(pid: int) -> list[list[str]]:
    """The command lines of the daemon `pid`'s guests that still run: its descendants but
    its lane hosts (one per lane, for its whole life), bubblewrap and litegraph-gate
    inside it (a ready sandbox's stage, waiting for a guest, or a guest's keeper)."""
    return [
        line
        for line in live_command_lines(pid)
        if "lanehost" not in line and not any(STAGE_PATH in arg for arg in line)
    ]


TERMINAL = frozenset({"succeeded", "failed", "cancelled", "timed_out", "rejected"})


async def wait_for_state(
    node: Node, invocation_id: str, states: frozenset[str] = TERMINAL, seconds: float = 10.0
) -> dict[str, Any]:
    """Poll one invocation until its state is in `states` (bounded)."""
    with trio.fail_after(seconds):
        while True:
            reply = await node.client.get(f"/v1/invocations/{invocation_id}", headers=node.op)
            assert reply.status_code == 200, reply.text
            status: dict[str, Any] = reply.json()
            if status["state"] in states:
                return status
            await trio.sleep(0.02)
