"""The work a lane does for an invocation is charged to it: its lane session's host runs
in the invocation's own cgroup, within its CPU quota and memory limit, and its
status's `usage` counts what the host spent (the real kernel's cgroups)."""

from __future__ import annotations

import os
import pathlib
import time
from typing import Any

import trio

from supervisor.lane_host import LaneHost
from tests.adversarial.fixtures import Node
from tests.confinement.guests import TERMINAL, confined_node, status
from tests.confinement.test_guest_tokens import gpu_sandbox

SIDE = 1024  # a float32 matmul of this side: about 2 GFLOP, tens of ms on one core

# The guest drives back-to-back matmuls on its lane for a few seconds of wall time.
MATMULS = f"""
import http.client, json, os, socket, time

class Node(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(os.environ["LITEGRAPH_NODE_SOCKET"])

lane = os.environ["LITEGRAPH_LANE_IDS"].split(",")[0]
token = open(os.environ["LITEGRAPH_CAPABILITY_TOKEN_FILE"]).read().split()[0]

def work(**body):
    node = Node("node", timeout=120)
    node.request("POST", f"/v1/lanes/{{lane}}/work", json.dumps(body),
                 {{"Authorization": "Bearer " + token, "Content-Type": "application/json"}})
    reply = node.getresponse()
    data = reply.read()
    assert reply.status == 200, (reply.status, data)
    return json.loads(data)

a, b, out = (work(op="memory_reserve", dtype="float32", shape=[{SIDE}, {SIDE}])["buffer_id"]
             for _ in range(3))
work(op="execute", kernel="fill", args={{"value": 1.0}}, buffers={{"out": a}})
work(op="execute", kernel="fill", args={{"value": 2.0}}, buffers={{"out": b}})
print("STARTED", flush=True)
done, end = 0, time.time() + 4
while time.time() < end:
    work(op="execute", kernel="matmul", buffers={{"a": a, "b": b, "out": out}})
    done += 1
print("MATMULS", done, flush=True)
"""


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of the process so far."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cgroups_of(pid: int) -> list[str]:
    return pathlib.Path(f"/proc/{pid}/cgroup").read_text().splitlines()


def _cgroup_dirs(pid: int, name: str) -> list[pathlib.Path]:
    """The v1 controller directories named `name` that process `pid` is in."""
    found = []
    for line in _cgroups_of(pid):
        _, controllers, path = line.split(":", 2)
        first = controllers.split(",")[0]
        if first and "=" not in first and path.endswith(f"/{name}"):
            found.append(pathlib.Path("/sys/fs/cgroup", first, path.lstrip("/")))
    return found


def _charges(node: Node) -> dict[str, object]:
    """What the node still keeps of invocations' lane charges."""
    sup = node.daemon.supervisor
    assert sup is not None
    return dict(sup._state.charges._charges)


async def _session_host(node: Node, invocation_id: str) -> LaneHost:
    sup = node.daemon.supervisor
    assert sup is not None
    with trio.fail_after(30):
        while True:
            for owner in sup.owners.values():
                session = owner.sessions.get(invocation_id)
                if session is not None and session.started:
                    assert isinstance(session.host, LaneHost)
                    return session.host
            await trio.sleep(0.02)


async def test_a_guests_lane_work_runs_within_its_own_cpu_quota_and_is_in_its_usage(
    tmp_path: pathlib.Path,
) -> None:
    """The report: a guest with 100 millicores drove the lane host to 5.09 CPU-seconds in
    14.9 s, and was charged 0.057 s. Now the host runs in the guest's cgroup: held to
    the guest's tenth of a CPU, and counted in the guest's usage."""
    async with confined_node(tmp_path) as node:
        body = gpu_sandbox(MATMULS, invocation_id="charged")
        body["resources"] = {**body["resources"], "cpu_millis": 100}  # type: ignore[dict-item]
        await node.submit(body)
        host = await _session_host(node, "charged")
        assert host.pid is not None
        pid, seen_at = host.pid, time.monotonic()
        assert [line for line in _cgroups_of(pid) if line.endswith("/litegraph-charged")]
        used = 0.0
        with trio.fail_after(90):
            while (found := await status(node, "charged"))["state"] not in TERMINAL:
                if "STARTED" in found["stdout_tail"]:
                    try:
                        used, wall = _cpu_seconds(pid), time.monotonic() - seen_at
                    except FileNotFoundError:
                        pass  # the guest ended and its session with it
                await trio.sleep(0.1)
        assert found["state"] == "succeeded", found
        assert "MATMULS" in found["stdout_tail"]
        assert _charges(node) == {}  # nothing kept of it once it ended
        # Unconfined, the host ran a CPU or more the whole time; in the quota, about 0.1.
        assert used / wall < 0.35, (used, wall)
        usage: dict[str, Any] = found["usage"]
        assert usage["cpu_seconds"] >= used > 0, (usage, used)


