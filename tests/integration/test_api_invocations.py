"""POST/GET/DELETE /v1/invocations over real HTTP: answers, refusals and release."""

from __future__ import annotations

import json
import pathlib

import httpx
import msgspec
import trio

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
from tests.helpers import guest_cwd

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


async def test_the_status_says_what_the_invocation_is_and_never_its_env_values(
    tmp_path: pathlib.Path,
) -> None:
    secret_value = "hunter2-never-shown"
    process = {
        "id": "train-7",
        "work": {
            "kind": "process",
            "argv": ["sh", "-c", "exit 0", *[f"arg{n}" for n in range(30)]],
            "env": {"API_TOKEN": secret_value},
            "cwd": str(guest_cwd()),
        },
        "resources": {"cpu_millis": 250, "memory_bytes": 2**28},
        "labels": {"team": "ml", "run": "exp-7"},
    }
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        headers = bearer(node.scheduler)
        for body in (process, builtin_request("nap", args={"seconds": 60})):
            reply = await client.post("/v1/invocations", json=body, headers=headers)
            assert reply.status_code == 202, reply.text
        done = await wait_for_state(client, node.scheduler, "train-7", seconds=30)
        assert done.state is InvocationState.succeeded, done
        assert done.command is not None and done.command.kind == "process"
        assert done.command.argv == ["sh", "-c", "exit 0", *[f"arg{n}" for n in range(13)]]
        assert (done.command.argc, done.command.argv_cut) == (33, True)
        assert done.resources is not None
        assert (done.resources.cpu_millis, done.resources.memory_bytes) == (250, 2**28)
        assert done.labels == {"team": "ml", "run": "exp-7"}
        assert [lane.kind for lane in done.lanes] == ["cpu"]
        assert done.started_at is not None and done.ended_at is not None
        assert done.duration_s is not None and 0 <= done.duration_s < 30

        nap = await wait_for_state(client, node.scheduler, "nap", RUNNING)
        assert nap.command is not None and (nap.command.kind, nap.command.name) == (
            "builtin",
            "sleep",
        )
        assert nap.ended_at is None and nap.duration_s is not None  # live: up to now
        await trio.sleep(0.3)
        later = await wait_for_state(client, node.scheduler, "nap", RUNNING)
        assert later.duration_s is not None and later.duration_s > nap.duration_s

        # Nowhere a status is read does the environment's value appear.
        for path in ("/v1/invocations/train-7", "/v1/invocations"):
            reply = await client.get(path, headers=headers)
            assert reply.status_code == 200
            assert secret_value not in reply.text and "API_TOKEN" not in reply.text


async def test_bad_labels_are_422_naming_labels_and_change_nothing(
    tmp_path: pathlib.Path,
) -> None:
    bad_labels = [
        {"Team": "ml"},  # upper case
        {"team\n": "ml"},  # a newline the wire pattern's `$` lets through
        {"k" * 64: "v"},
        {"team": "v" * 257},
        {"team": "a\u001bb"},
        {f"k{n}": "v" for n in range(17)},
        {"team": 7},
    ]
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        headers = {**bearer(node.scheduler), "Content-Type": "application/json"}
        for labels in bad_labels:
            body = builtin_request("labelled", "echo", labels=labels)
            content = json.dumps(body).encode()
            reply = await client.post("/v1/invocations", content=content, headers=headers)
            assert reply.status_code == 422, (labels, reply.text)
            error = msgspec.json.decode(reply.content, type=ErrorEnvelope).error
            assert error.code == "invalid_request"
            assert "labels" in error.message or "labels" in str(error.details), error
        listed = await client.get("/v1/invocations", headers=bearer(node.scheduler))
        assert listed.json() == {"invocations": [], "next_cursor": None}
        # At the bounds it is taken.
        good = {f"k{n}": "v" * 256 for n in range(16)}
        body = builtin_request("labelled", "echo", labels=good)
        reply = await client.post("/v1/invocations", json=body, headers=bearer(node.scheduler))
        assert reply.status_code == 202, reply.text
        assert (await wait_for_state(client, node.scheduler, "labelled")).labels == good
