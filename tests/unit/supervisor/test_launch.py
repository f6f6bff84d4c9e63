"""How a guest's child starts (supervisor/launch.py, supervisor/spawn.py): what runs as
the daemon's user before the uid drop, where the guest's environment goes, and that a
child whose placement failed never runs its argv. Against the real kernel, as root:
tests/confinement/test_guest_launch.py."""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from machine.cgroups import CgroupError, CgroupLimits, Cgroups, InvocationCgroup
from supervisor import launch
from supervisor.launch import GATE_SHELL, plan
from supervisor.output import OutputRing
from supervisor.process import ProcessSpec, run_process
from supervisor.sandbox import SandboxSpec, SandboxUnavailable
from supervisor.spawn import spawn
from tests.fakes.fake_cgroupfs import FakeCgroupV2

SECRET = "s3cret-value-4711"
SANDBOX = SandboxSpec(bwrap=Path("/usr/bin/bwrap"), isolate_network=True)


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _fake_cgroups(tmp_path: Path) -> Cgroups:
    fake = FakeCgroupV2(tmp_path)
    cgroups = Cgroups.detect(fake.root, fake.self_cgroup, fs=fake.fs)
    assert isinstance(cgroups, Cgroups)
    return cgroups


async def _run(
    spec: ProcessSpec,
    cgroups: Cgroups,
    on_started: Callable[[int, int | None], Awaitable[None]] | None = None,
) -> int:
    return await run_process(
        spec,
        stdout=OutputRing(1024),
        stderr=OutputRing(1024),
        on_started=on_started or _nothing,
        cgroups=cgroups,
        parent_env={"PATH": "/usr/bin:/bin"},
    )


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


@pytest.fixture
def tools(monkeypatch: pytest.MonkeyPatch) -> None:
    """setpriv present and a bwrap that knows --clearenv, whatever this host has."""
    monkeypatch.setattr(launch, "find_setpriv", lambda: "/usr/bin/setpriv")
    monkeypatch.setattr(launch, "bwrap_takes_env", lambda _bwrap: True)


@pytest.mark.usefixtures("tools")
def test_a_sandboxed_guests_environment_reaches_bwrap_through_a_memfd_only() -> None:
    env = {"PATH": "/usr/bin", "GUEST_SECRET": SECRET, "WITH SPACE": "a b"}
    found = plan(["true"], env=env, sandbox=SANDBOX, uid=200_001, cgroup=None)
    try:
        # The gate and setpriv run as the daemon's user: no variable of the guest's.
        assert found.env == {}
        assert found.preexec_fn is None
        assert SECRET not in " ".join(found.argv)
        assert found.argv[: len(GATE_SHELL)] == list(GATE_SHELL)
        rest = found.argv[len(GATE_SHELL) :]
        assert rest[0] == "/usr/bin/setpriv" and "--reuid=200001" in rest
        assert "--ambient-caps=-all" in rest and "--inh-caps=-all" in rest
        bwrap = rest.index("/usr/bin/bwrap")
        (fd,) = found.pass_fds
        assert rest[bwrap + 1 : bwrap + 3] == ["--args", str(fd)]
        words = _read_all(fd).split(b"\0")
        assert words[0] == b"--clearenv" and words[-1] == b""
        expected = [(b"--setenv", name.encode(), value.encode()) for name, value in env.items()]
        assert words[1:-1] == [part for triple in expected for part in triple]
    finally:
        found.close()
    assert found.pass_fds == ()


@pytest.mark.usefixtures("tools")
def test_an_unsandboxed_guest_with_a_uid_takes_it_in_its_own_hook() -> None:
    # Without bwrap the argv would get the guest's environment from the root gate.
    found = plan(["true"], env={"GUEST_SECRET": SECRET}, sandbox=None, uid=200_001, cgroup=None)
    assert found.preexec_fn is not None and found.place is None
    assert found.env == {"GUEST_SECRET": SECRET}
    assert "/usr/bin/setpriv" not in found.argv


