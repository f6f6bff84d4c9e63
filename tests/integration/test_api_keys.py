"""GET /v1/keys and POST /v1/tokens/introspect over real HTTP: what a lane host
outside the daemon needs to verify tokens itself, and to learn whether one is current."""

from __future__ import annotations

import functools
import json
import logging
import pathlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pyseto
import pytest
import trio

import node.daemon
from api.errors import ErrorEnvelope
from api.routes_keys import MAX_INTROSPECT_BODY
from capabilities import DEFAULT_LEEWAY, MAX_TOKEN_CHARS, KeySet, KeyStatus, TokenService
from tests.api_fixtures import RunningDaemon, bearer, builtin_request, running_daemon

INTROSPECT = "/v1/tokens/introspect"


def error_code(reply: httpx.Response) -> str:
    return msgspec.json.decode(reply.content, type=ErrorEnvelope).error.code


async def key_set(client: httpx.AsyncClient) -> KeySet:
    reply = await client.get("/v1/keys")  # no credential
    assert reply.status_code == 200, reply.text
    return msgspec.json.decode(reply.content, type=KeySet)


async def submit(client: httpx.AsyncClient, node: RunningDaemon, invocation_id: str) -> str:
    """Submit sleeping work; its one capability token."""
    body = builtin_request(invocation_id, args={"seconds": 60})
    reply = await client.post("/v1/invocations", json=body, headers=bearer(node.scheduler))
    assert reply.status_code == 202, reply.text
    [token] = reply.json()["tokens"].values()
    assert isinstance(token, str)
    return token


async def introspect(client: httpx.AsyncClient, secret: str, token: str) -> dict[str, Any]:
    reply = await client.post(INTROSPECT, json={"token": token}, headers=bearer(secret))
    assert reply.status_code == 200, reply.text
    assert reply.headers["Cache-Control"] == "no-store"
    answer: dict[str, Any] = reply.json()
    return answer


@pytest.fixture
async def node_client(
    tmp_path: pathlib.Path,
) -> AsyncIterator[tuple[RunningDaemon, httpx.AsyncClient]]:
    async with (
        running_daemon(tmp_path, "--token-ttl", "2") as running,
        httpx.AsyncClient(base_url=running.url, timeout=5) as client,
    ):
        yield running, client


async def test_pyseto_verifies_a_node_token_with_the_published_key(
    node_client: tuple[RunningDaemon, httpx.AsyncClient],
) -> None:
    running, client = node_client
    token = await submit(client, running, "verify-me")
    reply = await client.get("/v1/keys")
    assert reply.headers["Cache-Control"] == "no-cache"
    keys = await key_set(client)
    [published] = keys.keys
    assert published.status is KeyStatus.ACTIVE and published.verifies_until is None
    assert running.daemon.machine is not None
    assert keys.issuer == running.daemon.machine.node_id
    key = pyseto.Key.from_paserk(published.paserk)
    assert key.to_paserk_id() == published.kid
    decoded = pyseto.decode(
        key, token, implicit_assertion=keys.implicit_assertion.encode(), deserializer=json
    )
    payload = decoded.payload
    assert isinstance(payload, dict)
    assert payload["sub"] == "verify-me" and payload["iss"] == keys.issuer
    assert decoded.footer == {"kid": published.kid}
    # Without the published implicit assertion the token is not this node's.
    with pytest.raises(pyseto.VerifyError):
        pyseto.decode(key, token, implicit_assertion=b'{"node_id":"elsewhere"}')


async def test_introspection_follows_refresh_and_the_end_of_the_invocation(
    node_client: tuple[RunningDaemon, httpx.AsyncClient],
) -> None:
    running, client = node_client
    token = await submit(client, running, "long")
    answer = await introspect(client, running.scheduler, token)
    assert answer["active"] is True
    assert answer["sub"] == "long" and answer["scope"] == "execute"
    assert answer["exp"] - answer["iat"] == 2 and answer["nbf"] == answer["iat"]
    assert len(answer["jti"]) == 32 and answer["vram_bytes"] == 0
    assert {"iss", "aud", "isolation"} <= answer.keys()
    lane = answer["aud"]
    await trio.sleep(1)  # a token refreshes once half its life (here 2 s) is used
    fresh = await client.post(f"/v1/lanes/{lane}/token", headers=bearer(token))
    assert fresh.status_code == 200, fresh.text
    new = fresh.json()["token"]
    assert await introspect(client, running.admin, token) == {"active": False}
    # The RFC 7662 form encoding answers the same.
    form = await client.post(INTROSPECT, data={"token": new}, headers=bearer(running.admin))
    assert form.status_code == 200 and form.json()["active"] is True
    ended = await client.delete("/v1/invocations/long", headers=bearer(running.scheduler))
    assert ended.status_code == 200
    assert await introspect(client, running.scheduler, new) == {"active": False}


