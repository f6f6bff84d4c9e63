"""How a sandboxed guest is ended: SIGTERM to its own processes inside the sandbox,
`--kill-grace` seconds to clean up, then the whole sandbox and cgroup are killed.

SIGTERM to bubblewrap itself would kill it at once, and with it (the kernel's end of
its pid namespace) the guest by SIGKILL: a guest's TERM handler never ran. Each test
waits for the guest to say `ready` in its logs before ending it, so its handler is
installed by then.
"""

from __future__ import annotations

import pathlib
from typing import Any

import trio

from tests.adversarial.fixtures import Node, host_port
from tests.confinement.guests import (
    WAIT_SECONDS,
    confined_node,
    guest_pid,
    process,
    run_to_end,
    wait_gone,
)

# Cleans up on SIGTERM and says so; `sleep` keeps it from spinning a CPU meanwhile.
TRAPS_TERM = 'trap "echo cleaned; exit 0" TERM; echo ready; while :; do sleep 0.1; done'
# The trap is a child's: the shell that runs it has none and dies of its SIGTERM at
# once. Its cleanup takes a while, so it runs only if the sandbox outlives that shell.
CHILD_TRAPS_TERM = (
    'sh -c \'trap "sleep 0.5; echo cleaned; exit 0" TERM; echo ready; '
    "while :; do sleep 0.1; done'; echo after"
)
# Kills its own process group on exit, as many scripts do, leaving a child that ignores
# SIGTERM: the guest's own SIGTERM is not the node's ending, so nothing waits for that
# child (the sandbox's end takes it, as a guest's leftovers always were).
KILLS_ITS_GROUP = "trap 'kill 0' EXIT; (trap '' TERM; sleep 30) & sleep 0.2; exit 0"
# Ignores SIGTERM (its `sleep` children inherit that): only SIGKILL ends it.
IGNORES_TERM = 'trap "" TERM; echo ready; while :; do sleep 0.1; done # stubborn'


def guest(script: str, **fields: Any) -> dict[str, Any]:
    return process(["/bin/sh", "-c", script], **fields)


async def stdout_of(node: Node, invocation_id: str) -> bytes:
    reply = await node.client.get(
        f"/v1/invocations/{invocation_id}/logs", params={"stream": "stdout"}, headers=node.op
    )
    assert reply.status_code == 200, reply.text
    return reply.content


async def until_ready(node: Node, invocation_id: str) -> None:
    """Follow the guest's stdout until it says `ready` (its TERM trap is set by then).

    Over a raw HTTP/1.0 connection: no client library generator is left half read."""
    host, port = host_port(node.url)
    request = (
        f"GET /v1/invocations/{invocation_id}/logs?stream=stdout&follow=1 HTTP/1.0\r\n"
        f"Host: {host}:{port}\r\nAuthorization: {node.op['Authorization']}\r\n\r\n"
    )
    seen = b""
    with trio.fail_after(WAIT_SECONDS):
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            await stream.send_all(request.encode())
            while b"\r\n\r\n" not in seen or b"ready\n" not in seen.partition(b"\r\n\r\n")[2]:
                data = await stream.receive_some(65536)
                if not data:
                    raise AssertionError(f"the guest ended without saying ready: {seen!r}")
                seen += data
    assert seen.startswith(b"HTTP/1.1 200") or seen.startswith(b"HTTP/1.0 200"), seen


async def cancel(node: Node, invocation_id: str) -> tuple[dict[str, Any], float]:
    """DELETE it; its final status and how long the cancel took."""
    started = trio.current_time()
    reply = await node.client.delete(f"/v1/invocations/{invocation_id}", headers=node.op)
    assert reply.status_code == 200, reply.text
    found: dict[str, Any] = reply.json()
    return found, trio.current_time() - started


