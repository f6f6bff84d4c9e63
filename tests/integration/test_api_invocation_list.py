"""GET /v1/invocations over real HTTP: state filters, cursor pages, typed refusals."""

from __future__ import annotations

import pathlib
from typing import Any

import httpx
import msgspec

from api.errors import ErrorEnvelope
from supervisor.listing import MAX_LIST_LIMIT
from supervisor.wire import InvocationList, InvocationState
from tests.api_fixtures import bearer, builtin_request, running_daemon, wait_for_state

S = InvocationState
RUNNING = frozenset({S.running})


async def _page(client: httpx.AsyncClient, secret: str, params: Any = None) -> InvocationList:
    reply = await client.get("/v1/invocations", params=params, headers=bearer(secret))
    assert reply.status_code == 200, reply.text
    return msgspec.json.decode(reply.content, type=InvocationList)


async def _submit(client: httpx.AsyncClient, secret: str, body: dict[str, Any]) -> None:
    reply = await client.post("/v1/invocations", json=body, headers=bearer(secret))
    assert reply.status_code == 202, reply.text


async def _submit_batch(client: httpx.AsyncClient, secret: str, ids: list[str]) -> None:
    batch = {"invocations": [builtin_request(i, "echo") for i in ids]}
    reply = await client.post("/v1/invocations:batch", json=batch, headers=bearer(secret))
    assert reply.status_code == 200, reply.text
    assert {item["status"] for item in reply.json()["results"]} == {202}


async def test_state_filters_keep_only_the_states_asked_for(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path, "--max-running", "1") as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        secret = node.scheduler
        await _submit(client, secret, builtin_request("ok", "echo", {"text": "hi"}))
        await _submit(client, secret, builtin_request("bad", "fail", {"message": "no"}))
        await wait_for_state(client, secret, "ok")
        await wait_for_state(client, secret, "bad")
        await _submit(client, secret, builtin_request("busy", args={"seconds": 60}))
        await wait_for_state(client, secret, "busy", RUNNING)
        await _submit(client, secret, builtin_request("waits", args={"seconds": 60}))

        def ids(listed: InvocationList) -> set[str]:
            return {s.id for s in listed.invocations}

        assert ids(await _page(client, secret)) == {"ok", "bad", "busy", "waits"}
        assert ids(await _page(client, secret, {"state": "failed"})) == {"bad"}
        live = await _page(client, secret, [("state", "queued"), ("state", "running")])
        assert ids(live) == {"busy", "waits"}
        assert {s.state for s in live.invocations} == {S.queued, S.running}
        assert ids(await _page(client, secret, {"state": "cancelled"})) == set()


async def test_label_filters_keep_only_invocations_holding_every_label(
    tmp_path: pathlib.Path,
) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        secret = node.scheduler
        labelled = {
            "a": {"team": "ml", "run": "1"},
            "b": {"team": "ml", "run": "2", "note": "x=y"},
            "c": {"team": "infra"},
        }
        for iid, labels in labelled.items():
            await _submit(client, secret, builtin_request(iid, "echo", labels=labels))
        await _submit(client, secret, builtin_request("d", args={"seconds": 60}))
        await wait_for_state(client, secret, "d", RUNNING)

        async def ids(params: Any) -> set[str]:
            return {s.id for s in (await _page(client, secret, params)).invocations}

        assert await ids({"label": "team=ml"}) == {"a", "b"}
        assert await ids([("label", "team=ml"), ("label", "run=2")]) == {"b"}
        assert await ids({"label": "note=x=y"}) == {"b"}  # split at the first `=`
        assert await ids([("label", "team=ml"), ("label", "team=infra")]) == set()
        assert await ids({"label": "team="}) == set()
        assert await ids({"label": "absent=1"}) == set()
        # With a state filter, both hold.
        await wait_for_state(client, secret, "c")
        assert await ids([("label", "team=infra"), ("state", "succeeded")]) == {"c"}
        assert await ids([("label", "team=infra"), ("state", "running")]) == set()
        everything = (await _page(client, secret)).invocations
        assert {s.id: s.labels for s in everything} == {**labelled, "d": {}}


