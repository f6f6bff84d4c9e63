"""Lane work with capability tokens, and drain/resume, over real HTTP."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import trio

import node.daemon
from api.errors import ErrorEnvelope
from machine.lanes import LaneKind
from supervisor.lane_work import LaneWorkReply, TokenReply
from tests.adversarial.shared_daemon import SharedDaemon, SharedNode, shared_daemon
from tests.api_fixtures import (
    RunningDaemon,
    bearer,
    builtin_request,
    get_snapshot,
    running_daemon,
    settled_snapshot,
)

# The tests that need no daemon of their own share one, handed back to each as it was
# found (`SharedDaemon.node`): one worker runs the module.
pytestmark = pytest.mark.xdist_group("api_lanes")

GiB = 2**30


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedDaemon]:
    """Tokens live 600 s here (`test_a_refresh_early_in_the_token_life_is_429...`)."""
    with shared_daemon(tmp_path_factory.mktemp("api-lanes"), "--token-ttl", "600") as shared:
        yield shared


def error_code(reply: httpx.Response) -> str:
    return msgspec.json.decode(reply.content, type=ErrorEnvelope).error.code


def gpu_request(
    invocation_id: str, vram: int = GiB, cpu_millis: int = 2000, **fields: Any
) -> dict[str, Any]:
    # Its lane sessions' hosts (an interpreter and NumPy) start under its CPU quota:
    # at a tenth of a CPU one took three seconds to start, at two CPUs a fraction of one.
    resources = {"cpu_millis": cpu_millis, "memory_bytes": 2**20, "gpus": 1, "vram_bytes": vram}
    return builtin_request(
        invocation_id,
        args={"seconds": 60},
        requirement="gpu",
        resources=resources,
        **fields,
    )


async def submit(
    client: httpx.AsyncClient, node: RunningDaemon | SharedNode, body: dict[str, Any]
) -> Any:
    reply = await client.post("/v1/invocations", json=body, headers=bearer(node.scheduler))
    assert reply.status_code == 202, reply.text
    return reply.json()


async def test_token_holder_reserves_memory_and_executes(daemon: SharedDaemon) -> None:
    async with daemon.node(client_timeout=5) as node:
        client = node.client
        accepted = await submit(client, node, gpu_request("g1"))
        lane, token = next(iter(accepted["tokens"].items()))
        reserve = await client.post(
            f"/v1/lanes/{lane}/work",
            json={"op": "memory_reserve", "dtype": "uint8", "shape": [2**20]},
            headers=bearer(token),
        )
        assert reserve.status_code == 200, reserve.text
        reply = msgspec.json.decode(reserve.content, type=LaneWorkReply)
        assert reply.buffer_id is not None and reply.buffer_id.startswith("buf_")
        assert reply.invocation_id == "g1" and reply.bytes_held == 2**20
        noop = await client.post(
            f"/v1/lanes/{lane}/work",
            json={"op": "execute", "kernel": "noop"},
            headers=bearer(token),
        )
        assert noop.status_code == 200 and noop.json()["result"] == {}
        release = await client.post(
            f"/v1/lanes/{lane}/work",
            json={"op": "memory_release", "buffer_id": reply.buffer_id},
            headers=bearer(token),
        )
        assert release.status_code == 200 and release.json()["bytes_held"] == 0
        # More VRAM than the token grants: what it may do, so 403.
        over = await client.post(
            f"/v1/lanes/{lane}/work",
            json={"op": "memory_reserve", "dtype": "uint8", "shape": [2 * GiB]},
            headers=bearer(token),
        )
        assert over.status_code == 403 and error_code(over) == "vram_over_budget"


async def test_missing_garbage_and_foreign_tokens_are_refused(daemon: SharedDaemon) -> None:
    async with daemon.node(client_timeout=5) as node:
        client = node.client
        snapshot = await settled_snapshot(client, node.scheduler)
        cpu_lane = next(lane.lane_id for lane in snapshot.lanes if lane.kind is LaneKind.CPU)
        accepted = await submit(client, node, gpu_request("g2"))
        gpu_lane, token = next(iter(accepted["tokens"].items()))
        noop = {"op": "execute", "kernel": "noop"}
        missing = await client.post(f"/v1/lanes/{gpu_lane}/work", json=noop)
        assert missing.status_code == 401 and error_code(missing) == "missing_token"
        assert "WWW-Authenticate" in missing.headers
        garbage = await client.post(
            f"/v1/lanes/{gpu_lane}/work", json=noop, headers=bearer("v4.public.garbage")
        )
        assert garbage.status_code == 401
        # A valid token for another lane: who it is is fine, where it may act is not.
        foreign = await client.post(f"/v1/lanes/{cpu_lane}/work", json=noop, headers=bearer(token))
        assert foreign.status_code == 403 and error_code(foreign) == "wrong_audience"
        bad_lane = await client.post("/v1/lanes/..%2F/work", json=noop, headers=bearer(token))
        assert bad_lane.status_code == 404 and error_code(bad_lane) == "not_found"
        unknown = await client.post(
            "/v1/lanes/lane_0000000000000000/work", json=noop, headers=bearer(token)
        )
        assert unknown.status_code == 404 and error_code(unknown) == "unknown_lane"


async def test_a_guests_token_over_tcp_works_only_from_a_socket_of_its_guests_uid(
    daemon: SharedDaemon,
) -> None:
    """Over TCP the kernel's socket diagnostics name the uid at the other end, and a
    guest's token is its guest's alone: the uid that owns this test's socket is
    refused until it is the invocation's own."""
    async with daemon.node(client_timeout=5) as node:
        client = node.client
        lane, token = next(iter((await submit(client, node, gpu_request("g4")))["tokens"].items()))
        sup = node.daemon.supervisor
        assert sup is not None
        guest = node.inside(lambda: sup._live["g4"])
        # As a guest's start sets it: not this test's uid.
        node.inside(lambda: setattr(guest, "uid", os.geteuid() + 1))
        noop = {"op": "execute", "kernel": "noop"}
        stolen = await client.post(f"/v1/lanes/{lane}/work", json=noop, headers=bearer(token))
        assert (stolen.status_code, error_code(stolen)) == (403, "wrong_holder"), stolen.text
        node.inside(lambda: setattr(guest, "uid", os.geteuid()))
        own = await client.post(f"/v1/lanes/{lane}/work", json=noop, headers=bearer(token))
        assert own.status_code == 200, own.text