def test_without_setpriv_a_guest_with_a_uid_takes_it_in_its_own_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(launch, "find_setpriv", lambda: None)
    monkeypatch.setattr(launch, "bwrap_takes_env", lambda _bwrap: True)
    found = plan(["true"], env={"A": "1"}, sandbox=SANDBOX, uid=200_001, cgroup=None)
    assert found.preexec_fn is not None and found.pass_fds == ()
    # bwrap is its own gate then, as it always was.
    assert found.argv[0] == "/usr/bin/bwrap" and "--block-fd" in found.argv


@pytest.mark.parametrize("setpriv", ["/usr/bin/setpriv", None])
def test_the_cwds_descriptor_reaches_bwrap_as_a_copy_the_launch_closes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, setpriv: str | None
) -> None:
    monkeypatch.setattr(launch, "find_setpriv", lambda: setpriv)
    monkeypatch.setattr(launch, "bwrap_takes_env", lambda _bwrap: True)
    opened = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sandbox = SandboxSpec(
            bwrap=Path("/usr/bin/bwrap"), isolate_network=True, cwd=str(tmp_path), cwd_fd=opened
        )
        found = plan(["true"], env={}, sandbox=sandbox, uid=200_001, cgroup=None)
        copy = found.pass_fds[-1]
        assert copy != opened and os.path.samestat(os.fstat(copy), os.fstat(opened))
        at = found.argv.index("--ro-bind-fd")  # bwrap closes it once bound
        assert found.argv[at : at + 3] == ["--ro-bind-fd", str(copy), str(tmp_path)]
        assert str(opened) not in found.argv[at : at + 3]
        found.close()
        os.fstat(opened)  # the caller's descriptor is still its own
    finally:
        os.close(opened)


