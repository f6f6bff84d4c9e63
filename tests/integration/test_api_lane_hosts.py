"""Real lane host processes behind a running daemon: readiness waits for every
host's hello, a host that dies while idle is noticed and replaced at once, and
one that hangs while idle is found by the owner's heartbeat."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import pathlib
import signal
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import trio

from node.daemon import Daemon
from supervisor.core import Supervisor
from supervisor.lane_host import LaneHost
from supervisor.lane_owner import LaneOwner
from tests.api_fixtures import bearer, daemon_config, running_daemon
from tests.integration.test_api_lanes import gpu_request, submit
from tests.lanehost_fixtures import process_gone, wait_gone

TERMINAL = {"succeeded", "failed", "cancelled", "timed_out"}

# A host that waits for the gate file to exist, then becomes the real one.
GATED_HOST = """
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
os.execv(sys.executable, [sys.executable, "-P", "-m", "lanehost", *sys.argv[2:]])
"""


async def _until(check: Callable[[], Any], seconds: float = 30.0) -> Any:
    """Poll `check()` (awaited if it is a coroutine) until it returns something truthy."""
    with trio.fail_after(seconds):
        while True:
            found = check()
            if inspect.isawaitable(found):
                found = await found
            if found:
                return found
            await trio.sleep(0.05)


def _pid(host: object) -> int | None:
    return host.pid if isinstance(host, LaneHost) and host.running else None


def _host_pid(owner: LaneOwner) -> int | None:
    """The pid of the lane's sentinel host."""
    return _pid(owner.sentinel)


def _session_pid(owner: LaneOwner, invocation_id: str) -> int | None:
    session = owner.sessions.get(invocation_id)
    return None if session is None else _pid(session.host)


async def _reserve(client: httpx.AsyncClient, lane: str, token: str, nbytes: int) -> None:
    reserve = await client.post(
        f"/v1/lanes/{lane}/work",
        json={"op": "memory_reserve", "dtype": "uint8", "shape": [nbytes]},
        headers=bearer(token),
    )
    assert reserve.status_code == 200, reserve.text


async def _holder(client: httpx.AsyncClient, node: Any) -> tuple[str, str, LaneOwner]:
    """GPU work "holder" holding 1 MiB on its lane: the lane, its token, the lane's owner."""
    lane, token = next(iter((await submit(client, node, gpu_request("holder")))["tokens"].items()))
    await _reserve(client, lane, token, 2**20)
    sup = node.daemon.supervisor
    assert sup is not None
    return lane, token, sup.owners[lane]


async def test_a_session_host_killed_while_idle_ends_its_invocation_and_no_other(
    tmp_path: pathlib.Path,
) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        lane, _, owner = await _holder(client, node)
        neighbour = (await submit(client, node, gpu_request("neighbour")))["tokens"][lane]
        await _reserve(client, lane, neighbour, 2**10)
        pid, sentinel = _session_pid(owner, "holder"), _host_pid(owner)
        assert pid is not None and sentinel is not None and owner.used_bytes == 2**20 + 2**10
        assert pid != _session_pid(owner, "neighbour")  # a process each
        os.kill(pid, signal.SIGKILL)  # idle: nothing is asked of the lane after this

        async def ended() -> Any:
            found = await client.get("/v1/invocations/holder", headers=bearer(node.scheduler))
            return found.json() if found.json()["state"] in TERMINAL else None

        status = await _until(ended)
        assert (status["state"], status["reason"]) == ("cancelled", "lane_session_failed")
        assert await wait_gone(pid)
        assert owner.held_by("neighbour") == 2**10 and owner.used_bytes == 2**10
        assert _host_pid(owner) == sentinel and owner.host_starts == 1
        noop = await client.post(
            f"/v1/lanes/{lane}/work",
            json={"op": "execute", "kernel": "noop"},
            headers=bearer(neighbour),
        )
        assert noop.status_code == 200, noop.text
        assert (await client.get("/readyz")).status_code == 200


async def test_a_sentinel_killed_while_idle_is_replaced_and_nobody_is_cancelled(
    tmp_path: pathlib.Path,
) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        _, _, owner = await _holder(client, node)
        first = _host_pid(owner)
        assert first is not None
        os.kill(first, signal.SIGKILL)
        replaced = await _until(lambda: _host_pid(owner) not in (None, first))
        assert replaced and owner.host_starts == 2 and owner.held_by("holder") == 2**20
        assert await wait_gone(first)
        found = await client.get("/v1/invocations/holder", headers=bearer(node.scheduler))
        assert found.json()["state"] == "running"
        assert (await client.get("/readyz")).status_code == 200


