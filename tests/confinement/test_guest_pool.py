"""Ready sandboxes (`--sandbox-pool`): a guest started in one runs as one started
directly would, sees nothing of the guest before it, and none outlives a killed
daemon (its cgroups are removed at the next start, its processes are gone)."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import sys
import time

import httpx
import pytest
import trio

from machine.cgroups import pool_cgroup_prefix, system_cgroups
from machine.journal import JournalError
from tests.adversarial.fixtures import Node, subprocess_node
from tests.confinement.guests import confined_node, process, python, run_to_end
from tests.confinement.test_guest_endings import CHILD_TRAPS_TERM, cancelled_when_ready, guest
from tests.helpers import clean_env

pytestmark = pytest.mark.skipif(
    not (pathlib.Path(sys.executable).parent / "litegraph-gate").exists(),
    reason="litegraph-gate is not built (make builds it with cc): no sandbox is pooled",
)

# What a guest shows of itself: uid, groups, its cgroups, its environment, its tokens,
# and what its /tmp and run folder hold (a mark left by the guest before it, if any).
_LOOK = (
    "import os, json, pathlib\n"
    "tokens = os.environ['LITEGRAPH_CAPABILITY_TOKEN_FILE']\n"
    "print(json.dumps({'uid': os.getuid(), 'groups': os.getgroups(),\n"
    "  'cgroup': open('/proc/self/cgroup').read(), 'env': sorted(os.environ),\n"
    "  'tokens': open(tokens).read().count('v4.public.'),\n"
    "  'token_mode': oct(os.stat(tokens).st_mode & 0o777),\n"
    "  'tmp': sorted(os.listdir('/tmp')), 'cwd': os.getcwd(),\n"
    "  'caps': [l.split()[1] for l in open('/proc/self/status') if l.startswith('Cap')]}))\n"
    "pathlib.Path('/tmp/left-by-me').write_text('x')\n"
)


async def _pool_figures(node: Node) -> dict[str, float]:
    reply = await node.client.get("/metrics", headers=node.adm)
    assert reply.status_code == 200, reply.text
    found = {}
    for line in reply.text.splitlines():
        match = re.fullmatch(
            r'(litegraph_guest_starts_total\{path="(\w+)"\}|litegraph_sandbox_pool_ready) (\S+)',
            line,
        )
        if match:
            found[match.group(2) or "ready_now"] = float(match.group(3))
    return found


async def _pool_filled(node: Node, count: int = 1) -> None:
    with trio.fail_after(30):
        while (await _pool_figures(node)).get("ready_now", 0) < count:  # noqa: ASYNC110
            await trio.sleep(0.02)


async def _look(node: Node) -> dict[str, object]:
    import json

    ended = await run_to_end(node, python(_LOOK))
    assert ended["state"] == "succeeded", ended
    seen: dict[str, object] = json.loads(ended["stdout_tail"])
    seen["status_uid"] = ended["uid"]
    return seen


async def test_a_guest_in_a_ready_sandbox_runs_as_one_started_directly_would(
    tmp_path: pathlib.Path,
) -> None:
    async with confined_node(tmp_path) as node:
        direct = await _look(node)  # the shape's first guest: made at its start
        await _pool_filled(node)
        pooled = await _look(node)
        figures = await _pool_figures(node)
        assert figures["ready"] == 1 and figures["direct"] == 1, figures
        no_caps = "0000000000000000"
        for seen in (direct, pooled):
            assert seen["uid"] == seen["status_uid"]
            inheritable, permitted, effective, _bounding, ambient = seen["caps"]  # type: ignore[misc]
            assert {inheritable, permitted, effective, ambient} == {no_caps}, seen
            assert seen["tokens"] == 1 and seen["token_mode"] == "0o400"
            assert seen["cwd"] == "/tmp"
        assert pooled["groups"] == direct["groups"] == []
        # The same environment, names for names: nothing of the stage's own leaks in.
        assert pooled["env"] == direct["env"]
        # An exit code and stderr come back from a pooled guest as from any other.
        await _pool_filled(node)
        failed = await run_to_end(node, process(["sh", "-c", "echo oops >&2; exit 3"]))
        assert failed["state"] == "failed" and failed["exit_code"] == 3, failed
        assert "oops" in failed["stderr_tail"]
        assert (await _pool_figures(node))["ready"] == 2


async def test_nothing_one_guest_left_reaches_the_next_in_a_ready_sandbox(
    tmp_path: pathlib.Path,
) -> None:
    async with confined_node(tmp_path) as node:
        seen = []
        for _ in range(3):
            if seen:
                await _pool_filled(node)
            seen.append(await _look(node))
        assert (await _pool_figures(node))["ready"] == 2
        # Each its own uid, its own cgroups, an empty /tmp: the mark each guest left
        # in its /tmp is seen by none after it.
        assert len({s["uid"] for s in seen}) == 3
        assert all(s["tmp"] == [] for s in seen), seen


def _pool_cgroups(state_dir: pathlib.Path) -> set[pathlib.Path]:
    found = system_cgroups()
    assert not isinstance(found, str) and hasattr(found, "leftovers"), found
    prefix = pool_cgroup_prefix(state_dir)
    return {pathlib.Path(name) for name in found.leftovers() if name.startswith(prefix)}


def _processes_of(uids: set[int]) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                status = pathlib.Path(f"/proc/{entry}/status").read_text()
            except OSError:
                continue
            fields = dict(row.partition(":")[::2] for row in status.splitlines())
            if "Z" in fields.get("State", ""):
                continue
            if int(fields.get("Uid", "0").split()[0]) in uids:
                pids.append(int(entry))
    return pids


def _wait(what: str, check: object, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.05)


def test_a_killed_daemon_with_a_full_pool_leaves_no_cgroup_or_process_behind(
    tmp_path: pathlib.Path,
) -> None:
    env = clean_env()
    uids = set(range(300300, 300332))
    argv = ("--guest-uids", "300300-300331", "--max-running", "4")
    with subprocess_node(tmp_path, *argv, env=env) as (daemon, url, operator):
        with httpx.Client(base_url=url, headers=operator, timeout=10) as client:
            body = process(["true"])
            assert client.post("/v1/invocations", json=body).status_code == 202

            def full() -> bool:
                return len(_pool_cgroups(tmp_path)) >= 2

            _wait("a full pool", full)
        before = _pool_cgroups(tmp_path)
        assert _processes_of(uids), "the ready sandboxes run under their uids"
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(timeout=10)
    # The stages read end of file and bwrap dies with its parent: nothing runs on.
    _wait("the ready sandboxes gone", lambda: not _processes_of(uids))
    with subprocess_node(tmp_path, *argv, env=env):
        assert not (before & _pool_cgroups(tmp_path)), "a dead daemon's pooled cgroup was kept"


async def test_two_shapes_in_use_share_the_pool(tmp_path: pathlib.Path) -> None:
    small = {"cpu_millis": 250, "memory_bytes": 128 * 2**20}
    async with confined_node(tmp_path) as node:
        first = await run_to_end(node, process(["true"]))  # fills the pool with its shape
        await _pool_filled(node, 4)
        other = await run_to_end(node, process(["true"], resources=small))
        assert first["state"] == other["state"] == "succeeded"
        with trio.fail_after(30):
            while (await _pool_figures(node))["ready_now"] < 4:  # noqa: ASYNC110
                await trio.sleep(0.02)
        # Each shape in use now has ready sandboxes of its own: both start in one.
        for body in (process(["true"]), process(["true"], resources=small)):
            await _pool_filled(node, 4)
            assert (await run_to_end(node, body))["state"] == "succeeded"
        figures = await _pool_figures(node)
        assert figures["direct"] == 2 and figures["ready"] == 2, figures


async def test_every_process_of_a_pooled_guest_gets_the_grace(tmp_path: pathlib.Path) -> None:
    # As a directly started guest (test_guest_endings): the stage keeps its guest.
    async with confined_node(tmp_path, "--kill-grace", "30") as node:
        await run_to_end(node, guest(CHILD_TRAPS_TERM.replace("while", "exit 0; while")))
        await _pool_filled(node)
        stdout, _took = await cancelled_when_ready(node, CHILD_TRAPS_TERM)
        assert stdout == b"ready\ncleaned\n"
        assert (await _pool_figures(node))["ready"] == 1


async def test_a_pooled_guest_whose_start_cannot_be_journaled_never_runs(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As for a direct start: a crash could leave it unrecorded, so its stage gets no
    # message and the sandbox is ended; the pool goes on with the next guest.
    async with confined_node(tmp_path) as node:
        assert (await run_to_end(node, process(["true"])))["state"] == "succeeded"
        await _pool_filled(node)
        machine = node.daemon.machine
        assert machine is not None
        real = machine.process_started

        async def refused(*args: object) -> None:
            raise JournalError("injected: the start record cannot be written")

        monkeypatch.setattr(machine, "process_started", refused)
        said = process(["sh", "-c", "echo ran"])
        failed = await run_to_end(node, said)
        assert failed["state"] == "failed" and "JournalError" in failed["reason"], failed
        assert "ran" not in failed["stdout_tail"]
        assert (await _pool_figures(node))["ready"] == 1  # it was a pooled start
        monkeypatch.setattr(machine, "process_started", real)
        await _pool_filled(node)
        again = await run_to_end(node, process(["sh", "-c", "echo ran"]))
        assert again["state"] == "succeeded" and again["stdout_tail"] == "ran\n", again
