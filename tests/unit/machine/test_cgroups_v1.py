"""cgroup v1 against the real kernel: the limits hold, usage sees them hit, and
killing and removal leave nothing. Skipped where the host has no v1 hierarchies
or we are not root."""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import stat
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from machine.cgroups import CgroupError, CgroupLimits, Cgroups, InvocationCgroup
from machine.cgroups.common import CgroupFs, write_control
from machine.cgroups.v1 import V1Backend
from tests.cgroup_fixtures import SETSID_GRANDCHILD, close, gone_within, read_all, read_line, start

MiB = 1 << 20
_names = itertools.count()


def unique(label: str) -> str:
    # Other test runs on this host share the hierarchies: the pid keeps names apart.
    return f"t{os.getpid()}-{label}{next(_names)}"


def limits(**fields: object) -> CgroupLimits:
    chosen: dict[str, object] = {"memory_bytes": 256 * MiB, "cpu_millis": 2000, "pids_max": 64}
    chosen.update(fields)
    return CgroupLimits(**chosen)  # type: ignore[arg-type]


def detect_v1(fs: CgroupFs | None = None) -> Cgroups:
    if os.geteuid() != 0:
        pytest.skip("needs root to make cgroups")
    found = Cgroups.detect(fs=fs)
    if not isinstance(found, Cgroups) or found.version != "v1":
        pytest.skip(f"no cgroup v1 hierarchies here: {found}")
    return found


@pytest.fixture
async def made() -> AsyncIterator[list[InvocationCgroup]]:
    """Cgroups a test made; whatever is left of them is removed afterwards."""
    cgroups: list[InvocationCgroup] = []
    yield cgroups
    for inv in cgroups:
        assert await inv.remove()


def create(made: list[InvocationCgroup], cgroups: Cgroups, **fields: object) -> InvocationCgroup:
    inv = cgroups.create(unique("c"), limits(**fields))
    made.append(inv)
    return inv


async def test_allocating_past_the_limit_is_oom_killed_and_reported(
    made: list[InvocationCgroup],
) -> None:
    inv = create(made, detect_v1(), memory_bytes=64 * MiB)
    small = await start(inv, f"b = b'x' * {16 * MiB}; print('ok')")
    assert await read_all(small) == "ok\n" and small.returncode == 0
    assert not inv.usage().oom_killed
    big = await start(inv, f"b = b'x' * {256 * MiB}; print('survived')")
    assert await read_all(big) == "" and big.returncode == -9
    usage = inv.usage()
    assert usage.oom_killed
    assert usage.peak_memory_bytes is not None and usage.peak_memory_bytes <= 64 * MiB


async def test_cpu_quota_holds_a_busy_loop_near_its_share(made: list[InvocationCgroup]) -> None:
    inv = create(made, detect_v1(), cpu_millis=200)
    busy = await start(inv, "while True: pass")
    try:
        await trio.sleep(0.3)
        before, since = inv.usage().cpu_seconds, time.monotonic()
        await trio.sleep(2)
        rate = (inv.usage().cpu_seconds - before) / (time.monotonic() - since)
    finally:
        await close(busy)
    # A fifth of a CPU; without the quota one busy loop takes a whole one.
    assert 0.1 <= rate <= 0.35, rate


async def test_a_small_grant_gets_a_long_period_and_still_only_its_share(
    made: list[InvocationCgroup],
) -> None:
    inv = create(made, detect_v1(), cpu_millis=100)
    cpu = inv.dirs["cpu"]
    # 20 ms a period: a guest's start-up runs unthrottled (2 ms per 100 ms did not).
    assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "20000"
    assert (cpu / "cpu.cfs_period_us").read_text().strip() == "200000"
    busy = await start(inv, "while True: pass")
    try:
        await trio.sleep(0.5)
        before, since = inv.usage().cpu_seconds, time.monotonic()
        await trio.sleep(2)
        rate = (inv.usage().cpu_seconds - before) / (time.monotonic() - since)
    finally:
        await close(busy)
    assert 0.04 <= rate <= 0.16, rate  # a tenth of a CPU over the long run


async def test_a_fork_bomb_stops_at_pids_max(made: list[InvocationCgroup]) -> None:
    inv = create(made, detect_v1(), pids_max=16)
    bomb = (
        "import os, signal\n"
        "n = 0\n"
        "while n < 200:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            signal.pause()\n"
        "        n += 1\n"
        "    except OSError as e:\n"
        "        print(n, e.errno, flush=True)\n"
        "        break\n"
    )
    leader = await start(inv, bomb)
    try:
        forked, error = map(int, (await read_line(leader)).split())
        assert error == errno.EAGAIN and forked == 15  # the leader is the 16th
        assert inv.usage().pids_limit_hit
        await inv.kill()
        assert not inv.pids()
    finally:
        await close(leader)


