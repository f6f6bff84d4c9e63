"""POST/GET/DELETE /v1/invocations over real HTTP: answers, refusals and release."""

from __future__ import annotations

import json
import pathlib

import httpx
import msgspec

from api.app import MAX_BODY_BYTES
from api.errors import ErrorEnvelope
from supervisor.wire import InvocationList, InvocationState, InvocationStatus, SubmitResponse
from tests.api_fixtures import (
    bearer,
    builtin_request,
    get_snapshot,
    running_daemon,
    settled_snapshot,
    wait_for_state,
)

RUNNING = frozenset({InvocationState.running})


def error_code(reply: httpx.Response) -> str:
    return msgspec.json.decode(reply.content, type=ErrorEnvelope).error.code


async def test_submit_answers_202_with_id_state_lanes_and_tokens(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        body = builtin_request("inv-1", "echo", {"text": "hi"})
        reply = await client.post("/v1/invocations", json=body, headers=bearer(node.scheduler))
        assert reply.status_code == 202, reply.text
        accepted = msgspec.json.decode(reply.content, type=SubmitResponse)
        assert accepted.id == "inv-1"
        assert accepted.state in (InvocationState.queued, InvocationState.running)
        assert [lane.kind for lane in accepted.lanes] == ["cpu"]
        assert set(accepted.tokens) == {accepted.lanes[0].lane_id}
        assert all(t.startswith("v4.public.") for t in accepted.tokens.values())
        done = await wait_for_state(client, node.scheduler, "inv-1")
        assert done.state is InvocationState.succeeded and done.stdout_tail == "hi"


async def test_same_body_gets_the_same_answer_and_a_different_body_409(
    tmp_path: pathlib.Path,
) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        body = builtin_request("dup", args={"seconds": 30})
        first = await client.post("/v1/invocations", json=body, headers=bearer(node.scheduler))
        again = await client.post("/v1/invocations", json=body, headers=bearer(node.admin))
        assert first.status_code == again.status_code == 202
        assert again.json()["id"] == "dup"
        assert again.json()["lanes"] == first.json()["lanes"]
        assert again.json()["tokens"] == first.json()["tokens"]
        other = builtin_request("dup", args={"seconds": 31})
        conflict = await client.post("/v1/invocations", json=other, headers=bearer(node.admin))
        assert conflict.status_code == 409 and error_code(conflict) == "id_conflict"
        listed = await client.get("/v1/invocations", headers=bearer(node.scheduler))
        ids = [s.id for s in msgspec.json.decode(listed.content, type=InvocationList).invocations]
        assert ids == ["dup"]


async def test_full_queue_is_429_with_retry_after(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path, "--max-queued", "1", "--max-running", "1") as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        headers = bearer(node.scheduler)
        running = builtin_request("busy", args={"seconds": 60})
        assert (await client.post("/v1/invocations", json=running, headers=headers)).is_success
        await wait_for_state(client, node.scheduler, "busy", RUNNING)
        waiting = builtin_request("waiting", args={"seconds": 60})
        assert (await client.post("/v1/invocations", json=waiting, headers=headers)).is_success
        refused = await client.post(
            "/v1/invocations", json=builtin_request("third"), headers=headers
        )
        assert refused.status_code == 429 and error_code(refused) == "queue_full"
        assert int(refused.headers["Retry-After"]) >= 1
        # Refused means nothing was kept: the id is free, not known.
        unknown = await client.get("/v1/invocations/third", headers=headers)
        assert unknown.status_code == 404
        metrics = (await client.get("/metrics")).text
        assert 'litegraph_admission_refusals_total{reason="queue_full"} 1.0' in metrics


async def test_bad_bodies_are_refused_with_honest_statuses(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        json_headers = {**bearer(node.scheduler), "Content-Type": "application/json"}
        cases: list[tuple[bytes, dict[str, str], int, str]] = [
            (b"{not json", json_headers, 400, "malformed_json"),
            (b'{"id": "x"}', json_headers, 422, "invalid_request"),
            (
                json.dumps(builtin_request("../etc")).encode(),
                json_headers,
                422,
                "invalid_request",
            ),
            (
                json.dumps(builtin_request("x", extra_field=1)).encode(),
                json_headers,
                422,
                "invalid_request",
            ),
            (
                json.dumps(builtin_request("x", "sleep", {"seconds": -1})).encode(),
                json_headers,
                422,
                "invalid_request",
            ),
            (
                json.dumps(builtin_request("x")).encode(),
                {**bearer(node.scheduler), "Content-Type": "text/plain"},
                415,
                "unsupported_media_type",
            ),
            (
                b'{"id": "' + b"a" * MAX_BODY_BYTES + b'"}',
                json_headers,
                413,
                "request_entity_too_large",
            ),
        ]
        for content, headers, status, code in cases:
            reply = await client.post("/v1/invocations", content=content, headers=headers)
            assert (reply.status_code, error_code(reply)) == (status, code), content[:60]
        listed = await client.get("/v1/invocations", headers=bearer(node.scheduler))
        assert listed.json() == {"invocations": [], "next_cursor": None}


async def test_get_unknown_and_bad_identifiers(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        headers = bearer(node.scheduler)
        missing = await client.get("/v1/invocations/never-submitted", headers=headers)
        assert missing.status_code == 404 and error_code(missing) == "unknown_invocation"
        gone = await client.delete("/v1/invocations/never-submitted", headers=headers)
        assert gone.status_code == 404 and error_code(gone) == "unknown_invocation"
        for bad in ("..%2F..", "a" * 200, "%2e%2e", "a%20b", "-leading-dash"):
            for method in ("GET", "DELETE"):
                reply = await client.request(method, f"/v1/invocations/{bad}", headers=headers)
                assert reply.status_code == 400, (method, bad, reply.text)
                assert error_code(reply) == "invalid_identifier"


async def test_list_and_get_show_submitted_invocations(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        headers = bearer(node.scheduler)
        for name in ("one", "two"):
            body = builtin_request(name, "echo", {"text": name})
            assert (await client.post("/v1/invocations", json=body, headers=headers)).is_success
        for name in ("one", "two"):
            status = await wait_for_state(client, node.scheduler, name)
            assert status.state is InvocationState.succeeded and status.stdout_tail == name
        listed = await client.get("/v1/invocations", headers=bearer(node.admin))
        ids = {s.id for s in msgspec.json.decode(listed.content, type=InvocationList).invocations}
        assert ids == {"one", "two"}


async def test_delete_answers_terminal_with_resources_already_released(
    tmp_path: pathlib.Path,
) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        headers = bearer(node.scheduler)
        idle = await settled_snapshot(client, node.scheduler)
        body = builtin_request(
            "gpu-job",
            args={"seconds": 60},
            requirement="gpu",
            resources={"cpu_millis": 500, "memory_bytes": 2**30, "gpus": 1, "vram_bytes": 2**30},
        )
        accepted = await client.post("/v1/invocations", json=body, headers=headers)
        assert accepted.status_code == 202, accepted.text
        await wait_for_state(client, node.scheduler, "gpu-job", RUNNING)
        busy = await get_snapshot(client, node.scheduler)
        assert busy.capacity.cpu_millis.allocatable == idle.capacity.cpu_millis.allocatable - 500
        assert busy.capacity.gpus.allocatable < idle.capacity.gpus.allocatable
        cancelled = await client.delete("/v1/invocations/gpu-job", headers=headers)
        assert cancelled.status_code == 200
        status = msgspec.json.decode(cancelled.content, type=InvocationStatus)
        assert status.state is InvocationState.cancelled and status.reason == "cancel_requested"
        # Read at once: released before the terminal answer, not eventually.
        after = await get_snapshot(client, node.scheduler)
        assert after.capacity == idle.capacity
        assert after.sequence > busy.sequence
        # Cancelling again answers the same terminal state.
        again = await client.delete("/v1/invocations/gpu-job", headers=headers)
        assert again.status_code == 200 and again.json()["state"] == "cancelled"


async def test_failed_builtin_reports_failed_and_releases(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        idle = await settled_snapshot(client, node.scheduler)
        body = builtin_request("boom", "fail", {"message": "on purpose"})
        reply = await client.post("/v1/invocations", json=body, headers=bearer(node.scheduler))
        assert reply.status_code == 202
        status = await wait_for_state(client, node.scheduler, "boom")
        assert status.state is InvocationState.failed and "on purpose" in (status.reason or "")
        # The terminal state is recorded only after the release.
        assert (await get_snapshot(client, node.scheduler)).capacity == idle.capacity
