"""GET /v1/invocations/{id}/logs over real HTTP: every byte, live, after the end and
after a restart, under the same roles as reading the invocation."""

from __future__ import annotations

import pathlib

import httpx
import msgspec
import trio

from api.errors import ErrorEnvelope
from supervisor.wire import InvocationState
from tests.api_fixtures import bearer, builtin_request, running_daemon, wait_for_state
from tests.disk_fixtures import free_bytes, small_tmpfs
from tests.helpers import guest_cwd


def _process(invocation_id: str, script: str) -> dict[str, object]:
    return {
        "id": invocation_id,
        "work": {"kind": "process", "argv": ["sh", "-c", script], "cwd": str(guest_cwd())},
        "resources": {"cpu_millis": 100, "memory_bytes": 2**28},
    }


def _code(reply: httpx.Response) -> str:
    return msgspec.json.decode(reply.content, type=ErrorEnvelope).error.code


async def test_logs_hold_every_byte_and_survive_a_restart(tmp_path: pathlib.Path) -> None:
    script = "seq 1 200000; echo oops >&2"
    async with running_daemon(tmp_path) as node:
        async with httpx.AsyncClient(base_url=node.url, timeout=30) as client:
            accepted = await client.post(
                "/v1/invocations", json=_process("big", script), headers=bearer(node.scheduler)
            )
            assert accepted.status_code == 202, accepted.text
            done = await wait_for_state(client, node.scheduler, "big", seconds=60)
            assert done.state is InvocationState.succeeded and done.logs_cut is None
            reply = await client.get("/v1/invocations/big/logs", headers=bearer(node.scheduler))
            assert reply.status_code == 200, reply.text
            assert reply.headers["content-type"] == "application/octet-stream"
            assert len(reply.content.splitlines()) == 200000
            assert len(reply.content) == done.stdout_bytes
            tail = await client.get(
                "/v1/invocations/big/logs",
                params={"offset": str(done.stdout_bytes - 7)},
                headers=bearer(node.admin),
            )
            assert tail.content == b"200000\n"
    async with running_daemon(tmp_path) as node:
        async with httpx.AsyncClient(base_url=node.url, timeout=30) as client:
            err = await client.get(
                "/v1/invocations/big/logs",
                params={"stream": "stderr", "follow": "1"},
                headers=bearer(node.scheduler),
            )
            assert err.status_code == 200 and err.content == b"oops\n"


async def test_a_follower_gets_output_while_the_invocation_runs(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=30) as client,
    ):
        body = _process("slow", "echo before; sleep 3; echo after")
        accepted = await client.post("/v1/invocations", json=body, headers=bearer(node.scheduler))
        assert accepted.status_code == 202, accepted.text
        got = b""
        async with client.stream(
            "GET",
            "/v1/invocations/slow/logs",
            params={"follow": "1"},
            headers=bearer(node.scheduler),
        ) as reply:
            assert reply.status_code == 200
            async for chunk in reply.aiter_bytes():
                if not got:  # the first line arrives while the guest still sleeps
                    status = (
                        await client.get("/v1/invocations/slow", headers=bearer(node.scheduler))
                    ).json()
                    assert status["state"] == "running", status
                got += chunk
        assert got == b"before\nafter\n"
        done = await wait_for_state(client, node.scheduler, "slow")
        assert done.state is InvocationState.succeeded


async def test_an_invocation_that_writes_nothing_has_no_files_and_empty_logs(
    tmp_path: pathlib.Path,
) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        body = builtin_request("quiet", "echo", {"text": ""})
        await client.post("/v1/invocations", json=body, headers=bearer(node.scheduler))
        done = await wait_for_state(client, node.scheduler, "quiet")
        assert done.state is InvocationState.succeeded and done.stdout_bytes == 0
        assert list((tmp_path / "state" / "logs").iterdir()) == []
        for stream in ("stdout", "stderr"):
            reply = await client.get(
                "/v1/invocations/quiet/logs",
                params={"stream": stream, "follow": "1"},
                headers=bearer(node.scheduler),
            )
            assert reply.status_code == 200 and reply.content == b"", reply.text
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        # Nothing on disk told the new run about it: its logs are empty, not lost.
        reply = await client.get("/v1/invocations/quiet/logs", headers=bearer(node.scheduler))
        assert reply.status_code == 200 and reply.content == b"", reply.text
        assert reply.headers["cache-control"] == "no-store"


async def test_logs_cut_at_the_bound_say_so_in_the_status(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path, "--logs-max-bytes", "4") as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        body = builtin_request("echo", "echo", {"text": "hello world"})
        await client.post("/v1/invocations", json=body, headers=bearer(node.scheduler))
        done = await wait_for_state(client, node.scheduler, "echo")
        assert done.state is InvocationState.succeeded  # its truth does not depend on logs
        assert done.logs_cut == "invocation_limit" and done.stdout_tail == "hello world"
        reply = await client.get("/v1/invocations/echo/logs", headers=bearer(node.scheduler))
        assert reply.content == b"hell"


