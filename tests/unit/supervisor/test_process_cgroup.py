"""How a guest's cgroup ends (`supervisor.process_cgroup.end_cgroup`): removed with its
usage read, and the cgroup's word on whether something in it survived SIGKILL."""

from __future__ import annotations

from pathlib import Path

import trio.testing

from machine.cgroups import CgroupLimits, Cgroups, CgroupUsage
from supervisor.process_cgroup import end_cgroup
from tests.fakes.fake_cgroupfs import FakeCgroupV2

LIMITS = CgroupLimits(memory_bytes=64 << 20, cpu_millis=250, pids_max=32)
# Above the kernel's PID_MAX_LIMIT: no kill can reach it, as none reaches a stuck process.
NO_SUCH_PID = 4_194_305


def _cgroups(tmp_path: Path) -> Cgroups:
    fake = FakeCgroupV2(tmp_path)
    found = Cgroups.detect(fake.root, fake.self_cgroup, fs=fake.fs)
    assert isinstance(found, Cgroups), found
    return found


async def test_an_emptied_cgroup_is_removed_and_not_stuck(tmp_path: Path) -> None:
    cgroups = _cgroups(tmp_path)
    usage: list[CgroupUsage] = []
    assert not await end_cgroup(cgroups.create("done", LIMITS), "done", usage.append)
    assert len(usage) == 1 and cgroups.leftovers() == []


async def test_a_process_that_survives_the_cgroups_kill_is_stuck(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    cgroups = _cgroups(tmp_path)
    held = cgroups.create("held", LIMITS)
    (held.dirs["unified"] / "cgroup.procs").write_text(f"{NO_SUCH_PID}\n")
    assert await end_cgroup(held, "held", None)
    assert cgroups.leftovers() == ["held"]