async def test_an_expired_token_is_inactive(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ahead = [0.0]
    monkeypatch.setattr(
        node.daemon,
        "TokenService",
        functools.partial(TokenService, clock=lambda: time.time() + ahead[0]),
    )
    async with (
        running_daemon(tmp_path, "--token-ttl", "60") as running,
        httpx.AsyncClient(base_url=running.url, timeout=5) as client,
    ):
        token = await submit(client, running, "expiring")
        assert (await introspect(client, running.scheduler, token))["active"] is True
        ahead[0] = 60 + DEFAULT_LEEWAY + 1
        assert await introspect(client, running.scheduler, token) == {"active": False}


async def test_anything_not_a_current_token_is_inactive_without_a_reason(
    node_client: tuple[RunningDaemon, httpx.AsyncClient],
) -> None:
    running, client = node_client
    token = await submit(client, running, "genuine")
    _, _, body, footer = token.split(".")
    flipped = body[:20] + ("A" if body[20] != "A" else "B") + body[21:]
    for wrong in (
        "",
        "garbage",
        "v4.public.garbage",
        f"v4.public.{flipped}.{footer}",
        token + "x" * (MAX_TOKEN_CHARS + 1 - len(token)),
        running.scheduler,
    ):
        reply = await client.post(INTROSPECT, json={"token": wrong}, headers=bearer(running.admin))
        assert reply.status_code == 200
        assert reply.content == b'{"active":false}', wrong[:20]


async def test_only_operators_may_introspect(
    node_client: tuple[RunningDaemon, httpx.AsyncClient],
) -> None:
    running, client = node_client
    token = await submit(client, running, "probe")
    anonymous = await client.post(INTROSPECT, json={"token": token})
    assert (anonymous.status_code, error_code(anonymous)) == (401, "unauthenticated")
    assert anonymous.headers["WWW-Authenticate"].startswith("Bearer")
    # A guest holding a capability token cannot probe tokens, not even its own.
    as_guest = await client.post(INTROSPECT, json={"token": token}, headers=bearer(token))
    assert (as_guest.status_code, error_code(as_guest)) == (401, "unauthenticated")
    for secret in (running.scheduler, running.admin):
        assert (await introspect(client, secret, token))["active"] is True


async def test_introspection_requests_are_bounded_and_strict(
    node_client: tuple[RunningDaemon, httpx.AsyncClient],
) -> None:
    running, client = node_client
    op = bearer(running.scheduler)
    huge = {"token": "v4.public." + "A" * MAX_INTROSPECT_BODY}
    declared = await client.post(INTROSPECT, json=huge, headers=op)
    assert (declared.status_code, error_code(declared)) == (413, "request_entity_too_large")

    async def chunks() -> AsyncIterator[bytes]:
        yield msgspec.json.encode(huge)

    chunked = await client.post(
        INTROSPECT, content=chunks(), headers={**op, "Content-Type": "application/json"}
    )
    assert "Content-Length" not in chunked.request.headers
    assert (chunked.status_code, error_code(chunked)) == (413, "request_entity_too_large")
    refused = [
        (b"token=a", "text/plain", 415, "unsupported_media_type"),
        (b'{"token":', "application/json", 400, "malformed_json"),
        (b"{}", "application/json", 422, "invalid_request"),
        (b'{"token":"a","extra":1}', "application/json", 422, "invalid_request"),
        (b"token=a&token=b", "application/x-www-form-urlencoded", 400, "malformed_form"),
        (b"token=a&a=1&b=2&c=3&d=4", "application/x-www-form-urlencoded", 400, "malformed_form"),
        (b"token_type_hint=x", "application/x-www-form-urlencoded", 422, "invalid_request"),
        (b"token=\xff", "application/x-www-form-urlencoded", 400, "malformed_form"),
    ]
    for body, media, status, code in refused:
        reply = await client.post(INTROSPECT, content=body, headers={**op, "Content-Type": media})
        assert (reply.status_code, error_code(reply)) == (status, code), body


async def test_no_token_reaches_the_log(
    node_client: tuple[RunningDaemon, httpx.AsyncClient], caplog: pytest.LogCaptureFixture
) -> None:
    running, client = node_client
    token = await submit(client, running, "quiet")
    signed_part = token.split(".")[2]
    with caplog.at_level(logging.DEBUG):
        assert (await introspect(client, running.scheduler, token))["active"] is True
        await client.post(INTROSPECT, json={"token": token + "x"}, headers=bearer(running.admin))
        await client.post(INTROSPECT, json={"token": token, "x": 1}, headers=bearer(token))
    assert signed_part not in caplog.text


async def test_after_a_restart_only_the_new_key_is_published(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as first,
        httpx.AsyncClient(base_url=first.url, timeout=5) as client,
    ):
        before = await key_set(client)
        old_token = await submit(client, first, "before-restart")
    async with (
        running_daemon(tmp_path) as second,
        httpx.AsyncClient(base_url=second.url, timeout=5) as client,
    ):
        after = await key_set(client)
        assert [k.status for k in after.keys] == [KeyStatus.ACTIVE]
        assert {k.kid for k in before.keys}.isdisjoint(k.kid for k in after.keys)
        assert {k.paserk for k in before.keys}.isdisjoint(k.paserk for k in after.keys)
        assert after.issuer == before.issuer
        assert await introspect(client, second.scheduler, old_token) == {"active": False}