def _refuse(control: str) -> CgroupFs:
    def write(path: Path, text: str) -> None:
        if path.name == control:
            raise PermissionError(f"{control} refused for the test")
        write_control(path, text)

    return CgroupFs(write=write)


@pytest.mark.parametrize("refused", ["", "cgroup.kill"], ids=["cgroup.kill", "freezer"])
async def test_kill_reaches_a_setsid_grandchild_and_remove_leaves_no_directory(
    refused: str,
) -> None:
    cgroups = detect_v1(_refuse(refused) if refused else None)
    inv = cgroups.create(unique("k"), limits())
    leader = await start(inv, SETSID_GRANDCHILD)
    try:
        grandchild = int(await read_line(leader))
        assert os.getsid(grandchild) != os.getsid(leader.pid)
        await inv.kill()
        assert await gone_within(grandchild)
    finally:
        await close(leader)
    assert await inv.remove()
    assert inv.dirs and not any(path.exists() for path in inv.dirs.values())
    assert inv.name not in cgroups.leftovers()


async def test_admit_moves_a_waiting_child_into_every_hierarchy_from_outside(
    made: list[InvocationCgroup],
) -> None:
    inv = create(made, detect_v1())
    # Waits at a gate (its stdin) as a guest's child does, joined to nothing yet.
    child = await trio.lowlevel.open_process(["sh", "-c", "read -r _"], stdin=subprocess.PIPE)
    try:
        inv.admit(child.pid)
        where = await trio.Path(f"/proc/{child.pid}/cgroup").read_text()
        for role, path in inv.dirs.items():
            assert path.name in where, (role, where)
        assert child.pid in inv.pids()
    finally:
        assert child.stdin is not None
        await trio.aclose_forcefully(child.stdin)
        await close(child)
    with pytest.raises(CgroupError) as refused:
        inv.admit(child.pid)  # reaped: no such process
    assert refused.value.reason == "join_failed"


def _node(tmp_path: Path, name: str, minor: int) -> str:
    path = tmp_path / name
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(195, minor))
    return str(path)


PROBE = (
    "import os, sys\n"
    "for path in sys.argv[1:]:\n"
    "    try:\n"
    "        os.close(os.open(path, os.O_RDWR))\n"
    "        print('opened')\n"
    "    except OSError as e:\n"
    "        print(os.strerror(e.errno))\n"
)


async def test_only_granted_device_nodes_open(tmp_path: Path, made: list[InvocationCgroup]) -> None:
    cgroups = detect_v1()
    if not cgroups.restricts_devices:
        pytest.skip("no cgroup v1 devices hierarchy")
    granted, other = _node(tmp_path, "granted", 0), _node(tmp_path, "other", 1)
    inv = create(made, cgroups, devices=(granted,))
    out = await read_all(await start(inv, PROBE, granted, other, "/dev/null"))
    # No driver behind 195:0 (ENXIO) but the cgroup let it through; 195:1 is refused.
    assert out.splitlines() == [os.strerror(errno.ENXIO), os.strerror(errno.EPERM), "opened"]


def test_a_device_that_is_not_a_node_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    cgroups = detect_v1()
    (tmp_path / "plain").write_text("")
    name = unique("d")
    with pytest.raises(CgroupError) as caught:
        cgroups.create(name, limits(devices=(str(tmp_path / "plain"),)))
    assert caught.value.reason == "not_a_device"
    assert name not in cgroups.leftovers()


def test_a_failed_limit_leaves_no_directory() -> None:
    cgroups = detect_v1(_refuse("pids.max"))
    name = unique("f")
    with pytest.raises(CgroupError) as caught:
        cgroups.create(name, limits())
    assert caught.value.reason == "setup_failed"
    assert name not in cgroups.leftovers()
    assert not cgroups.existing(name).dirs


async def test_an_existing_name_is_refused_and_left_alone(made: list[InvocationCgroup]) -> None:
    cgroups = detect_v1()
    first = create(made, cgroups)
    with pytest.raises(CgroupError) as caught:
        cgroups.create(first.name, limits())
    assert caught.value.reason == "exists"
    assert all(path.is_dir() for path in first.dirs.values())


