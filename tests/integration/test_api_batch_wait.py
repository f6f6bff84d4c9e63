"""POST /v1/invocations:batch (one result per item) and POST /v1/invocations:wait
(completion without polling, bounded)."""

from __future__ import annotations

import pathlib

import httpx
import msgspec
import trio

from supervisor.wire import MAX_BATCH, BatchReply, InvocationState, NodeEvent, WaitReply
from tests.api_fixtures import (
    SSE_CONNECTED,
    bearer,
    builtin_request,
    running_daemon,
    sse_connect,
    wait_for_state,
)

RUNNING = frozenset({InvocationState.running})


async def test_a_batch_answers_each_item_as_a_single_submission_would(
    tmp_path: pathlib.Path,
) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        headers = bearer(node.scheduler)
        held = builtin_request("held", args={"seconds": 30})
        assert (await client.post("/v1/invocations", json=held, headers=headers)).is_success
        items = [
            builtin_request("a", "echo", {"text": "hi"}),
            held,  # the same id and body: the same answer
            builtin_request("held", args={"seconds": 31}),  # another body: 409
            builtin_request("bad", "no_such_builtin"),  # refused by admission: 422
            *(builtin_request(f"n{i}", "echo", {"text": str(i)}) for i in range(60)),
        ]
        reply = await client.post(
            "/v1/invocations:batch", json={"invocations": items}, headers=headers
        )
        assert reply.status_code == 200, reply.text
        results = msgspec.json.decode(reply.content, type=BatchReply).results
        assert [r.id for r in results] == [i["id"] for i in items]  # in the order sent
        by_status = [(r.status, r.error.code if r.error else None) for r in results[:4]]
        assert by_status == [
            (202, None),
            (202, None),
            (409, "id_conflict"),
            (422, "invalid_request"),
        ]
        for r in (results[0], *results[4:]):
            assert r.accepted is not None and r.accepted.id == r.id
            assert all(t.startswith("v4.public.") for t in r.accepted.tokens.values())
            assert set(r.accepted.tokens) == {lane.lane_id for lane in r.accepted.lanes}
        assert (await client.get("/v1/invocations/bad", headers=headers)).status_code == 404
        done = await wait_for_state(client, node.scheduler, "n59")
        assert done.state is InvocationState.succeeded and done.stdout_tail == "59"


async def test_a_batch_holds_the_queue_bound_per_item_with_retry_after(
    tmp_path: pathlib.Path,
) -> None:
    async with (
        running_daemon(tmp_path, "--max-queued", "1", "--max-running", "1") as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        headers = bearer(node.scheduler)
        items = [builtin_request(f"s{i}", args={"seconds": 30}) for i in range(4)]
        reply = await client.post(
            "/v1/invocations:batch", json={"invocations": items}, headers=headers
        )
        results = msgspec.json.decode(reply.content, type=BatchReply).results
        accepted = [r for r in results if r.status == 202]
        refused = [r for r in results if r.status != 202]
        assert len(accepted) == 1 and len(refused) == 3
        for r in refused:
            assert r.status == 429 and r.error is not None and r.error.code == "queue_full"
            assert r.retry_after_s is not None and r.retry_after_s >= 1
            gone = await client.get(f"/v1/invocations/{r.id}", headers=headers)
            assert gone.status_code == 404  # refused means nothing was kept


async def test_a_batch_over_the_bound_or_malformed_changes_nothing(
    tmp_path: pathlib.Path,
) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        headers = bearer(node.scheduler)
        too_many = [builtin_request(f"x{i}", "echo") for i in range(MAX_BATCH + 1)]
        reply = await client.post(
            "/v1/invocations:batch", json={"invocations": too_many}, headers=headers
        )
        assert reply.status_code == 422 and reply.json()["error"]["code"] == "invalid_request"
        empty = await client.post(
            "/v1/invocations:batch", json={"invocations": []}, headers=headers
        )
        assert empty.status_code == 422
        anonymous = await client.post("/v1/invocations:batch", json={"invocations": too_many[:1]})
        assert anonymous.status_code == 401
        listed = await client.get("/v1/invocations", headers=headers)
        assert listed.json()["invocations"] == []


async def test_wait_answers_when_all_have_ended_and_names_the_unknown(
    tmp_path: pathlib.Path,
) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        headers = bearer(node.scheduler)
        for i in range(3):
            body = builtin_request(f"w{i}", args={"seconds": 0.2 * i})
            assert (await client.post("/v1/invocations", json=body, headers=headers)).is_success
        with trio.fail_after(5):
            reply = await client.post(
                "/v1/invocations:wait",
                json={"ids": ["w0", "w1", "w2", "nobody"], "timeout_s": 30},
                headers=headers,
            )
        assert reply.status_code == 200, reply.text
        waited = msgspec.json.decode(reply.content, type=WaitReply)
        assert [s.id for s in waited.ended] == ["w0", "w1", "w2"]
        assert all(s.state is InvocationState.succeeded for s in waited.ended)
        assert waited.pending == [] and waited.unknown == ["nobody"]


async def test_wait_is_bounded_and_any_returns_at_the_first_end(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        headers = bearer(node.scheduler)
        long = builtin_request("long", args={"seconds": 60})
        short = builtin_request("short", args={"seconds": 0.3})
        for body in (long, short):
            assert (await client.post("/v1/invocations", json=body, headers=headers)).is_success
        await wait_for_state(client, node.scheduler, "long", RUNNING)
        start = trio.current_time()
        reply = await client.post(
            "/v1/invocations:wait", json={"ids": ["long"], "timeout_s": 0.5}, headers=headers
        )
        waited = msgspec.json.decode(reply.content, type=WaitReply)
        assert waited.ended == [] and waited.pending == ["long"]
        assert 0.4 <= trio.current_time() - start < 5
        reply = await client.post(
            "/v1/invocations:wait",
            json={"ids": ["long", "short"], "timeout_s": 30, "any": True},
            headers=headers,
        )
        waited = msgspec.json.decode(reply.content, type=WaitReply)
        assert [s.id for s in waited.ended] == ["short"] and waited.pending == ["long"]
        over = await client.post(
            "/v1/invocations:wait", json={"ids": ["long"], "timeout_s": 61}, headers=headers
        )
        assert over.status_code == 422
        anonymous = await client.post("/v1/invocations:wait", json={"ids": ["long"]})
        assert anonymous.status_code == 401


async def test_the_event_stream_filtered_to_ids_carries_only_their_events(
    tmp_path: pathlib.Path,
) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
        sse_connect(node.url, node.scheduler, "/v1/events?ids=mine,also") as stream,
    ):
        assert stream.status == 200
        assert await stream.next_block() == SSE_CONNECTED
        headers = bearer(node.scheduler)
        for invocation_id in ("other", "mine"):
            body = builtin_request(invocation_id, "echo", {"text": invocation_id})
            assert (await client.post("/v1/invocations", json=body, headers=headers)).is_success
        seen: list[tuple[str, str]] = []
        with trio.fail_after(10):
            while ("mine", "succeeded") not in seen:
                block = await stream.next_block()
                if block.get("event") == "invocation":
                    event = msgspec.json.decode(block["data"], type=NodeEvent)
                    assert event.invocation is not None
                    seen.append((event.invocation.id, event.invocation.state.value))
        assert {i for i, _ in seen} == {"mine"}
        for bad in ("", "a,b/c", ",".join(f"i{i}" for i in range(MAX_BATCH + 1))):
            async with sse_connect(node.url, node.scheduler, f"/v1/events?ids={bad}") as refused:
                assert refused.status == 400 and b"invalid_ids" in await refused.body()
