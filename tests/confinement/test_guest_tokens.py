"""A guest finds its tokens in a file only it can read and reaches the node through
its Unix socket (or TCP, where it was given the host network); a token copied out
of its sandbox is refused from any other uid, on the socket and over TCP alike."""

from __future__ import annotations

import json
import pathlib

import trio

from tests.adversarial.fixtures import Node, error_code
from tests.api_fixtures import bearer
from tests.confinement.guests import confined_node, guest_pid, python, run_to_end, status

# A guest's whole client: its token file, its lane ids and the node's Unix socket.
CLIENT = """
import http.client, json, os, socket, sys

class Node(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(os.environ["LITEGRAPH_NODE_SOCKET"])

def work(lane, token, body):
    node = Node("node", timeout=10)
    node.request("POST", f"/v1/lanes/{lane}/work", json.dumps(body),
                 {"Authorization": "Bearer " + token, "Content-Type": "application/json"})
    reply = node.getresponse()
    return reply.status, json.loads(reply.read() or b"{}")
"""

RESERVE = {"op": "memory_reserve", "dtype": "uint8", "shape": [2**20]}
OWN_WORK = CLIENT + (
    'lane = os.environ["LITEGRAPH_LANE_IDS"].split(",")[0]\n'
    'token = open(os.environ["LITEGRAPH_CAPABILITY_TOKEN_FILE"]).read().split()[0]\n'
    'print(json.dumps({"env_token": "LITEGRAPH_CAPABILITY_TOKEN" in os.environ,\n'
    f'                  "reply": work(lane, token, {RESERVE!r})}}))\n'
    'print("TOKEN", token, flush=True)\n'
    "import time; time.sleep(60)\n"
)
STOLEN_WORK = CLIENT + (
    f"lane, token = sys.argv[1], sys.argv[2]\nprint(json.dumps(work(lane, token, {RESERVE!r})))\n"
)
# The same over loopback TCP: the node's address from argv (any local user finds the
# port), else the one a guest with the host network is given.
TCP_CLIENT = CLIENT.replace(
    """        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(os.environ["LITEGRAPH_NODE_SOCKET"])""",
    """        url = sys.argv[3] if len(sys.argv) > 3 else os.environ["LITEGRAPH_NODE_URL"]
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)""",
)
STOLEN_OVER_TCP = TCP_CLIENT + (
    f"lane, token = sys.argv[1], sys.argv[2]\nprint(json.dumps(work(lane, token, {RESERVE!r})))\n"
)
OWN_OVER_TCP = TCP_CLIENT + (
    'lane = os.environ["LITEGRAPH_LANE_IDS"].split(",")[0]\n'
    'token = open(os.environ["LITEGRAPH_CAPABILITY_TOKEN_FILE"]).read().split()[0]\n'
    f"print(json.dumps(work(lane, token, {RESERVE!r})))\n"
)


def gpu_sandbox(code: str, **fields: object) -> dict[str, object]:
    body = python(code, requirement="gpu", isolation="sandbox", **fields)
    body["resources"] = {
        "cpu_millis": 500,
        "memory_bytes": 256 * 2**20,
        "gpus": 1,
        "vram_bytes": 2**30,
    }
    return body


async def test_a_sandbox_guest_does_lane_work_through_its_socket_and_token_file(
    tmp_path: pathlib.Path,
) -> None:
    async with confined_node(tmp_path) as node:
        await node.submit(gpu_sandbox(OWN_WORK, invocation_id="owner"))
        await guest_pid(node, "owner", "LITEGRAPH_NODE_SOCKET")
        with trio.fail_after(30):
            while "TOKEN" not in (found := await status(node, "owner"))["stdout_tail"]:  # noqa: ASYNC110
                await trio.sleep(0.05)
        first = json.loads(found["stdout_tail"].splitlines()[0])
        assert first["env_token"] is False
        code, reply = first["reply"]
        assert code == 200, reply
        assert reply["op"] == "memory_reserve"


