"""A restart kills and removes the cgroups its dead predecessor's invocations left,
and only those: another daemon's invocation cgroups on the host are not touched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from machine.cgroups import CgroupLimits, Cgroups
from machine.journal import Journal
from tests.cgroup_fixtures import SETSID_GRANDCHILD, alive, close, gone_within, read_line, start
from tests.unit.machine.test_journal import reservation
from tests.unit.machine.test_model import open_machine

LIMITS = CgroupLimits(memory_bytes=256 << 20, cpu_millis=1000, pids_max=64)


async def test_open_kills_and_removes_the_cgroups_of_journaled_invocations(tmp_path: Path) -> None:
    cgroups = Cgroups.detect()
    if os.geteuid() != 0 or not isinstance(cgroups, Cgroups):
        pytest.skip(f"needs root and usable cgroups: {cgroups}")
    ours, others = f"t{os.getpid()}-crashed", f"t{os.getpid()}-another-daemon"
    journal, _ = Journal.open(tmp_path)
    journal.record_reserve(reservation(ours))
    journal.close()
    # The dead daemon's invocation left a process outside its process group, one
    # reconcile cannot find by pid; another daemon runs an invocation beside it.
    crashed, running = cgroups.create(ours, LIMITS), cgroups.create(others, LIMITS)
    leader = await start(crashed, SETSID_GRANDCHILD)
    bystander = await start(running, "print('up', flush=True); import time; time.sleep(60)")
    try:
        escaped = int(await read_line(leader))
        assert await read_line(bystander) == "up\n"
        machine = await open_machine(tmp_path, cgroups=cgroups)
        assert machine.removed_cgroups == [ours]
        assert await gone_within(escaped)
        assert ours not in cgroups.leftovers()
        assert others in cgroups.leftovers() and alive(bystander.pid)
        assert machine.recovery is not None and machine.recovery.released == (ours,)
        await machine.aclose()
    finally:
        await close(leader)
        await close(bystander)
        assert await crashed.remove() and await running.remove()
