"""What the node says and does when it cannot confine guests as it should."""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest
import trio

import node.guest_keeper
import node.guests
from node.daemon import Daemon
from tests.adversarial.fixtures import running_node
from tests.api_fixtures import daemon_config
from tests.confinement.guests import confined_node, process, python, run_to_end

SELF_TEST_UID = 200_611


async def test_process_work_with_zero_cpu_or_memory_is_refused(tmp_path: pathlib.Path) -> None:
    async with running_node(tmp_path) as node:
        for resources in ({"cpu_millis": 0}, {"memory_bytes": 0}):
            body = python("print(1)")
            body["resources"].update(resources)
            reply = await node.client.post("/v1/invocations", json=body, headers=node.op)
            assert reply.status_code == 422, reply.text
            assert "above 0" in reply.json()["error"]["message"]


async def test_serve_without_a_sandbox_tool_refuses_process_work_and_says_why(
    tmp_path: pathlib.Path,
) -> None:
    async with running_node(tmp_path, "--sandbox-tool", "/nonexistent/bwrap") as node:
        ready = await node.client.get("/readyz")
        assert ready.status_code == 503
        assert "sandbox tool" in ready.json()["error"]["details"]["reasons"]["guests"]
        reply = await node.client.post("/v1/invocations", json=python("print(1)"), headers=node.op)
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "guests_unconfinable"


async def test_unconfined_guests_run_only_when_the_operator_allows_it(
    tmp_path: pathlib.Path,
) -> None:
    argv = ("--sandbox-tool", "/nonexistent/bwrap", "--allow-unconfined-guests")
    async with running_node(tmp_path, *argv) as node:
        assert (await node.client.get("/readyz")).status_code == 200
        notes = (await node.snapshot())["notes"]
        assert any("--allow-unconfined-guests" in note for note in notes), notes
        found = await run_to_end(node, python("import os; print(os.getuid())"))
        assert found["state"] == "succeeded", found
        # Still its own uid: only the sandbox is missing.
        assert int(found["stdout_tail"]) not in (0, os.geteuid())


async def test_dev_that_cannot_switch_users_says_so_and_still_sandboxes(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node.guests, "can_switch_users", lambda: False)
    # Whatever this host's /etc/subuid gives root: none here.
    monkeypatch.setattr(node.guests, "SUBUID_FILE", tmp_path / "no-subuid")
    daemon = Daemon(daemon_config(tmp_path), handle_signals=False, dev=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        machine = daemon.machine
        assert machine is not None and daemon.supervisor is not None
        snapshot = daemon.context.snapshots
        assert snapshot is not None
        notes = snapshot.current().notes
        assert any("cannot switch users" in note for note in notes), notes
        shared = [note for note in notes if note.startswith("dev_guests_share_uid: ")]
        assert len(shared) == 1 and "no subordinate uids" in shared[0], notes
        assert daemon.readiness.ready
        assert daemon.supervisor.guests.uids is None
        assert daemon.supervisor.guests.bwrap is not None
        daemon.stop.set()


async def test_the_start_up_check_starts_its_sandbox_the_way_guests_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bwrap = pathlib.Path(shutil.which("bwrap") or "bwrap")
    assert await node.guests._sandbox_works(bwrap, SELF_TEST_UID) is None
    # A uid drop that cannot work here would stop every guest: start-up must see it.
    monkeypatch.setattr("supervisor.launch.find_setpriv", lambda: "/bin/false")
    failure = await node.guests._sandbox_works(bwrap, SELF_TEST_UID)
    assert failure is not None and "failed here (exit 1)" in failure


async def test_a_keeper_that_cannot_run_in_the_sandbox_is_left_out_and_said(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As on a host whose run folder is mounted noexec: the sandbox works without it.
    unrunnable = tmp_path / "keeper"
    unrunnable.write_bytes(b"not a program")
    unrunnable.chmod(0o644)
    monkeypatch.setattr(node.guest_keeper, "keeper_path", lambda gate, run_dir: unrunnable)
    async with confined_node(tmp_path) as node_:
        notes = (await node_.client.get("/v1/snapshot", headers=node_.op)).json()["notes"]
        assert any("without litegraph-gate's keeper" in n for n in notes), notes
        sup = node_.daemon.supervisor
        assert sup is not None and sup.guests.keeper is None and sup.guests.bwrap is not None
        found = await run_to_end(node_, process(["true"]))
        assert found["state"] == "succeeded", found