async def test_a_token_copied_out_of_its_guest_is_refused_from_another_uid(
    tmp_path: pathlib.Path,
) -> None:
    async with confined_node(tmp_path) as node:
        owner = await node.submit(gpu_sandbox(OWN_WORK, invocation_id="owner"))
        lane = owner["lanes"][0]["lane_id"]
        with trio.fail_after(30):
            while "TOKEN" not in (found := await status(node, "owner"))["stdout_tail"]:  # noqa: ASYNC110
                await trio.sleep(0.05)
        token = found["stdout_tail"].split("TOKEN ")[1].split()[0]
        assert token == owner["tokens"][lane]
        thief = gpu_sandbox(STOLEN_WORK, invocation_id="thief")
        thief["work"]["argv"] += [lane, token]  # type: ignore[index]
        ended = await run_to_end(node, thief)
        assert ended["state"] == "succeeded", ended
        code, reply = json.loads(ended["stdout_tail"])
        assert (code, reply["error"]["code"]) == (403, "wrong_holder"), reply
        assert (await status(node, "owner"))["state"] == "running"


async def _stolen(node: Node) -> tuple[str, str]:
    """A running sandbox guest `owner` that reserved 1 MiB; its lane and its token."""
    owner = await node.submit(gpu_sandbox(OWN_WORK, invocation_id="owner"))
    lane = owner["lanes"][0]["lane_id"]
    with trio.fail_after(30):
        while "TOKEN" not in (found := await status(node, "owner"))["stdout_tail"]:  # noqa: ASYNC110
            await trio.sleep(0.05)
    return lane, found["stdout_tail"].split("TOKEN ")[1].split()[0]


def _held(node: Node, lane: str, invocation_id: str) -> int:
    sup = node.daemon.supervisor
    assert sup is not None
    return sup.owners[lane].held_by(invocation_id)


async def test_a_token_copied_out_of_its_guest_is_refused_over_tcp_from_another_uid(
    tmp_path: pathlib.Path,
) -> None:
    """The report: tenant B's guest (with the host network, its own uid) presented
    A's token on loopback TCP and reserved memory on A's lane as A."""
    async with confined_node(tmp_path, "--guest-host-network") as node:
        lane, token = await _stolen(node)
        thief = python(STOLEN_OVER_TCP, invocation_id="thief", isolation="shared", network="host")
        thief["work"]["argv"] += [lane, token, node.url]
        ended = await run_to_end(node, thief)
        assert ended["state"] == "succeeded", ended
        code, reply = json.loads(ended["stdout_tail"])
        assert (code, reply["error"]["code"]) == (403, "wrong_holder"), reply
        assert "its guest's own uid" in reply["error"]["message"]
        assert _held(node, lane, "owner") == 2**20
        assert (await status(node, "owner"))["state"] == "running"


async def test_a_guests_token_over_tcp_is_refused_from_the_node_hosts_root_too(
    tmp_path: pathlib.Path,
) -> None:
    """Root holds the signing key and needs no guest's token: no uid but the guest's
    is an exception, whoever submitted the invocation."""
    async with confined_node(tmp_path) as node:
        lane, token = await _stolen(node)
        reply = await node.client.post(
            f"/v1/lanes/{lane}/work", json=RESERVE, headers=bearer(token)
        )
        assert (reply.status_code, error_code(reply)) == (403, "wrong_holder"), reply.text
        assert _held(node, lane, "owner") == 2**20


async def test_a_guest_with_the_host_network_uses_its_own_token_over_tcp(
    tmp_path: pathlib.Path,
) -> None:
    async with confined_node(tmp_path, "--guest-host-network") as node:
        body = python(OWN_OVER_TCP, invocation_id="own-tcp", requirement="gpu", network="host")
        body["resources"] = {**body["resources"], "gpus": 1, "vram_bytes": 2**30}
        ended = await run_to_end(node, body)
        assert ended["state"] == "succeeded", ended
        code, reply = json.loads(ended["stdout_tail"])
        assert code == 200 and reply["op"] == "memory_reserve", reply
