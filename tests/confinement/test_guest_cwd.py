"""A guest's cwd: the folder checked is the folder bound, no cwd covers the
sandbox's own places or reaches the node's state (issue 22, findings 1 and 2), and
every cwd really lies under one of the operator's roots (`--guest-cwd-roots`)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

import httpx
import pytest
import trio

from node.cli import COMMANDS, Invocation, dev_config
from node.flags import load_flag_table, parse_argv
from tests.adversarial.fixtures import Node
from tests.api_fixtures import running_daemon
from tests.confinement.guests import (
    TERMINAL,
    confined_node,
    guest_cwd,
    process,
    python,
    run_to_end,
    status,
)
from tests.helpers import guest_run_dir

# Flips `link` as fast as it can, to the harmless folder three times in four (most
# guests pass their checks, many then race the flip); each rename is atomic, so the
# name always leads to one of the two.
FLIPPER = """
import os, sys
link, harmless, refused = sys.argv[1:4]
os.nice(19)  # flips whenever a core is free, never slows the guests down
new = link + ".new"
while True:
    for target in (harmless, harmless, harmless, refused):
        os.symlink(target, new)
        os.replace(new, link)
"""
LOOK = ["/bin/sh", "-c", "if [ -e never-visible ]; then echo SEEN; else echo clean $(pwd); fi"]
TRIES = 50  # guests that start with the flipped name as their cwd
WAVE = 25


async def _wave(node: Node, cwd: str, first: int) -> list[dict[str, Any]]:
    """WAVE guests submitted at once with `cwd`, each as it ended (refused ones left out)."""
    ids = []
    for n in range(first, first + WAVE):
        body = process(LOOK, cwd=cwd, invocation_id=f"race-{n}")
        body["resources"] = {"cpu_millis": 200, "memory_bytes": 64 * 2**20}
        reply = await node.client.post("/v1/invocations", json=body, headers=node.op)
        if reply.status_code == 422:  # the name led to the refused folder when admitted
            assert reply.json()["error"]["code"] == "invalid_cwd", reply.text
        else:
            assert reply.status_code == 202, reply.text
            ids.append(body["id"])
    ended = []
    with trio.fail_after(60):
        for invocation_id in ids:
            while (found := await status(node, invocation_id))["state"] not in TERMINAL:  # noqa: ASYNC110
                await trio.sleep(0.05)
            ended.append(found)
    return ended


async def test_a_cwd_symlink_flipped_while_guests_start_never_shows_what_was_refused(
    tmp_path: pathlib.Path,
) -> None:
    base = guest_cwd()
    parent, harmless, writable = base / "node", base / "harmless", base / "writable"
    for folder in (parent, harmless, writable):
        folder.mkdir(mode=0o755)
    writable.chmod(0o777)  # a folder guests can write: they could flip the link themselves
    (parent / "never-visible").write_text("the state folder's neighbour\n")
    (parent / "never-visible").chmod(0o644)
    link = writable / "link"
    link.symlink_to(harmless)
    ended: list[dict[str, Any]] = []
    async with confined_node(tmp_path, "--state-dir", str(parent / "state")) as node:
        flipper = subprocess.Popen(  # noqa: ASYNC220 - killed below, never awaited
            [sys.executable, "-c", FLIPPER, str(link), str(harmless), str(parent)]
        )
        try:
            # Refusals at admission are cheap; a flipper descheduled on busy cores may hold
            # the link on the refused folder for a while, so allow many of them.
            for first in range(0, 40 * TRIES, WAVE):
                if sum(found["state"] == "succeeded" for found in ended) >= TRIES:
                    break
                ended += await _wave(node, str(link), first)
            else:
                raise AssertionError(f"too few guests ran: {ended}")
        finally:
            flipper.kill()
            flipper.wait()
    seen = [found for found in ended if "SEEN" in found["stdout_tail"]]
    assert seen == [], f"{len(seen)} guests saw the state folder's parent"
    ran = [found for found in ended if found["state"] == "succeeded"]
    assert {found["stdout_tail"] for found in ran} == {f"clean {harmless}\n"}
    for found in ended:  # the others found the parent as they started: refused then
        assert found["state"] == "succeeded" or "covers the node's state folder" in str(found)


async def test_a_cwd_over_the_sandbox_or_the_state_folder_is_refused_and_changes_nothing(
    tmp_path: pathlib.Path,
) -> None:
    parent = guest_cwd()
    async with confined_node(tmp_path, "--state-dir", str(parent / "state")) as node:
        state = node.daemon.config.state_dir
        before = await node.state()
        refusals = {
            "/": "/ would cover the whole sandbox",
            "/proc": "/proc is the sandbox's private /proc",
            "/tmp": "/tmp is the sandbox's private /tmp",
            f"{state}/keys": "lies inside the node's state folder",
            str(parent): "covers the node's state folder",
        }
        for cwd, reason in refusals.items():
            body = python("print('ran')", cwd=cwd)
            reply = await node.client.post("/v1/invocations", json=body, headers=node.op)
            assert reply.status_code == 422, (cwd, reply.text)
            error = reply.json()["error"]
            assert error["code"] == "invalid_cwd", (cwd, error)
            assert reason in error["message"] and error["details"] == {"field": "cwd"}, error
            assert await node.state() == before, cwd  # no reservation, token or invocation


# -- the operator's allow-list: --guest-cwd-roots (issue 22) --------------------------

WHERE = "import os; print(os.getcwd())"


async def _refused_cwd(node: Node, cwd: str | pathlib.Path) -> str:
    """The message of a 422 `invalid_cwd` for `cwd`, once shown to have changed nothing."""
    before = await node.state()
    reply = await node.client.post(
        "/v1/invocations", json=python(WHERE, cwd=str(cwd)), headers=node.op
    )
    assert reply.status_code == 422, (cwd, reply.text)
    error = reply.json()["error"]
    assert (error["code"], error["details"]) == ("invalid_cwd", {"field": "cwd"}), error
    assert await node.state() == before, cwd  # no reservation, token or invocation
    message: str = error["message"]
    return message


async def test_serve_without_cwd_roots_refuses_every_cwd_and_a_guest_without_one_runs_in_tmp(
    tmp_path: pathlib.Path,
) -> None:
    # `[]` is serve's default (unit/node/test_config.py); the test harness gives roots.
    folder = guest_cwd()
    async with confined_node(tmp_path, "--guest-cwd-roots", "[]") as node:
        message = await _refused_cwd(node, folder)
        assert message == (
            f"cwd: {folder}: this node allows no cwd (it has no --guest-cwd-roots or "
            "--guest-writable-roots); send no cwd and the guest starts in its private /tmp"
        )
        notes = (await node.snapshot())["notes"]
        assert any(note.startswith("no request may name a cwd") for note in notes), notes
        found = await run_to_end(node, python(WHERE))  # no cwd: its private /tmp
        assert (found["state"], found["stdout_tail"]) == ("succeeded", "/tmp\n"), found


async def test_a_cwd_must_really_lie_under_a_root_a_symlink_out_of_one_is_refused(
    tmp_path: pathlib.Path,
) -> None:
    root, outside = guest_cwd(), guest_cwd()
    inside = root / "project" / "sub"
    inside.mkdir(parents=True)
    (root / "project").chmod(0o755)
    inside.chmod(0o755)
    (root / "escape").symlink_to(outside)  # a name inside the root, a folder outside it
    (outside / "in").symlink_to(inside)  # a name outside the root, a folder inside it
    prefixed = root.with_name(root.name + "x")  # a sibling whose name starts as the root's
    prefixed.mkdir(mode=0o755)
    async with confined_node(tmp_path, "--guest-cwd-roots", json.dumps([str(root)])) as node:
        for cwd, runs_in in ((inside, inside), (root, root), (outside / "in", inside)):
            found = await run_to_end(node, python(WHERE, cwd=str(cwd)))
            assert (found["state"], found["stdout_tail"]) == ("succeeded", f"{runs_in}\n"), cwd
        for cwd, real in ((root / "escape", outside), (outside, outside), (prefixed, prefixed)):
            message = await _refused_cwd(node, cwd)
            assert message.startswith(
                f"cwd: {real} lies under none of this node's cwd roots ({root}; "
            ), message
            assert message.endswith("or send no cwd and the guest starts in its private /tmp")
        notes = (await node.snapshot())["notes"]
        assert any(note.startswith(f"a guest's cwd must lie under {root} (") for note in notes)


async def test_dev_lets_a_guest_start_in_the_folder_it_was_started_in_and_below(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, elsewhere = guest_cwd(), guest_cwd()
    (started / "sub").mkdir(mode=0o755)
    monkeypatch.chdir(started)  # where `litegraph-node dev` was typed
    table = load_flag_table()
    argv = ["dev", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state")]
    argv += ["--devices", "sim", "--shutdown-grace", "0", "--guest-run-dir", guest_run_dir()]
    config = dev_config(Invocation(table, parse_argv(table, argv, {}, tuple(COMMANDS))))
    assert config.guest_cwd_roots == (str(started),)
    async with (
        running_daemon(tmp_path, dev=True, config=config) as running,
        httpx.AsyncClient(base_url=running.url, timeout=10) as client,
    ):
        node = Node(running.url, running.scheduler, running.admin, running.daemon, client)
        for cwd in (started, started / "sub"):
            found = await run_to_end(node, python(WHERE, cwd=str(cwd)))
            assert (found["state"], found["stdout_tail"]) == ("succeeded", f"{cwd}\n"), found
        message = await _refused_cwd(node, elsewhere)
        assert f"lies under none of this node's cwd roots ({started}; " in message


# Every descriptor the guest holds beyond 0-2, and where each leads.
OPEN_FDS = r"""
import os
fds = "/proc/self/fd"
held = sorted(int(n) for n in os.listdir(fds) if int(n) > 2)
print([(n, os.readlink(f"{fds}/{n}")) for n in held if os.path.exists(f"{fds}/{n}")])
"""


async def test_a_guest_holds_no_descriptor_of_its_cwd_or_anything_outside_its_sandbox(
    tmp_path: pathlib.Path,
) -> None:
    """The finding: bwrap bound the cwd from /proc/self/fd/N and the guest inherited N,
    an O_PATH handle outside the sandbox: from it the guest walked up the host's folders
    (in dev without subordinate uids, to the node's auth.json) and wrote through a
    read-only cwd."""
    cwd = guest_cwd()
    cwd.chmod(0o755)
    async with confined_node(tmp_path) as node:
        found = await run_to_end(node, python(OPEN_FDS, cwd=str(cwd)))
    assert (found["state"], found["stdout_tail"]) == ("succeeded", "[]\n"), found


async def test_a_cwd_no_guest_uid_may_reach_is_refused_at_admission_not_at_its_start(
    tmp_path: pathlib.Path,
) -> None:
    """The finding: a cwd under a 0700 (or 0750) home was accepted (202), and the
    guest then failed at its start, so `run` could not fall back to the guest's /tmp.
    Guests have uids of their own: what no guest uid may reach is refused at once."""
    home = guest_cwd() / "home"
    work = home / "project"
    work.mkdir(parents=True, mode=0o755)
    work.chmod(0o755)
    home.chmod(0o700)
    async with confined_node(tmp_path) as node:
        message = await _refused_cwd(node, work)
        assert message.endswith("a folder above it does not let the guest's uid through"), message
        home.chmod(0o711)  # others may pass through: the guest starts there
        found = await run_to_end(node, python(WHERE, cwd=str(work)))
        assert (found["state"], found["stdout_tail"]) == ("succeeded", f"{work}\n"), found
