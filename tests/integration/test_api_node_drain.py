"""Whole-node drain over real HTTP: admin only, idempotent, refuses new work with a
typed 503 while running work goes on, and says so in /readyz, /v1/node and the snapshot."""

from __future__ import annotations

import pathlib

import httpx

from supervisor.wire import InvocationState
from tests.api_fixtures import (
    bearer,
    builtin_request,
    get_snapshot,
    running_daemon,
    wait_for_state,
)

RUNNING = frozenset({InvocationState.running})


async def test_only_an_admin_drains_the_node(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        for action in ("drain", "resume"):
            forbidden = await client.post(f"/v1/node/{action}", headers=bearer(node.scheduler))
            assert forbidden.status_code == 403
            assert forbidden.json()["error"]["code"] == "forbidden"
            assert (await client.post(f"/v1/node/{action}")).status_code == 401
        # Nothing changed: the node still admits work and is ready.
        status = await client.get("/v1/node", headers=bearer(node.scheduler))
        assert status.status_code == 200 and status.json()["drained"] is False
        assert (await client.get("/readyz")).status_code == 200


async def test_a_drained_node_refuses_new_work_and_lets_running_work_finish(
    tmp_path: pathlib.Path,
) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        sleeper = builtin_request("before", args={"seconds": 1})
        submitted = await client.post("/v1/invocations", json=sleeper, headers=bearer(node.admin))
        assert submitted.status_code == 202, submitted.text
        await wait_for_state(client, node.admin, "before", RUNNING)

        for _ in range(2):  # idempotent: a second drain answers the same
            drained = await client.post("/v1/node/drain", headers=bearer(node.admin))
            assert drained.status_code == 200, drained.text
            assert drained.json()["drained"] is True
            assert drained.json()["invocations"]["running"] == 1

        refused = await client.post(
            "/v1/invocations", json=builtin_request("after"), headers=bearer(node.scheduler)
        )
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "node_draining"
        gone = await client.get("/v1/invocations/after", headers=bearer(node.scheduler))
        assert gone.status_code == 404  # nothing was reserved or remembered
        # The same id and body as admitted work still answers (idempotent submission).
        again = await client.post("/v1/invocations", json=sleeper, headers=bearer(node.admin))
        assert again.status_code == 202

        ready = await client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["error"]["details"]["reasons"]["drained"].startswith("node_draining")
        snapshot = await get_snapshot(client, node.scheduler)
        assert snapshot.drained
        assert any(r.startswith("node_draining") for r in snapshot.readiness_reasons)
        assert snapshot.capacity.cpu_millis.allocated == 100  # running work keeps its grant

        ended = await wait_for_state(client, node.scheduler, "before")
        assert ended.state is InvocationState.succeeded

        for _ in range(2):
            resumed = await client.post("/v1/node/resume", headers=bearer(node.admin))
            assert resumed.status_code == 200 and resumed.json()["drained"] is False
        assert (await client.get("/readyz")).status_code == 200
        assert not (await get_snapshot(client, node.scheduler)).drained
        after = await client.post(
            "/v1/invocations", json=builtin_request("after"), headers=bearer(node.scheduler)
        )
        assert after.status_code == 202, after.text
