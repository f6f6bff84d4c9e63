"""A guest's cwd: the folder checked is the folder bound, and no cwd covers the
sandbox's own places or reaches the node's state (issue 22, findings 1 and 2)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from typing import Any

import trio

from tests.adversarial.fixtures import Node
from tests.confinement.guests import (
    TERMINAL,
    confined_node,
    guest_cwd,
    process,
    python,
    status,
)

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