async def test_tokens_are_revoked_when_the_invocation_ends(daemon: SharedDaemon) -> None:
    async with daemon.node(client_timeout=5) as node:
        client = node.client
        accepted = await submit(client, node, gpu_request("g3"))
        lane, token = next(iter(accepted["tokens"].items()))
        noop = {"op": "execute", "kernel": "noop"}
        ok = await client.post(f"/v1/lanes/{lane}/work", json=noop, headers=bearer(token))
        assert ok.status_code == 200
        ended = await client.delete("/v1/invocations/g3", headers=bearer(node.scheduler))
        assert ended.json()["state"] == "cancelled"
        revoked = await client.post(f"/v1/lanes/{lane}/work", json=noop, headers=bearer(token))
        assert revoked.status_code == 401 and error_code(revoked) == "revoked"


async def test_drain_is_admin_only_and_blocks_admission_until_resume(
    daemon: SharedDaemon,
) -> None:
    async with daemon.node(client_timeout=5) as node:
        client = node.client
        snapshot = await settled_snapshot(client, node.scheduler)
        cpu_lane = next(lane.lane_id for lane in snapshot.lanes if lane.kind is LaneKind.CPU)
        forbidden = await client.post(f"/v1/lanes/{cpu_lane}/drain", headers=bearer(node.scheduler))
        assert forbidden.status_code == 403 and error_code(forbidden) == "forbidden"
        anonymous = await client.post(f"/v1/lanes/{cpu_lane}/drain")
        assert anonymous.status_code == 401
        drained = await client.post(f"/v1/lanes/{cpu_lane}/drain", headers=bearer(node.admin))
        assert drained.status_code == 200
        assert drained.json() == {"lane_id": cpu_lane, "drained": True}
        lane_now = {lane.lane_id: lane for lane in (await get_snapshot(client, node.admin)).lanes}
        assert lane_now[cpu_lane].drained
        refused = await client.post(
            "/v1/invocations", json=builtin_request("cpu-1"), headers=bearer(node.scheduler)
        )
        assert refused.status_code == 409 and error_code(refused) == "lane_drained"
        resumed = await client.post(f"/v1/lanes/{cpu_lane}/resume", headers=bearer(node.admin))
        assert resumed.status_code == 200 and resumed.json()["drained"] is False
        again = await client.post(
            "/v1/invocations", json=builtin_request("cpu-1"), headers=bearer(node.scheduler)
        )
        assert again.status_code == 202, again.text
        unknown = await client.post(
            "/v1/lanes/lane_0000000000000000/drain", headers=bearer(node.admin)
        )
        assert unknown.status_code == 404 and error_code(unknown) == "unknown_lane"
        malformed = await client.post("/v1/lanes/not-a-lane/drain", headers=bearer(node.admin))
        assert malformed.status_code == 400 and error_code(malformed) == "invalid_identifier"


