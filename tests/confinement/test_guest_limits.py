"""Limits from the reservation, enforced by the kernel's cgroups, and honest endings."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import time

import httpx
import trio

from machine.cgroups import Cgroups, system_cgroups
from tests.adversarial.fixtures import subprocess_node
from tests.confinement.guests import (
    alive,
    confined_node,
    kill_all,
    python,
    run_to_end,
    status,
    wait_gone,
)
from tests.helpers import clean_env

MiB = 2**20
ALLOCATE = "b = bytearray({n}); b[::4096] = b'x' * len(b[::4096]); print('allocated')"
BUSY = "import time\nt = time.time()\nwhile time.time() - t < {s}: pass\n"
FORK_UNTIL_REFUSED = (
    "import os, time\n"
    "n = 0\n"
    "try:\n"
    "    while n < 10000:\n"
    "        if os.fork() == 0:\n"
    "            time.sleep(30); os._exit(0)\n"
    "        n += 1\n"
    "except OSError as exc:\n"
    "    print('refused after', n, exc.errno)\n"
)
# A grandchild that leaves the process group and session, then lives on.
ESCAPE = (
    "import os, time\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        os.execvp('sleep', ['sleep', '300', '{marker}'])\n"
    "    os._exit(0)\n"
    "time.sleep(0.5)\n"
)


def host_pids_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline and b"bwrap" not in cmdline:
                found.append(int(entry))
    return [pid for pid in found if alive(pid)]


async def test_a_guest_beyond_its_memory_ends_oom_killed_and_the_rest_lives(
    tmp_path: pathlib.Path,
) -> None:
    async with confined_node(tmp_path) as node:
        neighbour = python("import time; time.sleep(60)", invocation_id="neighbour")
        await node.submit(neighbour)
        body = python(ALLOCATE.format(n=512 * MiB), invocation_id="greedy")
        body["resources"]["memory_bytes"] = 128 * MiB
        found = await run_to_end(node, body)
        assert (found["state"], found["reason"]) == ("failed", "oom_killed"), found
        assert found["usage"]["oom_killed"] is True
        assert found["usage"]["peak_memory_bytes"] <= 128 * MiB + MiB
        assert (await status(node, "neighbour"))["state"] == "running"
        assert (await node.client.get("/healthz")).status_code == 200


async def test_a_child_beyond_the_memory_ends_the_whole_invocation_oom_killed(
    tmp_path: pathlib.Path,
) -> None:
    # The kernel's OOM killer takes the biggest process, here a child; the invocation
    # (its leader sleeping on) ends with it, as one unit.
    code = (
        "import subprocess, sys, time\n"
        f"subprocess.run([sys.executable, '-c', {ALLOCATE.format(n=512 * MiB)!r}])\n"
        "time.sleep(60)\n"
    )
    async with confined_node(tmp_path) as node:
        body = python(code)
        body["resources"]["memory_bytes"] = 128 * MiB
        with trio.fail_after(20):
            found = await run_to_end(node, body)
        assert (found["state"], found["reason"]) == ("failed", "oom_killed"), found


async def test_within_its_memory_a_guest_succeeds_and_reports_its_peak(
    tmp_path: pathlib.Path,
) -> None:
    async with confined_node(tmp_path) as node:
        body = python(ALLOCATE.format(n=64 * MiB))
        body["resources"]["memory_bytes"] = 256 * MiB
        found = await run_to_end(node, body)
        assert found["state"] == "succeeded", found
        usage = found["usage"]
        assert usage["oom_killed"] is False
        assert 64 * MiB <= usage["peak_memory_bytes"] <= 256 * MiB
        assert usage["cpu_seconds"] > 0


async def test_a_busy_loop_gets_its_cpu_quota(tmp_path: pathlib.Path) -> None:
    seconds = 2.0
    async with confined_node(tmp_path) as node:
        body = python(BUSY.format(s=seconds))
        body["resources"]["cpu_millis"] = 200
        found = await run_to_end(node, body)
        assert found["state"] == "succeeded", found
        # 0.2 CPU-seconds per second, with room for a first period at full quota.
        per_second = found["usage"]["cpu_seconds"] / seconds
        assert 0.1 <= per_second <= 0.35, found["usage"]


async def test_a_fork_bomb_stops_at_the_pids_limit(tmp_path: pathlib.Path) -> None:
    async with confined_node(tmp_path, "--guest-pids-max", "32") as node:
        found = await run_to_end(node, python(FORK_UNTIL_REFUSED))
        assert found["state"] == "succeeded", found
        assert found["stdout_tail"].startswith("refused after"), found["stdout_tail"]
        assert int(found["stdout_tail"].split()[2]) < 32
        assert found["usage"]["pids_limit_hit"] is True
        assert (await node.client.get("/healthz")).status_code == 200


async def test_a_setsid_grandchild_is_gone_when_its_invocation_ends(
    tmp_path: pathlib.Path,
) -> None:
    marker = f"escape-{os.getpid()}-{time.monotonic_ns()}"
    async with confined_node(tmp_path) as node:
        found = await run_to_end(node, python(ESCAPE.format(marker=marker)))
        assert found["state"] == "succeeded", found
        left = host_pids_with(marker)
        kill_all(left)
        assert left == []


def _described(pids: list[int]) -> list[str]:
    """Each pid with its state and command line, for a failure message."""
    seen = []
    for pid in pids:
        try:
            state = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        seen.append(f"{pid} {state} {cmdline.decode(errors='replace')[:200]}")
    return seen


def test_a_setsid_grandchild_is_gone_after_a_daemon_sigkill_and_restart(
    tmp_path: pathlib.Path,
) -> None:
    marker = f"escape-{os.getpid()}-{time.monotonic_ns()}"
    env = clean_env()
    state = tmp_path / "state"
    body = python(ESCAPE.format(marker=marker).replace("time.sleep(0.5)", "time.sleep(300)"))
    try:
        with subprocess_node(state, env=env) as (proc, url, op):
            with httpx.Client(base_url=url, headers=op, timeout=10) as client:
                assert client.post("/v1/invocations", json=body).status_code == 202
                deadline = time.monotonic() + 20
                while not host_pids_with(marker) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert host_pids_with(marker), "the grandchild never started"
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        # The sandbox dies with its daemon: nothing of the guest outlives it.
        left = wait_gone(host_pids_with(marker))
        assert left == [], _described(left)
        with subprocess_node(state, env=env) as (_, url, op):
            with httpx.Client(base_url=url, headers=op, timeout=10) as client:
                snapshot = client.get("/v1/snapshot").json()
                assert snapshot["capacity"]["cpu_millis"]["allocated"] == 0, snapshot
                assert json.dumps(snapshot).count(body["id"]) == 0
            # Checked while the restarted daemon runs, so a failure shows what it said.
            cgroups = system_cgroups()
            if isinstance(cgroups, Cgroups):  # the dead daemon's cgroup is gone too
                assert body["id"] not in cgroups.leftovers()
    finally:
        kill_all(host_pids_with(marker))