async def test_pages_neither_repeat_nor_skip_while_submissions_arrive(
    tmp_path: pathlib.Path,
) -> None:
    async with (
        running_daemon(tmp_path, "--max-queued", "64") as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        secret = node.scheduler
        # One batch: the items share submission milliseconds, so ids break the ties.
        before = {f"a{i:02d}" for i in range(11)}
        await _submit_batch(client, secret, sorted(before))
        seen: list[str] = []
        params: dict[str, Any] = {"limit": 3}
        pages = 0
        while True:
            listed = await _page(client, secret, params)
            assert len(listed.invocations) <= 3
            seen += [s.id for s in listed.invocations]
            pages += 1
            # Submissions between pages neither shift nor repeat what is left.
            await _submit(client, secret, builtin_request(f"b{pages}", "echo"))
            if listed.next_cursor is None:
                break
            params = {"limit": 3, "cursor": listed.next_cursor}
        assert len(seen) == len(set(seen)), seen
        assert before <= set(seen)
        assert pages == 4  # 11 items, 3 a page; those submitted meanwhile come first
        # Newest first: every page follows the one before in (submitted_at, id) order.
        everything = (await _page(client, secret, {"limit": MAX_LIST_LIMIT})).invocations
        keys = [(s.submitted_at, s.id) for s in everything]
        assert keys == sorted(keys, reverse=True)
        assert [s.id for s in everything if s.id in before] == [k for k in seen if k in before]


async def test_the_default_page_is_bounded_and_says_where_to_go_on(
    tmp_path: pathlib.Path,
) -> None:
    async with (
        running_daemon(tmp_path, "--max-queued", "256") as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        secret = node.scheduler
        for chunk in range(2):
            await _submit_batch(client, secret, [f"n{chunk}-{i:03d}" for i in range(60)])
        first = await _page(client, secret)
        assert len(first.invocations) == 100 and first.next_cursor is not None
        rest = await _page(client, secret, {"cursor": first.next_cursor})
        assert len(rest.invocations) == 20 and rest.next_cursor is None


BAD: list[tuple[Any, str]] = [
    ({"state": "sleeping"}, "invalid_state"),
    ([("state", "queued"), ("state", "")], "invalid_state"),
    ({"limit": "0"}, "invalid_limit"),
    ({"limit": str(MAX_LIST_LIMIT + 1)}, "invalid_limit"),
    ({"limit": "-1"}, "invalid_limit"),
    ({"limit": "ten"}, "invalid_limit"),
    ({"limit": "2.5"}, "invalid_limit"),
    ([("limit", "2"), ("limit", "3")], "invalid_limit"),
    ({"cursor": ""}, "invalid_cursor"),
    ({"cursor": "not a cursor"}, "invalid_cursor"),
    ({"cursor": "bm90IGEgY3Vyc29y"}, "invalid_cursor"),  # base64 of plain text
    ({"cursor": "x" * 600}, "invalid_cursor"),
    ({"states": "queued"}, "unknown_parameter"),
    ({"label": "team"}, "invalid_label"),  # no `=`
    ({"label": "=ml"}, "invalid_label"),
    ({"label": "Team=ml"}, "invalid_label"),
    ({"label": "team\n=ml"}, "invalid_label"),
    ({"label": "k" * 64 + "=v"}, "invalid_label"),
    ({"label": "team=" + "v" * 257}, "invalid_label"),
    ([("label", f"k{n}=v") for n in range(17)], "invalid_label"),
    ({"labels": "team=ml"}, "unknown_parameter"),
]


async def test_bad_list_parameters_are_refused_with_a_typed_400(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        await _submit(client, node.scheduler, builtin_request("one", "echo"))
        for params, code in BAD:
            reply = await client.get(
                "/v1/invocations", params=params, headers=bearer(node.scheduler)
            )
            assert reply.status_code == 400, (params, reply.text)
            error = msgspec.json.decode(reply.content, type=ErrorEnvelope).error
            assert error.code == code, params
        # Nothing about the node changed.
        assert [s.id for s in (await _page(client, node.scheduler)).invocations] == ["one"]
