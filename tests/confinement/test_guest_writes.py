"""What a guest writes is bounded by its grant: its cwd is read-only unless the
operator allowed host writes under its root, and its private /tmp is a tmpfs of its
memory grant, charged to its memory cgroup (issue 22, finding 4)."""

from __future__ import annotations

import json
import pathlib

from tests.confinement.guests import (
    confined_node,
    guest_cwd,
    python,
    run_to_end,
    status,
)

MiB = 2**20
GRANT = 64 * MiB
# Writes `MiB` chunks into `fill` until refused, saying after each how many landed:
# the last number is what it managed even when the OOM killer ends it mid-way.
FILL = """
import errno, os, sys
n = 0
try:
    with open({path!r}, "wb", buffering=0) as f:
        while n < {chunks}:
            f.write(b"x" * {chunk})
            n += 1
            print(n, flush=True)
    print("wrote all", n)
except OSError as exc:
    print("refused", errno.errorcode[exc.errno], n, flush=True)
"""
STATVFS = "import os; s = os.statvfs('/tmp'); print(s.f_blocks * s.f_frsize)"


def _fill(path: str, total: int) -> dict[str, object]:
    body = python(FILL.format(path=path, chunks=total // MiB, chunk=MiB))
    body["resources"]["memory_bytes"] = GRANT
    return body


def _open_folder() -> pathlib.Path:
    """A cwd whose permissions let any guest uid write: only the bind may refuse."""
    folder = guest_cwd()
    folder.chmod(0o777)  # the test's own folder, open on purpose
    return folder


async def test_a_guest_filling_its_cwd_under_serve_defaults_is_refused_and_the_node_serves_on(
    tmp_path: pathlib.Path,
) -> None:
    cwd = _open_folder()
    # serve's default, said outright: no root where guests may write on the host. (The
    # harness's --guest-cwd-roots let the cwd be named at all: serve allows none.)
    async with confined_node(tmp_path, "--guest-writable-roots", "[]") as node:
        body = _fill("fill", 300 * MiB)
        body["work"]["cwd"] = str(cwd)
        found = await run_to_end(node, body)
        assert found["state"] == "succeeded", found
        assert found["stdout_tail"] == "refused EROFS 0\n", found["stdout_tail"]
        assert not (cwd / "fill").exists()
        # The journal took the guest's end and takes the next submission.
        after = await run_to_end(node, python("print('next')"))
        assert (after["state"], after["stdout_tail"]) == ("succeeded", "next\n"), after
        assert (await node.client.get("/readyz")).status_code == 200


async def test_a_guest_filling_its_tmp_stops_at_its_memory_grant(tmp_path: pathlib.Path) -> None:
    async with confined_node(tmp_path) as node:
        neighbour = python("import time; time.sleep(60)", invocation_id="neighbour")
        await node.submit(neighbour)
        sized = python(STATVFS)
        sized["resources"]["memory_bytes"] = GRANT
        seen = await run_to_end(node, sized)
        assert seen["state"] == "succeeded", seen
        assert int(seen["stdout_tail"]) <= GRANT, seen["stdout_tail"]  # the tmpfs's size
        found = await run_to_end(node, _fill("/tmp/fill", 300 * MiB))
        last = found["stdout_tail"].split()
        if found["state"] == "failed":  # the cgroup (the tmpfs's pages, the guest) was full
            assert found["reason"] == "oom_killed", found
            written = int(last[-1])
        else:  # the tmpfs was full first
            assert last[:2] == ["refused", "ENOSPC"], found["stdout_tail"]
            written = int(last[2])
        assert 0 < written * MiB <= GRANT, found
        assert found["usage"]["peak_memory_bytes"] <= GRANT + MiB, found["usage"]
        assert (await status(node, "neighbour"))["state"] == "running"
        after = await run_to_end(node, python("print('next')"))
        assert after["state"] == "succeeded", after


async def test_a_cwd_under_a_writable_root_is_written_on_the_host(tmp_path: pathlib.Path) -> None:
    root = _open_folder()
    project = root / "project"
    project.mkdir()
    project.chmod(0o777)  # any guest uid may write here, by design
    elsewhere = _open_folder()
    roots = json.dumps([str(root)])
    write = "open('out.txt', 'w').write('from the guest'); print('wrote')"
    async with confined_node(tmp_path, "--guest-writable-roots", roots) as node:
        found = await run_to_end(node, python(write, cwd=str(project)))
        assert (found["state"], found["stdout_tail"]) == ("succeeded", "wrote\n"), found
        assert (project / "out.txt").read_text() == "from the guest"
        assert (project / "out.txt").stat().st_uid == found["uid"]  # written as the guest
        refused = await run_to_end(node, python(write, cwd=str(elsewhere)))
        assert refused["state"] == "failed", refused
        assert "Read-only file system" in refused["stderr_tail"], refused
        assert not (elsewhere / "out.txt").exists()
