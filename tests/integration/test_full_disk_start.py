"""A node whose state folder's disk is full starts, says why it is not ready,
naming the file, and becomes ready once the disk has room again.

The finding: after a guest filled the disk, the daemon would not start at all
(`cannot start: [Errno 28] No space left on device`, no file named).
"""

from __future__ import annotations

import pathlib

import httpx
import trio

from supervisor.wire import InvocationState
from tests.api_fixtures import bearer, builtin_request, running_daemon, wait_for_state
from tests.disk_fixtures import small_tmpfs
from tests.unit.machine.test_journal_reserve import fill


async def _ready(client: httpx.AsyncClient) -> None:
    with trio.fail_after(10):
        while (await client.get("/readyz")).status_code != 200:  # noqa: ASYNC110
            await trio.sleep(0.1)


async def test_a_restart_on_a_full_disk_starts_not_ready_and_recovers(
    tmp_path: pathlib.Path,
) -> None:
    with small_tmpfs(tmp_path / "state", "48m") as state:
        async with (
            running_daemon(tmp_path) as node,
            httpx.AsyncClient(base_url=node.url, timeout=10) as client,
        ):
            body = builtin_request("before", "echo", {"text": "hi"})
            accepted = await client.post(
                "/v1/invocations", json=body, headers=bearer(node.scheduler)
            )
            assert accepted.status_code == 202, accepted.text
            assert (await wait_for_state(client, node.scheduler, "before")).state is (
                InvocationState.succeeded
            )
        filler = fill(state)  # while it was down, something else took the disk
        async with (
            running_daemon(tmp_path) as node,
            httpx.AsyncClient(base_url=node.url, timeout=10) as client,
        ):
            headers = bearer(node.scheduler)
            ready = await client.get("/readyz")
            assert ready.status_code == 503
            reason = ready.json()["error"]["details"]["reasons"]["journal"]
            assert str(state / "reservations.journal.reserve") in reason and "MiB free" in reason
            body = builtin_request("during", "echo", {"text": "hi"})
            refused = await client.post("/v1/invocations", json=body, headers=headers)
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
            assert refused.json()["error"]["code"] == "journal_unavailable"
            old = await client.get("/v1/invocations/before", headers=headers)
            assert old.status_code == 200 and old.json()["state"] == "succeeded"
            filler.unlink()
            await _ready(client)
            accepted = await client.post("/v1/invocations", json=body, headers=headers)
            assert accepted.status_code == 202, accepted.text
            assert (await wait_for_state(client, node.scheduler, "during")).state is (
                InvocationState.succeeded
            )