async def test_another_tenants_output_never_evicts_logs_within_their_share(
    tmp_path: pathlib.Path,
) -> None:
    async with (
        running_daemon(
            tmp_path, "--logs-max-bytes", "16KiB", "--logs-total-bytes", "64KiB"
        ) as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        headers = bearer(node.scheduler)
        await client.post("/v1/invocations", json=_process("victim", "echo 42"), headers=headers)
        await wait_for_state(client, node.scheduler, "victim")
        for n in range(6):  # 6 x 16 KiB kept (of 20 KB printed) against a 64 KiB total
            body = _process(f"noisy-{n}", "head -c 20000 /dev/zero")
            await client.post("/v1/invocations", json=body, headers=headers)
            await wait_for_state(client, node.scheduler, f"noisy-{n}")
        victim = await client.get("/v1/invocations/victim/logs", headers=headers)
        assert victim.status_code == 200 and victim.content == b"42\n"
        assert (await wait_for_state(client, node.scheduler, "victim")).logs_cut is None
        first = await wait_for_state(client, node.scheduler, "noisy-0")
        assert first.logs_cut == "evicted"
        gone = await client.get("/v1/invocations/noisy-0/logs", headers=headers)
        assert gone.status_code == 404 and _code(gone) == "logs_unavailable"
        last = await wait_for_state(client, node.scheduler, "noisy-5")
        assert last.logs_cut == "invocation_limit"


async def test_logs_stop_above_the_disk_floor_and_the_journal_keeps_room(
    tmp_path: pathlib.Path,
) -> None:
    # The finding: a guest printing more than the state folder's disk holds ended
    # `write_failed: disk full`, and every later submission was 503 (no journal room).
    floor = 4 * 2**20
    with small_tmpfs(tmp_path / "state", "40m") as state:  # 16 MiB of it the journal's reserve
        async with (
            running_daemon(tmp_path, "--state-min-free", "4MiB") as node,
            httpx.AsyncClient(base_url=node.url, timeout=30) as client,
        ):
            headers = bearer(node.scheduler)
            body = _process("loud", "head -c 40000000 /dev/zero")
            accepted = await client.post("/v1/invocations", json=body, headers=headers)
            assert accepted.status_code == 202, accepted.text
            loud = await wait_for_state(client, node.scheduler, "loud", seconds=60)
            assert loud.state is InvocationState.succeeded and loud.logs_cut == "disk_floor"
            assert loud.stdout_bytes == 40000000  # the guest's output was all read
            # Logs never go under the floor; only the journal may (its few records).
            assert free_bytes(state) > floor - 2**20
            kept = await client.get("/v1/invocations/loud/logs", headers=headers)
            assert 0 < len(kept.content) < 24 * 2**20
            for n in range(3):  # the journal still writes: submissions are accepted
                body = _process(f"after-{n}", "echo 42")
                accepted = await client.post("/v1/invocations", json=body, headers=headers)
                assert accepted.status_code == 202, accepted.text
                after = await wait_for_state(client, node.scheduler, f"after-{n}")
                assert after.state is InvocationState.succeeded and after.stdout_tail == "42\n"
                assert after.logs_cut == "disk_floor"  # no room above the floor: not kept
            assert free_bytes(state) > floor - 2**20


async def test_logs_refusals(tmp_path: pathlib.Path) -> None:
    async with (
        running_daemon(tmp_path) as node,
        httpx.AsyncClient(base_url=node.url, timeout=10) as client,
    ):
        body = builtin_request("e", "echo", {"text": "hi"})
        await client.post("/v1/invocations", json=body, headers=bearer(node.scheduler))
        await wait_for_state(client, node.scheduler, "e")
        assert (await client.get("/v1/invocations/e/logs")).status_code == 401
        wrong = await client.get("/v1/invocations/e/logs", headers=bearer("nope"))
        assert wrong.status_code == 401
        for query in (
            {"stream": "stdin"},
            {"offset": "-1"},
            {"offset": "x"},
            {"follow": "2"},
            {"": "1"},
        ):
            bad = await client.get(
                "/v1/invocations/e/logs", params=query, headers=bearer(node.scheduler)
            )
            assert bad.status_code == 400 and _code(bad) == "invalid_query", query
        unknown = await client.get("/v1/invocations/nope/logs", headers=bearer(node.scheduler))
        assert unknown.status_code == 404 and _code(unknown) == "unknown_invocation"
        past = await client.get(
            "/v1/invocations/e/logs", params={"offset": "99"}, headers=bearer(node.scheduler)
        )
        assert past.status_code == 200 and past.content == b""
        with trio.fail_after(5):
            ok = await client.get("/v1/invocations/e/logs", headers=bearer(node.scheduler))
        assert ok.content == b"hi"