async def test_a_builtins_lane_work_is_charged_to_a_cgroup_of_its_own(
    tmp_path: pathlib.Path,
) -> None:
    """An invocation with no process of its own (a builtin) gets a cgroup for its lane
    work, with its reservation's limits; its status reports what its hosts used."""
    async with confined_node(tmp_path) as node:
        body = {
            "id": "builtin-charged",
            "work": {"kind": "builtin", "name": "sleep", "args": {"seconds": 60}},
            "requirement": "gpu",
            "resources": {
                "cpu_millis": 100,
                "memory_bytes": 256 * 2**20,
                "gpus": 1,
                "vram_bytes": 2**30,
            },
        }
        submitted = await node.submit(body)
        lane = submitted["lanes"][0]["lane_id"]
        auth = {"Authorization": f"Bearer {submitted['tokens'][lane]}"}

        async def work(**request: Any) -> dict[str, Any]:
            reply = await node.client.post(
                f"/v1/lanes/{lane}/work", json=request, headers=auth, timeout=120
            )
            assert reply.status_code == 200, reply.text
            found: dict[str, Any] = reply.json()
            return found

        reserve = {"op": "memory_reserve", "dtype": "float32", "shape": [SIDE, SIDE]}
        a, b, out = [(await work(**reserve))["buffer_id"] for _ in range(3)]
        host = await _session_host(node, "builtin-charged")
        assert host.pid is not None
        made = _cgroup_dirs(host.pid, "litegraph-builtin-charged")
        assert made and all(path.is_dir() for path in made), made
        await work(op="execute", kernel="matmul", buffers={"a": a, "b": b, "out": out})
        used = _cpu_seconds(host.pid)
        reply = await node.client.delete("/v1/invocations/builtin-charged", headers=node.op)
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        assert usage is not None and usage["cpu_seconds"] >= used > 0, (usage, used)
        assert _charges(node) == {}
        assert [path for path in made if path.exists()] == []  # its cgroup removed


async def test_a_lane_host_that_exhausts_its_invocations_memory_ends_it_out_of_memory(
    tmp_path: pathlib.Path,
) -> None:
    """Lane memory is host memory here (simulated devices): filling a buffer beyond the
    invocation's memory limit OOM-kills its own host, in its own cgroup; it ends
    `out_of_memory`, and a neighbour on the same lane keeps its buffer."""
    async with confined_node(tmp_path) as node:

        def builtin(invocation_id: str, memory: int) -> dict[str, Any]:
            return {
                "id": invocation_id,
                "work": {"kind": "builtin", "name": "sleep", "args": {"seconds": 60}},
                "requirement": "gpu",
                "resources": {"memory_bytes": memory, "gpus": 1, "vram_bytes": 2**30},
            }

        greedy = await node.submit(builtin("greedy", 96 * 2**20))
        neighbour = await node.submit(builtin("neighbour", 256 * 2**20))
        lane = greedy["lanes"][0]["lane_id"]
        assert neighbour["lanes"][0]["lane_id"] == lane

        async def work(token: str, **request: Any) -> Any:
            return await node.client.post(
                f"/v1/lanes/{lane}/work",
                json=request,
                headers={"Authorization": f"Bearer {token}"},
                timeout=120,
            )

        small = {"op": "memory_reserve", "dtype": "uint8", "shape": [16]}
        kept = (await work(neighbour["tokens"][lane], **small)).json()["buffer_id"]
        big = {"op": "memory_reserve", "dtype": "float32", "shape": [8192, 8192]}  # 256 MiB
        buffer = (await work(greedy["tokens"][lane], **big)).json()["buffer_id"]
        fill = {"op": "execute", "kernel": "fill", "args": {"value": 1.0}}
        reply = await work(greedy["tokens"][lane], **fill, buffers={"out": buffer})
        assert (reply.status_code, reply.json()["error"]["code"]) == (503, "out_of_memory")
        with trio.fail_after(30):
            while (ended := await status(node, "greedy"))["state"] not in TERMINAL:  # noqa: ASYNC110
                await trio.sleep(0.05)
        assert (ended["state"], ended["reason"]) == ("cancelled", "out_of_memory")
        mine = await node.client.get(
            f"/v1/lanes/{lane}/buffers/{kept}?offset=0&length=16",
            headers={"Authorization": f"Bearer {neighbour['tokens'][lane]}"},
        )
        assert mine.status_code == 200 and mine.content == bytes(16)
        await node.client.delete("/v1/invocations/neighbour", headers=node.op)