async def test_leftovers_of_a_previous_daemon_are_killed_and_removed() -> None:
    previous = detect_v1()
    inv = previous.create(unique("l"), limits())
    sleeper = await start(inv, "import time; time.sleep(60)")
    try:
        restarted = detect_v1()
        assert inv.name in restarted.leftovers()
        # Scoped to our own names: another daemon's invocations on this host are not ours.
        assert await restarted.remove_leftovers(only={inv.name}) == [inv.name]
        with trio.fail_after(5):
            assert await sleeper.wait() == -9
        assert inv.name not in restarted.leftovers()
    finally:
        await close(sleeper)


# The leader outlives the child the OOM killer picks (v1 kills one process only).
OOM_IN_A_CHILD = (
    "import subprocess, sys, time\n"
    "code = 'b = b\"x\" * (256 << 20)'\n"
    "print(subprocess.run([sys.executable, '-c', code]).returncode, flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.mark.parametrize("watched", [False, True], ids=["unwatched", "kill_after_oom"])
async def test_an_oom_kill_ends_the_whole_invocation_when_watched(
    watched: bool, made: list[InvocationCgroup]
) -> None:
    inv = create(made, detect_v1(), memory_bytes=64 * MiB)
    leader = await start(inv, OOM_IN_A_CHILD)
    try:
        assert await read_line(leader) == "-9\n" and inv.usage().oom_killed
        if watched:
            with trio.fail_after(5):
                await inv.kill_after_oom()
                assert await leader.wait() == -9
        else:
            await trio.sleep(0.3)
            assert leader.returncode is None and leader.pid in inv.pids()
    finally:
        await close(leader)


async def test_a_grant_above_the_daemons_own_cpu_share_is_cut_down_to_it() -> None:
    cgroups = detect_v1()
    backend = cgroups._backend
    assert isinstance(backend, V1Backend)
    # The daemon itself may use half a CPU (a systemd CPUQuota=50%, say).
    parent = backend.parents["cpu"] / f"litegraph-t{os.getpid()}-half"
    parent.mkdir()
    try:
        write_control(parent / "cpu.cfs_quota_us", "50000")
        limited = Cgroups(dataclasses.replace(backend, parents={**backend.parents, "cpu": parent}))
        inv = limited.create(unique("h"), limits(cpu_millis=2000))
        try:
            cpu = inv.dirs["cpu"]
            assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "50000"
            assert (cpu / "cpu.cfs_period_us").read_text().strip() == "100000"
        finally:
            assert await inv.remove()
    finally:
        parent.rmdir()


async def test_finish_if_empty_reads_usage_and_removes_only_an_empty_cgroup(
    made: list[InvocationCgroup],
) -> None:
    inv = create(made, detect_v1())
    leader = await start(inv, "import time; time.sleep(60)")
    try:
        assert inv.finish_if_empty() is None  # something is in it: nothing touched
        assert all(path.is_dir() for path in inv.dirs.values())
    finally:
        await close(leader)
    finished = inv.finish_if_empty()
    assert finished is not None
    usage, removed = finished
    assert usage is not None and usage.cpu_seconds > 0
    assert removed and not any(path.exists() for path in inv.dirs.values())


async def test_a_leaf_cgroup_ends_without_listing_its_control_files(
    made: list[InvocationCgroup], monkeypatch: pytest.MonkeyPatch
) -> None:
    inv = create(made, detect_v1())
    await close(await start(inv, "pass"))

    def walk(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a cgroup without nested ones was listed")

    monkeypatch.setattr(os, "walk", walk)
    finished = inv.finish_if_empty()
    assert finished is not None and finished[1]
    assert not any(path.exists() for path in inv.dirs.values())


async def test_a_process_in_a_nested_cgroup_is_found_killed_and_its_cgroup_removed(
    made: list[InvocationCgroup],
) -> None:
    inv = create(made, detect_v1())
    inner = InvocationCgroup(
        "inner", inv.version, {role: path / "inner" for role, path in inv.dirs.items()}
    )
    for path in dict.fromkeys(inner.dirs.values()):
        path.mkdir()
    hidden = await start(inner, "import time; time.sleep(60)")
    try:
        assert hidden.pid in inv.pids()
        assert inv.finish_if_empty() is None
        assert await inv.remove()
        assert await gone_within(hidden.pid)
        assert not any(path.exists() for path in inv.dirs.values())
    finally:
        await close(hidden)
