"""A sandboxed guest does GPU work only through its token: it reserves buffers on its
lane, uploads two matrices, runs the trusted `matmul` kernel in the lane's host,
downloads the product - with no device node of its own - and its buffers are freed
in the host when it ends."""

from __future__ import annotations

import base64
import json
import os
import pathlib
import signal

import numpy as np
import trio

from supervisor.lane_host import LaneHost
from tests.confinement.guests import TERMINAL, confined_node, run_to_end, status, wait_gone
from tests.confinement.test_guest_devices import fake_dev_root
from tests.confinement.test_guest_tokens import OWN_WORK, gpu_sandbox

M, K, N = 3, 4, 5

# The guest's whole program: the Python standard library over the node's Unix socket.
MATMUL = (pathlib.Path(__file__).resolve().parents[2] / "examples" / "lane_matmul.py").read_text()


def _matrix(rows: int, cols: int, scale: float) -> np.ndarray:
    values = (np.arange(rows * cols, dtype=np.float64) - 3) / scale
    return values.astype(np.float32).reshape(rows, cols)


async def test_a_sandbox_guest_multiplies_matrices_through_its_token_alone(
    tmp_path: pathlib.Path,
) -> None:
    async with confined_node(tmp_path, "--dev-root", str(fake_dev_root())) as node:
        sup = node.daemon.supervisor
        assert sup is not None
        found = await run_to_end(node, gpu_sandbox(MATMUL, invocation_id="matmul"))
        assert found["state"] == "succeeded", found
        reply = json.loads(found["stdout_tail"].strip().splitlines()[-1])
        product = np.frombuffer(base64.b64decode(reply["product"]), np.float32).reshape(M, N)
        np.testing.assert_allclose(product, _matrix(M, K, 7) @ _matrix(K, N, 3), rtol=1e-6)
        assert reply["devices"] == []  # the host's /dev has nvidia nodes; the guest none
        owner = sup.owners[found["lanes"][0]["lane_id"]]
        # Freed when it ended: in the owner's books, and the session's process, which
        # held the buffers, ended with it.
        assert owner.free_bytes == owner.lane.vram_bytes and not owner.sessions
        assert owner.session_starts == 1 and owner.host_starts == 1


async def test_a_killed_lane_session_ends_its_invocation_and_the_lane_serves_on(
    tmp_path: pathlib.Path,
) -> None:
    async with confined_node(tmp_path) as node:
        sup = node.daemon.supervisor
        assert sup is not None
        await node.submit(gpu_sandbox(OWN_WORK, invocation_id="holder"))
        with trio.fail_after(30):
            while "TOKEN" not in (found := await status(node, "holder"))["stdout_tail"]:  # noqa: ASYNC110
                await trio.sleep(0.05)
        lane, token = (
            found["lanes"][0]["lane_id"],
            found["stdout_tail"].split("TOKEN ")[1].split()[0],
        )
        owner = sup.owners[lane]
        host = owner.sessions["holder"].host
        assert isinstance(host, LaneHost) and host.pid is not None
        first_pid = host.pid
        os.kill(first_pid, signal.SIGKILL)  # noticed at once, with no request to the lane
        with trio.fail_after(30):
            while (ended := await status(node, "holder"))["state"] not in TERMINAL:  # noqa: ASYNC110
                await trio.sleep(0.05)
        assert (ended["state"], ended["reason"]) == ("cancelled", "lane_session_failed")
        reply = await node.client.post(
            f"/v1/lanes/{lane}/work",
            json={"op": "execute", "kernel": "noop"},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert (reply.status_code, reply.json()["error"]["code"]) == (401, "revoked")
        # The lane's own host was never touched.
        assert owner.host_starts == 1 and owner.free_bytes == owner.lane.vram_bytes
        assert "holder" not in owner.sessions
        hosts = [o.sentinel.pid for o in sup.owners.values() if isinstance(o.sentinel, LaneHost)]
        assert first_pid not in hosts and len(hosts) == len(sup.owners)
    # No lane host outlives the daemon.
    assert wait_gone([pid for pid in [*hosts, first_pid] if pid is not None]) == []
