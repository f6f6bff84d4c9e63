"""Finding a sandboxed guest's processes: every descendant of the sandbox's init, read
from the pids its cgroup lists rather than from all of /proc, and nothing read once
the sandbox's leader has exited."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import machine.procgroup as procgroup
from machine.proc import read_stat
from machine.procgroup import sandbox_guest

# leader -> init -> (a sleep, and a shell with a sleep of its own)
TREE = "sh -c 'sh -c \"sleep 60; true\" & sleep 60 & wait' & wait"


@contextmanager
def _tree() -> Iterator[subprocess.Popen[bytes]]:
    leader = subprocess.Popen(["/bin/sh", "-c", TREE])
    try:
        yield leader
    finally:
        subprocess.run(["pkill", "-KILL", "-s", str(leader.pid)], check=False)
        leader.kill()
        leader.wait()


def _descendants_of(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True)
        children = {int(p) for p in out.stdout.split()}
        found |= children
        todo += children
    return found


def _until_the_guest_runs(leader: int) -> set[int]:
    deadline = time.monotonic() + 10
    while True:
        found = {s.pid for s in sandbox_guest(leader)}
        if len(found) >= 3:
            return found
        assert time.monotonic() < deadline, found
        time.sleep(0.01)


def test_the_guest_is_found_among_its_cgroups_pids_as_in_all_of_proc() -> None:
    with _tree() as leader:
        everywhere = _until_the_guest_runs(leader.pid)
        among = _descendants_of(leader.pid) | {leader.pid}
        found = {s.pid for s in sandbox_guest(leader.pid, among)}
        assert found == everywhere
        init = [p for p in among if (s := read_stat(p)) and s.ppid == leader.pid]
        assert len(init) == 1 and init[0] not in found  # the init is not the guest's
        # Pids outside the sandbox among those given are never the guest's.
        assert {s.pid for s in sandbox_guest(leader.pid, [*among, 1])} == found


def test_nothing_is_read_once_the_leader_has_exited(monkeypatch: pytest.MonkeyPatch) -> None:
    leader = subprocess.Popen(["/bin/true"])
    while read_stat(leader.pid) is not None and read_stat(leader.pid).alive:  # type: ignore[union-attr]
        time.sleep(0.01)

    def scanned() -> None:
        raise AssertionError("all of /proc was read for a sandbox that is gone")

    monkeypatch.setattr(procgroup, "iter_stats", scanned)
    assert sandbox_guest(leader.pid) == []  # a zombie leader
    leader.wait()
    assert sandbox_guest(leader.pid) == []  # reaped
