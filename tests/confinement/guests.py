"""A daemon with confined guests, and helpers to run a guest and inspect it from the host."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import trio

from tests.adversarial.fixtures import Node, running_node
from tests.helpers import GUEST_PYTHON, guest_cwd

TERMINAL = {"succeeded", "failed", "cancelled", "timed_out"}
WAIT_SECONDS = 30.0


@contextlib.asynccontextmanager
async def confined_node(tmp_path: pathlib.Path, *argv: str) -> AsyncIterator[Node]:
    async with running_node(tmp_path, *argv) as node:
        yield node


def process(argv: list[str], *, invocation_id: str | None = None, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": invocation_id or f"g-{uuid.uuid4().hex[:12]}",
        "work": {"kind": "process", "argv": argv},
        "requirement": "cpu",
        "resources": {"cpu_millis": 500, "memory_bytes": 256 * 2**20},
    }
    for key in ("env", "cwd", "network"):
        if key in fields:
            body["work"][key] = fields.pop(key)
    body.update(fields)
    return body


def python(code: str, **fields: Any) -> dict[str, Any]:
    return process([GUEST_PYTHON, "-c", code], **fields)


async def status(node: Node, invocation_id: str) -> dict[str, Any]:
    reply = await node.client.get(f"/v1/invocations/{invocation_id}", headers=node.op)
    assert reply.status_code == 200, reply.text
    data: dict[str, Any] = reply.json()
    return data


async def run_to_end(node: Node, body: dict[str, Any]) -> dict[str, Any]:
    await node.submit(body)
    with trio.fail_after(WAIT_SECONDS):
        while (found := await status(node, body["id"]))["state"] not in TERMINAL:  # noqa: ASYNC110
            await trio.sleep(0.05)
    return found


async def guest_pid(node: Node, invocation_id: str, marker: str) -> int:
    """The host pid of the guest process whose command line holds `marker`."""
    sup = node.daemon.supervisor
    assert sup is not None
    with trio.fail_after(WAIT_SECONDS):
        while True:
            live = sup._live.get(invocation_id)
            leader = live.pid if live is not None else None
            if leader is not None:
                for pid in descendants(leader):
                    with contextlib.suppress(OSError):
                        cmdline = await trio.Path(f"/proc/{pid}/cmdline").read_bytes()
                        if marker.encode() in cmdline and b"bwrap" not in cmdline:
                            return pid
            await trio.sleep(0.05)


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rpartition(")")[2].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def uid_of(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for {pid}")


def alive(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_gone(pids: list[int], seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


__all__ = [
    "GUEST_PYTHON",
    "alive",
    "confined_node",
    "descendants",
    "guest_cwd",
    "guest_pid",
    "kill_all",
    "process",
    "python",
    "run_to_end",
    "status",
    "uid_of",
    "wait_gone",
]
