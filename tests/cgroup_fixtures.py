"""Processes for the cgroup tests: started inside an invocation cgroup, and watched
until they are really gone."""

from __future__ import annotations

import subprocess
import sys

import trio
import trio.lowlevel

from machine.cgroups import InvocationCgroup

# Leaves its process group and session, prints the pid that did, and lingers.
SETSID_GRANDCHILD = (
    "import os, time\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        print(os.getpid(), flush=True)\n"
    "        time.sleep(60)\n"
    "    os._exit(0)\n"
    "os.wait()\n"
)


async def start(inv: InvocationCgroup, code: str, *args: str) -> trio.Process:
    """`python -c code args` as a member of `inv`, its stdout a pipe."""
    return await trio.lowlevel.open_process(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        preexec_fn=inv.preexec_join(),
    )


async def read_all(proc: trio.Process) -> str:
    """Its whole stdout (until EOF), then its exit code is waited for."""
    assert proc.stdout is not None
    chunks = []
    with trio.fail_after(10):
        while chunk := await proc.stdout.receive_some():
            chunks.append(chunk)
        await proc.stdout.aclose()
        await proc.wait()
    return b"".join(chunks).decode()


async def read_line(proc: trio.Process) -> str:
    assert proc.stdout is not None
    line = b""
    with trio.fail_after(10):
        while not line.endswith(b"\n"):
            chunk = await proc.stdout.receive_some(1)
            if not chunk:
                break
            line += chunk
    return line.decode()


def alive(pid: int) -> bool:
    """Running, or stopped, but not a zombie (a zombie is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def gone_within(pid: int, seconds: float = 2.0) -> bool:
    deadline = trio.current_time() + seconds
    while alive(pid):
        if trio.current_time() >= deadline:
            return False
        await trio.sleep(0.01)
    return True


async def close(proc: trio.Process) -> None:
    """Kill (if still running) and reap it, and close its pipe."""
    if proc.returncode is None:
        proc.kill()
    with trio.move_on_after(5, shield=True):
        await proc.wait()
    if proc.stdout is not None:
        await trio.aclose_forcefully(proc.stdout)
