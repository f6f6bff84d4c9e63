"""A guest finds its tokens in a file only it can read and reaches the node through
its Unix socket; a token copied out of its sandbox is refused from any other uid."""

from __future__ import annotations

import json
import pathlib

import trio

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