@contextlib.asynccontextmanager
async def gated_daemon(
    tmp_path: pathlib.Path, *, open_gate: bool = False
) -> AsyncIterator[tuple[Supervisor, httpx.AsyncClient, pathlib.Path]]:
    """A daemon whose lane hosts greet only while the gate file exists (shut at
    first unless `open_gate`): its supervisor, a client, and the gate."""
    gate = tmp_path / "gate"
    if open_gate:
        gate.touch()
    script = tmp_path / "gated_host.py"
    script.write_text(GATED_HOST)
    command = json.dumps([sys.executable, str(script), str(gate)])
    daemon = Daemon(daemon_config(tmp_path, "--lane-host-command", command), handle_signals=False)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(daemon.run)
        try:
            await _until(lambda: daemon.url and daemon.supervisor is not None)
            assert daemon.supervisor is not None
            async with httpx.AsyncClient(base_url=daemon.url, timeout=10) as client:
                yield daemon.supervisor, client, gate
        finally:
            daemon.stop.set()
            nursery.cancel_scope.deadline = trio.current_time() + 30


def _is_ready(client: httpx.AsyncClient) -> Callable[[], Any]:
    async def ready() -> bool:
        return (await client.get("/readyz")).status_code == 200

    return ready


def _not_ready(client: httpx.AsyncClient) -> Callable[[], Any]:
    async def not_ready() -> httpx.Response | None:
        reply = await client.get("/readyz")
        return reply if reply.status_code == 503 else None

    return not_ready


async def test_readyz_waits_for_every_lane_host_and_names_one_restarting(
    tmp_path: pathlib.Path,
) -> None:
    async with gated_daemon(tmp_path) as (sup, client, gate):
        # No host has answered its hello: not ready, every lane named.
        waiting = await client.get("/readyz")
        assert waiting.status_code == 503
        reason = waiting.json()["error"]["details"]["reasons"]["lane_hosts"]
        for lane_id in sup.owners:
            assert f"{lane_id} (starting)" in reason
        gate.touch()
        await _until(_is_ready(client))
        # One host dies and its replacement is slow to greet: named as restarting.
        gate.unlink()
        lane_id, owner = next(iter(sorted(sup.owners.items())))
        pid = _host_pid(owner)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        reply = await _until(_not_ready(client))
        reason = reply.json()["error"]["details"]["reasons"]["lane_hosts"]
        assert f"{lane_id} (restarting: crashed" in reason
        assert all(other not in reason for other in sup.owners if other != lane_id)
        gate.touch()
        await _until(_is_ready(client))


async def test_a_stopped_idle_host_is_found_by_heartbeat_and_readyz_names_its_lane(
    tmp_path: pathlib.Path,
) -> None:
    """A SIGSTOPped host neither exits nor answers: the owner's heartbeat finds it
    while idle (no request is made), kills it and starts another; /readyz names
    the lane until the replacement greets (held here at the gate)."""
    stopped: int | None = None
    async with gated_daemon(tmp_path, open_gate=True) as (sup, client, gate):
        try:
            await _until(_is_ready(client))
            gate.unlink()  # the replacement will wait to greet
            lane_id, owner = next(iter(sorted(sup.owners.items())))
            stopped = _host_pid(owner)
            assert stopped is not None
            os.kill(stopped, signal.SIGSTOP)
            # A heartbeat after 2 s of quiet, 2 s to answer it: found within 5 s.
            reply = await _until(_not_ready(client), seconds=5)
            reason = reply.json()["error"]["details"]["reasons"]["lane_hosts"]
            assert f"{lane_id} (restarting: timeout" in reason
            assert all(other not in reason for other in sup.owners if other != lane_id)
            assert await wait_gone(stopped)  # killed, though stopped
            gate.touch()
            await _until(_is_ready(client))
            assert _host_pid(owner) not in (None, stopped) and owner.host_starts == 2
        finally:
            if stopped is not None and not process_gone(stopped):
                os.kill(stopped, signal.SIGKILL)
