"""cgroup v2: limits, delegation, usage and cleanup against a directory that imitates
cgroupfs, plus killing and freezing on the real unified mount where the kernel has one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from machine.cgroups import (
    CgroupError,
    CgroupKillFailed,
    CgroupLimits,
    Cgroups,
    CgroupsUnavailable,
    CgroupUsage,
    InvocationCgroup,
)
from machine.cgroups.common import CgroupFs, cpu_quota, write_control
from machine.cgroups.host import parse_self_cgroup
from tests.cgroup_fixtures import SETSID_GRANDCHILD, alive, close, gone_within, read_line, start
from tests.fakes.fake_cgroupfs import FakeCgroupV2

LIMITS = CgroupLimits(memory_bytes=64 << 20, cpu_millis=250, pids_max=32)


def detect(fake: FakeCgroupV2) -> Cgroups:
    found = Cgroups.detect(fake.root, fake.self_cgroup, fs=fake.fs)
    assert isinstance(found, Cgroups), found
    return found


def test_an_invocation_gets_every_limit(tmp_path: Path) -> None:
    fake = FakeCgroupV2(tmp_path)
    cgroups = detect(fake)
    assert cgroups.version == "v2" and not cgroups.restricts_devices
    inv = cgroups.create("inv-1", LIMITS)
    path = fake.own / "litegraph-inv-1"
    assert inv.dirs == {"unified": path}
    written = {name: (path / name).read_text() for name in CONTROL_NAMES}
    assert written == {
        "memory.max": str(64 << 20),
        "memory.swap.max": "0",
        "memory.oom.group": "1",
        "cpu.max": "25000 100000",
        "pids.max": "32",
    }


CONTROL_NAMES = ("memory.max", "memory.swap.max", "memory.oom.group", "cpu.max", "pids.max")


def test_cpu_quota_keeps_small_shares_above_the_kernel_minimum() -> None:
    assert cpu_quota(200) == (20_000, 100_000)
    assert cpu_quota(2000) == (200_000, 100_000)
    # 5 thousandths of a CPU: 500 us per 100 ms is under the 1 ms minimum.
    assert cpu_quota(5) == (5_000, 1_000_000)


def test_a_small_grants_period_quota_holds_a_start_up() -> None:
    # 2 ms per 100 ms throttled a sandboxed `true` for 300 ms; 20 ms per second does
    # not, and the share is the same.
    assert cpu_quota(20) == (20_000, 1_000_000)
    assert cpu_quota(100) == (20_000, 200_000)
    assert cpu_quota(10) == (10_000, 1_000_000)  # the period stops at the kernel's 1 s
    for millis in (1, 7, 20, 99, 150, 200, 999, 64_000):
        quota, period = cpu_quota(millis)
        assert quota == millis * period // 1000  # the grant's share, to the microsecond
        assert 100_000 <= period <= 1_000_000 and quota >= 1_000


def test_limits_must_be_positive() -> None:
    for bad in ({"memory_bytes": 0}, {"cpu_millis": -1}, {"pids_max": True}):
        fields = {"memory_bytes": 1, "cpu_millis": 1, "pids_max": 1, **bad}
        with pytest.raises(ValueError):
            CgroupLimits(**fields)  # type: ignore[arg-type]


def test_the_daemon_moves_to_a_leaf_when_its_cgroup_holds_processes(tmp_path: Path) -> None:
    fake = FakeCgroupV2(tmp_path, subtree="", procs="101\n102\n")
    cgroups = detect(fake)
    assert (fake.own / "daemon" / "cgroup.procs").read_text().split() == ["101", "102"]
    assert (fake.own / "cgroup.procs").read_text() == ""
    assert (fake.own / "cgroup.subtree_control").read_text().split() == ["cpu", "memory", "pids"]
    # Invocations are siblings of the daemon's leaf, not inside it.
    assert cgroups.create("a", LIMITS).dirs == {"unified": fake.own / "litegraph-a"}


def test_a_daemon_already_in_its_leaf_uses_the_parent(tmp_path: Path) -> None:
    fake = FakeCgroupV2(tmp_path)
    fake.mkdir(fake.own / "daemon")
    fake.self_cgroup.write_text("0::/daemon.service/daemon\n")
    assert detect(fake).create("a", LIMITS).dirs == {"unified": fake.own / "litegraph-a"}


def test_controllers_not_delegated_make_cgroups_unavailable(tmp_path: Path) -> None:
    fake = FakeCgroupV2(tmp_path, controllers="cpu io", subtree="")
    found = Cgroups.detect(fake.root, fake.self_cgroup, fs=fake.fs)
    assert found == CgroupsUnavailable(f"cgroup v2: memory pids not delegated to {fake.own}")
    assert sorted(p.name for p in fake.own.iterdir() if p.is_dir()) == []


def test_a_plain_tmpfs_or_a_path_outside_the_root_is_not_a_cgroup(tmp_path: Path) -> None:
    tmpfs = tmp_path / "tmpfs"
    tmpfs.mkdir()
    self_cgroup = tmp_path / "self"
    for text in ("4:memory:/x\n0::/\n", "4:memory:/x\n", "0::/\n", ""):
        self_cgroup.write_text(text)
        assert isinstance(Cgroups.detect(tmpfs, self_cgroup), CgroupsUnavailable)
    assert list(tmpfs.iterdir()) == []
    fake = FakeCgroupV2(tmp_path)
    fake.self_cgroup.write_text("0::/../../elsewhere\n")
    assert isinstance(Cgroups.detect(fake.root, fake.self_cgroup, fs=fake.fs), CgroupsUnavailable)
    missing = Cgroups.detect(fake.root, tmp_path / "no-such-file", fs=fake.fs)
    assert isinstance(missing, CgroupsUnavailable)


def test_hybrid_and_combined_v1_lines_are_parsed() -> None:
    text = "9:name=systemd:/\n4:memory:/m\n2:cpu,cpuacct:/c\n0::/u\n"
    v1, unified = parse_self_cgroup(text)
    assert v1 == {
        "memory": ("memory", "/m"),
        "cpu": ("cpu,cpuacct", "/c"),
        "cpuacct": ("cpu,cpuacct", "/c"),
    }
    assert unified == "/u"


def test_a_failed_limit_leaves_nothing_behind(tmp_path: Path) -> None:
    fake = FakeCgroupV2(tmp_path)
    cgroups = detect(fake)
    fake.refused.add("pids.max")
    with pytest.raises(CgroupError) as caught:
        cgroups.create("a", LIMITS)
    assert caught.value.reason == "setup_failed"
    assert not (fake.own / "litegraph-a").exists()


def test_an_existing_cgroup_is_refused_and_left_alone(tmp_path: Path) -> None:
    fake = FakeCgroupV2(tmp_path)
    cgroups = detect(fake)
    fake.mkdir(fake.own / "litegraph-a")
    with pytest.raises(CgroupError) as caught:
        cgroups.create("a", LIMITS)
    assert caught.value.reason == "exists"
    assert (fake.own / "litegraph-a" / "memory.max").read_text() == "max\n"
    with pytest.raises(CgroupError) as caught:
        cgroups.create("../x", LIMITS)
    assert caught.value.reason == "invalid_name"


def test_usage_reads_cpu_peak_oom_and_pids(tmp_path: Path) -> None:
    fake = FakeCgroupV2(tmp_path)
    inv = detect(fake).create("a", LIMITS)
    path = inv.dirs["unified"]
    assert inv.usage() == CgroupUsage(0.0, 0, oom_killed=False, pids_limit_hit=False)
    (path / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\n")
    (path / "memory.peak").write_text("4096\n")
    (path / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\n")
    (path / "pids.events").write_text("max 3\n")
    assert inv.usage() == CgroupUsage(1.5, 4096, oom_killed=True, pids_limit_hit=True)
    (path / "memory.peak").unlink()  # kernels before 5.19
    assert inv.usage().peak_memory_bytes is None
    (path / "cpu.stat").unlink()
    with pytest.raises(CgroupError):
        inv.usage()


async def test_remove_kills_first_and_leftovers_are_scoped(tmp_path: Path) -> None:
    fake = FakeCgroupV2(tmp_path)
    cgroups = detect(fake)
    for name in ("a", "b"):
        cgroups.create(name, LIMITS)
    (fake.own / "litegraph-x y").mkdir()  # not a name we make
    assert cgroups.leftovers() == ["a", "b"]
    assert await cgroups.remove_leftovers(only={"a", "z"}) == ["a"]
    assert cgroups.leftovers() == ["b"]
    inv = cgroups.existing("b")
    killed: list[str] = []
    real_write = fake.fs.write

    def write(path: Path, text: str) -> None:
        killed.append(path.name)
        real_write(path, text)

    inv.fs = CgroupFs(mkdir=fake.mkdir, rmdir=fake.fs.rmdir, write=write, join=False)
    assert await inv.remove()
    assert killed == ["cgroup.kill"] and cgroups.leftovers() == []


# -- the real unified mount (kill and freeze need no controller) ------------------

UNIFIED = Path("/sys/fs/cgroup/unified")


def _real_unified(name: str) -> Path:
    if os.geteuid() != 0:
        pytest.skip("needs root to make cgroups")
    _, relative = parse_self_cgroup(Path("/proc/self/cgroup").read_text())
    base = UNIFIED / (relative or "/").lstrip("/")
    if not (base / "cgroup.procs").is_file():
        pytest.skip("no cgroup2 mounted at /sys/fs/cgroup/unified")
    path = base / f"litegraph-t{os.getpid()}-{name}"
    path.mkdir()
    if not (path / "cgroup.kill").exists():
        path.rmdir()
        pytest.skip("kernel without cgroup.kill (Linux < 5.14)")
    return path


@pytest.mark.parametrize("with_cgroup_kill", [True, False], ids=["cgroup.kill", "cgroup.freeze"])
async def test_kill_on_the_real_unified_tree_reaches_a_setsid_grandchild(
    with_cgroup_kill: bool,
) -> None:
    path = _real_unified(f"kill{int(with_cgroup_kill)}")

    def write(target: Path, text: str) -> None:
        if target.name == "cgroup.kill" and not with_cgroup_kill:
            raise PermissionError("cgroup.kill refused for the test")
        write_control(target, text)

    inv = InvocationCgroup("t", "v2", {"unified": path}, CgroupFs(write=write))
    try:
        leader = await start(inv, SETSID_GRANDCHILD)
        try:
            grandchild = int(await read_line(leader))
            assert alive(grandchild) and grandchild in inv.pids()
            await inv.kill()
            assert not inv.pids()
            assert await gone_within(grandchild)
        finally:
            await close(leader)
        assert (path / "cgroup.freeze").read_text().strip() == "0"  # thawed again
    finally:
        assert await inv.remove()
    assert not path.exists()


# Above the kernel's PID_MAX_LIMIT: can never name a real process.
NO_SUCH_PID = 4_194_305


async def test_a_cgroup_that_never_empties_raises_and_stays(
    tmp_path: Path, autojump_clock: object
) -> None:
    fake = FakeCgroupV2(tmp_path)
    cgroups = detect(fake)
    inv = cgroups.create("stuck", LIMITS)
    (inv.dirs["unified"] / "cgroup.procs").write_text(f"{NO_SUCH_PID}\n")
    with pytest.raises(CgroupKillFailed) as caught:
        await inv.kill(within=3)
    assert caught.value.pids == {NO_SUCH_PID}
    assert (inv.dirs["unified"] / "cgroup.freeze").read_text() == "0"  # thawed again
    assert not await inv.remove(within=3)
    assert cgroups.leftovers() == ["stuck"]
    assert await cgroups.remove_leftovers() == []


async def test_kill_after_oom_returns_when_the_cgroup_is_gone(
    tmp_path: Path, autojump_clock: object
) -> None:
    fake = FakeCgroupV2(tmp_path)
    inv = detect(fake).create("a", LIMITS)
    with trio.move_on_after(1) as idle:
        await inv.kill_after_oom()
    assert idle.cancelled_caught  # no OOM: it keeps watching
    assert await inv.remove()
    with trio.fail_after(1):
        await inv.kill_after_oom()


async def test_a_freezer_that_refuses_is_a_typed_error_and_remove_says_false(
    tmp_path: Path, autojump_clock: object
) -> None:
    fake = FakeCgroupV2(tmp_path)
    inv = detect(fake).create("a", LIMITS)
    (inv.dirs["unified"] / "cgroup.procs").write_text(f"{NO_SUCH_PID}\n")
    fake.refused.add("cgroup.freeze")
    with pytest.raises(CgroupError) as caught:
        await inv.kill()
    assert caught.value.reason == "kill_failed"
    assert not await inv.remove()