@pytest.mark.usefixtures("tools")
def test_a_subordinate_uid_is_taken_by_nsenter_in_the_guests_user_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A daemon that is not root: after the gate, nsenter enters the namespace its
    subordinate uids are mapped in (through the daemon's own /proc entry for its
    descriptor: the child inherits none, so no guest holds it), takes the guest's uid
    and gid there with no supplementary group, then execs bwrap; setpriv plays no part
    and the gate gets none of the guest's environment."""
    monkeypatch.setattr(launch, "find_nsenter", lambda: "/usr/bin/nsenter")
    userns = os.open("/proc/self/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    try:
        sandbox = SandboxSpec(bwrap=Path("/usr/bin/bwrap"), isolate_network=True, userns_fd=userns)
        found = plan(
            ["true"], env={"GUEST_SECRET": SECRET}, sandbox=sandbox, uid=410_001, cgroup=None
        )
        (env_fd,) = found.pass_fds
        assert found.env == {} and found.preexec_fn is None
        assert SECRET not in " ".join(found.argv)
        rest = found.argv[len(GATE_SHELL) :]
        assert found.argv[: len(GATE_SHELL)] == list(GATE_SHELL)
        assert rest[:5] == [
            "/usr/bin/nsenter",
            f"--user=/proc/{os.getpid()}/fd/{userns}",
            "--setuid=410001",
            "--setgid=410001",
            "--",
        ]
        assert rest[5:8] == ["/usr/bin/bwrap", "--args", str(env_fd)]
        assert "/usr/bin/setpriv" not in found.argv
        found.close()
        os.fstat(userns)  # the daemon's descriptor is still its own
    finally:
        os.close(userns)


@pytest.mark.parametrize("missing", ["nsenter", "clearenv", "uid"])
def test_a_subordinate_uid_without_nsenter_or_clearenv_is_refused_not_dropped(
    monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    """No other way into the namespace: never a guest as the daemon's own uid instead."""
    monkeypatch.setattr(launch, "find_nsenter", lambda: None if missing == "nsenter" else "/x")
    monkeypatch.setattr(launch, "bwrap_takes_env", lambda _bwrap: missing != "clearenv")
    userns = os.open("/proc/self/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    before = set(os.listdir("/proc/self/fd"))
    try:
        sandbox = SandboxSpec(bwrap=Path("/usr/bin/bwrap"), userns_fd=userns)
        uid = None if missing == "uid" else 410_001
        with pytest.raises(SandboxUnavailable):
            plan(["true"], env={}, sandbox=sandbox, uid=uid, cgroup=None)
        assert set(os.listdir("/proc/self/fd")) <= before  # its copies are closed
    finally:
        os.close(userns)


def test_a_guest_without_a_uid_of_its_own_is_placed_from_outside(tmp_path: Path) -> None:
    cgroups = _fake_cgroups(tmp_path)
    inv = cgroups.create("inv", CgroupLimits(memory_bytes=1 << 24, cpu_millis=100, pids_max=8))
    found = plan(["true"], env={"A": "1"}, sandbox=None, uid=None, cgroup=inv, rlimit_as=1 << 30)
    assert found.preexec_fn is None and found.place is not None
    assert found.argv == [*GATE_SHELL, "true"] and found.env == {"A": "1"}


async def test_a_child_whose_placement_fails_is_killed_before_its_argv_runs(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "ran"
    gate_read, gate_write = os.pipe()
    placed: list[int] = []

    def place(pid: int) -> None:
        placed.append(pid)
        raise CgroupError("join_failed", "refused")

    try:
        with pytest.raises(CgroupError):
            await spawn(
                [*GATE_SHELL, "touch", str(marker)],
                stdin=gate_read,
                env={"PATH": "/usr/bin:/bin"},
                cwd=None,
                preexec_fn=None,
                place=place,
            )
        # Reaped already: the gate never opened.
        (pid,) = placed
        assert _reaped(pid)
        try:
            os.write(gate_write, b"\n")
        except BrokenPipeError:
            pass
        await trio.sleep(0.2)
        assert not marker.exists()
    finally:
        os.close(gate_read)
        os.close(gate_write)


async def test_a_cgroup_that_refuses_the_child_fails_the_run_and_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cgroups = _fake_cgroups(tmp_path)

    def refuse(self: InvocationCgroup, pid: int) -> None:
        raise CgroupError("join_failed", f"{self.name}: pid {pid} refused")

    monkeypatch.setattr(InvocationCgroup, "admit", refuse)
    marker = tmp_path / "ran"
    started: list[int] = []

    async def on_started(pid: int, _ticks: int | None) -> None:
        started.append(pid)

    spec = ProcessSpec(
        argv=("touch", str(marker)), memory_limit_bytes=1 << 26, cgroup_name="refused"
    )
    with pytest.raises(CgroupError):
        await _run(spec, cgroups, on_started)
    await trio.sleep(0.2)
    assert not marker.exists() and started == []
    assert "refused" not in cgroups.leftovers()


def test_bwrap_takes_env_reads_the_tools_own_help(tmp_path: Path) -> None:
    old = tmp_path / "old-bwrap"
    old.write_text("#!/bin/sh\necho 'usage: bwrap [OPTIONS...] [--] COMMAND [ARGS...]'\n")
    old.chmod(0o755)
    new = tmp_path / "new-bwrap"
    new.write_text("#!/bin/sh\necho '    --clearenv                   Unset all'\n")
    new.chmod(0o755)
    assert not launch.bwrap_takes_env(old)
    assert launch.bwrap_takes_env(new)
    assert not launch.bwrap_takes_env(tmp_path / "missing")


async def test_every_guests_cgroup_work_runs_on_one_kept_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cgroups = _fake_cgroups(tmp_path)
    threads: list[threading.Thread] = []
    create, finish = Cgroups.create, InvocationCgroup.finish_if_empty

    def created(self: Cgroups, name: str, limits: CgroupLimits) -> InvocationCgroup:
        threads.append(threading.current_thread())
        return create(self, name, limits)

    def finished(self: InvocationCgroup) -> object:
        threads.append(threading.current_thread())
        return finish(self)

    monkeypatch.setattr(Cgroups, "create", created)
    monkeypatch.setattr(InvocationCgroup, "finish_if_empty", finished)

    async def run(name: str) -> None:
        spec = ProcessSpec(argv=("true",), memory_limit_bytes=1 << 26, cgroup_name=name)
        assert await _run(spec, cgroups) == 0

    async with trio.open_nursery() as nursery:
        for n in range(4):
            nursery.start_soon(run, f"kept-{n}")
    # A trio worker thread per call costs ten times the handoff when guests start at once.
    assert len(threads) == 8 and len(set(threads)) == 1
    (thread,) = set(threads)
    assert thread.name == "litegraph-cgroups" and thread.is_alive()


async def _nothing(_pid: int, _ticks: int | None) -> None:
    pass