async def test_a_live_invocation_trades_its_token_for_a_fresh_one(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path, "--token-ttl", "2") as node,
        httpx.AsyncClient(base_url=node.url, timeout=5) as client,
    ):
        accepted = await submit(client, node, gpu_request("long"))
        lane, old = next(iter(accepted["tokens"].items()))
        other = await submit(client, node, gpu_request("other", isolation="partitioned"))
        other_lane = next(iter(other["tokens"]))
        noop = {"op": "execute", "kernel": "noop"}
        await trio.sleep(1)  # a token refreshes once half its life (here 2 s) is used

        fresh = await client.post(f"/v1/lanes/{lane}/token", headers=bearer(old))
        assert fresh.status_code == 200, fresh.text
        reply = msgspec.json.decode(fresh.content, type=TokenReply)
        assert reply.lane_id == lane and reply.token != old and reply.expires_at.endswith("Z")
        new = reply.token
        ok = await client.post(f"/v1/lanes/{lane}/work", json=noop, headers=bearer(new))
        assert ok.status_code == 200, ok.text
        # The traded-in token is dead, on lane work and for another refresh.
        stale = await client.post(f"/v1/lanes/{lane}/work", json=noop, headers=bearer(old))
        assert (stale.status_code, error_code(stale)) == (401, "revoked")
        again = await client.post(f"/v1/lanes/{lane}/token", headers=bearer(old))
        assert (again.status_code, error_code(again)) == (401, "revoked")
        # A token refreshes only on its own lane; an operator secret is no token.
        elsewhere = await client.post(f"/v1/lanes/{other_lane}/token", headers=bearer(new))
        assert (elsewhere.status_code, error_code(elsewhere)) == (403, "wrong_audience")
        secret = await client.post(f"/v1/lanes/{lane}/token", headers=bearer(node.scheduler))
        assert secret.status_code == 401
        # Once the invocation ends, nothing refreshes.
        ended = await client.delete("/v1/invocations/long", headers=bearer(node.scheduler))
        assert ended.status_code == 200
        after = await client.post(f"/v1/lanes/{lane}/token", headers=bearer(new))
        assert (after.status_code, error_code(after)) == (401, "revoked")


async def test_a_refresh_early_in_the_token_life_is_429_with_retry_after(
    daemon: SharedDaemon,
) -> None:
    async with daemon.node(client_timeout=5) as node:  # tokens of 600 s
        client = node.client
        accepted = await submit(client, node, gpu_request("early"))
        lane, token = next(iter(accepted["tokens"].items()))
        early = await client.post(f"/v1/lanes/{lane}/token", headers=bearer(token))
        assert (early.status_code, error_code(early)) == (429, "refresh_too_early")
        assert 290 <= int(early.headers["Retry-After"]) <= 300
        # Refused, the token is still the current one and still works.
        noop = {"op": "execute", "kernel": "noop"}
        ok = await client.post(f"/v1/lanes/{lane}/work", json=noop, headers=bearer(token))
        assert ok.status_code == 200, ok.text


async def test_readyz_says_when_the_token_table_is_full_until_work_ends(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node.daemon, "LIVE_TOKENS", 1)
    async with (
        running_daemon(tmp_path) as running,
        httpx.AsyncClient(base_url=running.url, timeout=5) as client,
    ):
        assert (await client.get("/readyz")).status_code == 200
        await submit(client, running, builtin_request("first", args={"seconds": 60}))
        refused = await client.post(
            "/v1/invocations", json=builtin_request("second"), headers=bearer(running.scheduler)
        )
        assert (refused.status_code, error_code(refused)) == (503, "token_unavailable")
        full = await client.get("/readyz")
        assert (full.status_code, error_code(full)) == (503, "not_ready")
        reasons = msgspec.json.decode(full.content, type=ErrorEnvelope).error.details["reasons"]
        assert reasons["tokens"].startswith("token_table_full")
        ended = await client.delete("/v1/invocations/first", headers=bearer(running.scheduler))
        assert ended.status_code == 200
        assert (await client.get("/readyz")).status_code == 200
        await submit(client, running, builtin_request("second"))