async def cancelled_when_ready(node: Node, script: str) -> tuple[bytes, float]:
    """Run `script`, cancel it once it says `ready`: its stdout and how long the cancel took."""
    body = guest(script)
    await node.submit(body)
    await until_ready(node, body["id"])
    found, took = await cancel(node, body["id"])
    assert (found["state"], found["reason"]) == ("cancelled", "cancel_requested"), found
    return await stdout_of(node, body["id"]), took


async def test_a_cancelled_guest_runs_its_term_trap_and_its_output_is_kept(
    tmp_path: pathlib.Path,
) -> None:
    # A long grace: the guest ends itself on SIGTERM, nothing waits for the grace.
    async with confined_node(tmp_path, "--kill-grace", "30") as node:
        stdout, took = await cancelled_when_ready(node, TRAPS_TERM)
        assert stdout == b"ready\ncleaned\n"
        assert took < 10, f"the cancel waited {took:.1f}s for a guest that ended on SIGTERM"


async def test_every_guest_process_gets_the_grace_not_only_the_first(
    tmp_path: pathlib.Path,
) -> None:
    # The guest's first process dies of SIGTERM at once; its child's trap still runs.
    async with confined_node(tmp_path, "--kill-grace", "30") as node:
        stdout, took = await cancelled_when_ready(node, CHILD_TRAPS_TERM)
        assert stdout == b"ready\ncleaned\n"
        assert took < 10, f"the cancel waited {took:.1f}s for guests that ended on SIGTERM"


async def test_a_guests_own_sigterm_to_its_group_does_not_hold_its_end(
    tmp_path: pathlib.Path,
) -> None:
    async with confined_node(tmp_path, "--kill-grace", "30") as node:
        started = trio.current_time()
        found = await run_to_end(node, guest(KILLS_ITS_GROUP))
        # Its `kill 0` ended the shell too: 128 + SIGTERM, as from any shell.
        assert (found["state"], found["exit_code"]) == ("failed", 143), found
        assert trio.current_time() - started < 10, "the end waited for what the guest left"


async def test_a_guest_that_ignores_sigterm_is_killed_after_the_kill_grace(
    tmp_path: pathlib.Path,
) -> None:
    async with confined_node(tmp_path, "--kill-grace", "1") as node:
        body = guest(IGNORES_TERM)
        await node.submit(body)
        await until_ready(node, body["id"])
        pid = await guest_pid(node, body["id"], "stubborn")
        found, took = await cancel(node, body["id"])
        assert found["state"] == "cancelled", found
        assert 1.0 <= took < 10, f"cancelled in {took:.1f}s with a kill grace of 1s"
        assert wait_gone([pid], 0) == [], "the guest outlived its cancel"


async def test_a_guest_past_its_timeout_runs_its_term_trap(tmp_path: pathlib.Path) -> None:
    async with confined_node(tmp_path, "--kill-grace", "30") as node:
        body = guest(TRAPS_TERM, timeout_s=3)
        await node.submit(body)
        await until_ready(node, body["id"])  # well within its 3 s
        found = await run_to_end(node, body)
        assert (found["state"], found["reason"]) == ("timed_out", "deadline_exceeded"), found
        assert await stdout_of(node, body["id"]) == b"ready\ncleaned\n"


async def test_a_guest_running_at_shutdown_runs_its_term_trap(tmp_path: pathlib.Path) -> None:
    # The fixture's daemon has --shutdown-grace 0: the guest is cancelled at once.
    async with confined_node(tmp_path, "--kill-grace", "30") as node:
        body = guest(TRAPS_TERM)
        await node.submit(body)
        await until_ready(node, body["id"])
        sup = node.daemon.supervisor
        assert sup is not None
        ended = sup.until_ended(body["id"])
        assert ended is not None
        node.daemon.stop.set()
        with trio.fail_after(WAIT_SECONDS):
            await ended.wait()
        final = sup.get(body["id"])
        assert (final.state.value, final.reason) == ("cancelled", "shutdown"), final
    log = tmp_path / "state" / "logs" / f"{body['id']}.stdout"
    assert log.read_bytes() == b"ready\ncleaned\n"
