"""The test run's own isolation: a pytest-xdist worker's cgroups are its own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.worker_cgroups import own_cgroups


def _memory_cgroup() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path
    raise AssertionError("no memory cgroup")


@pytest.mark.skipif(os.geteuid() != 0, reason="moving between cgroups needs root")
def test_a_worker_runs_in_cgroups_of_its_own_and_leaves_them_at_the_end() -> None:
    before = _memory_cgroup()
    name = f"lgtests-self-{os.getpid()}"
    with own_cgroups(name) as dirs:
        assert dirs, "no cgroup hierarchy was joined"
        assert _memory_cgroup() == f"{before.rstrip('/')}/{name}"
        assert all(str(os.getpid()) in (d / "cgroup.procs").read_text().split() for d in dirs)
    assert _memory_cgroup() == before
    assert not any(d.exists() for d in dirs)
