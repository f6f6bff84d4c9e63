"""The process executor: environment, validation, memory limits, and that the
whole process group ends on every path (exit, cancel, deadline, error)."""

from __future__ import annotations

import functools
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import psutil  # type: ignore[import-untyped,unused-ignore]
import pytest
import trio

import supervisor.process
from machine.cgroups import Cgroups, system_cgroups
from machine.proc import read_stat
from supervisor.output import OutputRing
from supervisor.process import (
    ConfinementFailed,
    InvalidProcessRequest,
    ProcessSpec,
    ProcessStuck,
    build_environment,
    run_process,
    terminate_group,
    validate_argv,
    validate_env,
    validate_spec,
)
from supervisor.process_env import GUEST_PATH
from tests.cgroup_fixtures import gone_within
from tests.fakes.fake_cgroupfs import FakeCgroupV2
from tests.supervisor_fixtures import session_members

GRACE = 0.5
PY = sys.executable


class Run:
    """One run_process call's rings and what on_started saw."""

    def __init__(self) -> None:
        self.stdout = OutputRing(64 * 1024)
        self.stderr = OutputRing(64 * 1024)
        self.started: list[tuple[int, int | None]] = []
        self.stuck = 0

    @property
    def pid(self) -> int:
        return self.started[0][0]

    async def on_started(self, pid: int, start_ticks: int | None) -> None:
        self.started.append((pid, start_ticks))

    def on_stuck(self) -> None:
        self.stuck += 1

    async def __call__(
        self,
        spec: ProcessSpec,
        *,
        cgroups: Cgroups | None = None,
        parent_env: Mapping[str, str] | None = None,
        on_started: Callable[[int, int | None], Awaitable[None]] | None = None,
    ) -> int:
        return await run_process(
            spec,
            stdout=self.stdout,
            stderr=self.stderr,
            on_started=on_started or self.on_started,
            kill_grace=GRACE,
            cgroups=cgroups,
            parent_env=parent_env,
            on_stuck=self.on_stuck,
        )


def spec(*argv: str, **fields: object) -> ProcessSpec:
    return ProcessSpec(argv=argv, **fields)  # type: ignore[arg-type]


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


async def _wait_for_members(run: Run, count: int) -> None:
    with trio.fail_after(2):
        while not run.started or len(session_members(run.pid)) < count:  # noqa: ASYNC110
            await trio.sleep(0.02)


# -- exit, output, on_started -----------------------------------------------


async def test_exit_code_and_output_are_returned() -> None:
    run = Run()
    code = await run(spec("sh", "-c", "echo out; echo err >&2; exit 3"))
    assert code == 3
    assert run.stdout.text() == "out\n"
    assert run.stderr.text() == "err\n"


async def test_a_signal_exit_is_negative() -> None:
    run = Run()
    assert await run(spec("sh", "-c", "kill -KILL $$")) == -signal.SIGKILL


async def test_stdin_is_dev_null() -> None:
    run = Run()
    assert await run(spec("cat")) == 0
    assert run.stdout.text() == ""


async def test_on_started_gets_the_real_pid_and_start_ticks() -> None:
    run = Run()
    seen: list[int] = []

    async def on_started(pid: int, start_ticks: int | None) -> None:
        await run.on_started(pid, start_ticks)
        stat = read_stat(pid)
        assert stat is not None
        seen.append(stat.start_ticks)

    assert await run(spec("sh", "-c", "echo $$"), on_started=on_started) == 0
    pid, start_ticks = run.started[0]
    assert int(run.stdout.text()) == pid
    assert start_ticks is not None and start_ticks == seen[0]


async def test_an_error_in_on_started_kills_the_child_and_propagates() -> None:
    run = Run()

    async def on_started(pid: int, start_ticks: int | None) -> None:
        await run.on_started(pid, start_ticks)
        raise RuntimeError("journal write failed")

    with pytest.raises(RuntimeError, match="journal write failed"):
        await run(spec("sleep", "60"), on_started=on_started)
    assert session_members(run.pid) == []


async def test_output_beyond_the_ring_is_counted_not_kept() -> None:
    run = Run()
    run.stdout = OutputRing(10)
    assert await run(spec(PY, "-c", "print('x' * 100000, end='')")) == 0
    assert run.stdout.text() == "x" * 10
    assert run.stdout.dropped_bytes == 100000 - 10


# -- environment --------------------------------------------------------------


async def _child_env(
    run: Run, process_spec: ProcessSpec, parent: Mapping[str, str]
) -> dict[str, str]:
    assert await run(process_spec, parent_env=parent) == 0
    env: dict[str, str] = json.loads(run.stdout.text())
    return env


PRINT_ENV = (PY, "-c", "import json, os; print(json.dumps(dict(os.environ)))")


async def test_environment_is_allow_listed_and_supervisor_variables_win() -> None:
    parent = {"PATH": "/root/.local/bin:/usr/bin", "HOME": "/d", "SECRET_X": "x", "LD_PRELOAD": "x"}
    process_spec = ProcessSpec(
        argv=PRINT_ENV,
        env={"MY_SETTING": "1", "HOME": "/home/invocation"},
        extra_env={"LITEGRAPH_NODE_URL": "http://127.0.0.1:1", "LITEGRAPH_LANE_IDS": "gpu-0"},
    )
    env = await _child_env(Run(), process_spec, parent)
    assert "SECRET_X" not in env
    assert "LD_PRELOAD" not in env
    assert env["PATH"] == GUEST_PATH  # the fixed one, never the daemon's
    assert env["MY_SETTING"] == "1"
    assert env["HOME"] == "/home/invocation"
    assert env["LITEGRAPH_NODE_URL"] == "http://127.0.0.1:1"
    assert env["LITEGRAPH_LANE_IDS"] == "gpu-0"
    # No devices granted: empty, which hides every GPU (unset would show all).
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["NVIDIA_VISIBLE_DEVICES"] == ""


async def test_granted_devices_are_exactly_visible() -> None:
    process_spec = ProcessSpec(argv=PRINT_ENV, visible_devices=("GPU-a", "MIG-b"), cpu_only=False)
    env = await _child_env(Run(), process_spec, {})
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a,MIG-b"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,MIG-b"


def test_build_environment_never_lets_the_invocation_override_supervisor_variables() -> None:
    # Even if validation were bypassed, the supervisor's values come last.
    process_spec = ProcessSpec(
        argv=("x",),
        env={"LITEGRAPH_CAPABILITY_TOKEN": "forged", "CUDA_VISIBLE_DEVICES": "0,1,2,3"},
        extra_env={"LITEGRAPH_CAPABILITY_TOKEN": "v4.public.real"},
        visible_devices=("GPU-a",),
    )
    env = build_environment(process_spec, {"TERM": "xterm", "AWS_SECRET_ACCESS_KEY": "k"})
    assert env == {
        "TERM": "xterm",
        "PATH": GUEST_PATH,
        "PYTHONUNBUFFERED": "1",
        "LITEGRAPH_CAPABILITY_TOKEN": "v4.public.real",
        "CUDA_VISIBLE_DEVICES": "GPU-a",
        "NVIDIA_VISIBLE_DEVICES": "GPU-a",
    }


def test_a_guests_path_is_the_fixed_one_whatever_the_daemons_path_holds() -> None:
    daemon = {"PATH": "/root/.cargo/bin:/root/.local/bin:/opt/venv/bin:/usr/bin:/bin"}
    assert build_environment(ProcessSpec(argv=("x",)), daemon)["PATH"] == GUEST_PATH
    assert build_environment(ProcessSpec(argv=("x",)), {})["PATH"] == GUEST_PATH
    # The invocation may name its own (it changes only what its own argv finds).
    own = ProcessSpec(argv=("x",), env={"PATH": "/opt/tool/bin:/usr/bin"})
    validate_env(own.env)
    assert build_environment(own, daemon)["PATH"] == "/opt/tool/bin:/usr/bin"
    assert GUEST_PATH == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def test_guests_run_python_unbuffered_unless_the_request_says_otherwise() -> None:
    assert build_environment(ProcessSpec(argv=("x",)), {})["PYTHONUNBUFFERED"] == "1"
    own = ProcessSpec(argv=("x",), env={"PYTHONUNBUFFERED": ""})
    validate_env(own.env)  # the one PYTHON* name a request may set
    assert build_environment(own, {})["PYTHONUNBUFFERED"] == ""
    with pytest.raises(InvalidProcessRequest):
        validate_env({"PYTHONSTARTUP": "/tmp/x.py"})


async def test_run_process_refuses_a_reserved_variable_before_spawning() -> None:
    run = Run()
    with pytest.raises(InvalidProcessRequest) as info:
        await run(spec("true", env={"LITEGRAPH_NODE_URL": "http://evil"}))
    assert info.value.field == "env.LITEGRAPH_NODE_URL"
    assert run.started == []


# -- validation -----------------------------------------------------------------


@pytest.mark.parametrize(
    "env",
    [
        {"1A": "x"},
        {"A-B": "x"},
        {"": "x"},
        {"LITEGRAPH_CAPABILITY_TOKEN": "x"},
        {"LITEGRAPH_ANYTHING": "x"},
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"NVIDIA_VISIBLE_DEVICES": "all"},
        {"LD_PRELOAD": "/tmp/x.so"},
        {"LD_LIBRARY_PATH": "/tmp"},
        # What changes what runs: the loader, interpreters' start-up, device selection;
        # case variants too (some runtimes read these names case-insensitively).
        {"LD_AUDIT": "/tmp/a.so"},
        {"ld_preload": "/tmp/x.so"},
        {"GCONV_PATH": "/tmp"},
        {"PYTHONPATH": "/tmp"},
        {"PythonStartup": "/tmp/s.py"},
        {"HIP_VISIBLE_DEVICES": "0"},
        {"cuda_visible_devices": "0"},
        {"ROCR_VISIBLE_DEVICES": "0"},
        {"GLIBC_TUNABLES": "x"},
        {"BASH_ENV": "/tmp/x"},
        {"NODE_OPTIONS": "--require /tmp/x.js"},
        {"PERL5OPT": "-d"},
        {f"V{i}": "x" for i in range(65)},
        {"A" * 4097: "x"},
        {"A": "x" * 4097},
        {"A": "é" * 2049},  # 4098 bytes in UTF-8
        {"A": "a\x00b"},
        {"A\x00": "x"},
        {"A": "\ud800"},
    ],
)
def test_validate_env_refuses(env: dict[str, str]) -> None:
    with pytest.raises(InvalidProcessRequest) as info:
        validate_env(env)
    assert info.value.field.startswith("env")
    assert info.value.message


def test_validate_env_accepts_the_limits() -> None:
    validate_env({f"V{i}": "x" for i in range(64)})
    validate_env({"A" * 4096: "x" * 4096, "_lower_ok": "", "MY_CUDA_HOME": "/opt/cuda"})


@pytest.mark.parametrize(
    "argv",
    [(), ("x",) * 257, ("echo", "x" * 4097), ("echo", "a\x00b"), ("", "x"), "echo hi"],
)
def test_validate_argv_refuses(argv: tuple[str, ...]) -> None:
    with pytest.raises(InvalidProcessRequest, match="argv"):
        validate_argv(argv)


def test_validate_argv_accepts_the_limits() -> None:
    validate_argv(("x",) * 256)
    validate_argv(("echo", "x" * 4096, ""))


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"visible_devices": ("GPU-a,GPU-b",)}, "visible_devices"),
        ({"visible_devices": ("",)}, "visible_devices"),
        ({"cgroup_name": "../escape"}, "cgroup_name"),
        ({"cgroup_name": ""}, "cgroup_name"),
        ({"memory_limit_bytes": 0}, "memory_limit_bytes"),
        ({"cpu_affinity": ()}, "cpu_affinity"),
        ({"cpu_affinity": (10_000,)}, "cpu_affinity"),
        ({"extra_env": {"BAD NAME": "x"}}, "extra_env.BAD NAME"),
        ({"cwd": "/tmp\x00"}, "cwd"),
        ({"visible_devices": ("GPU-a",), "cpu_only": True}, "cpu_only"),
    ],
)
def test_validate_spec_refuses(fields: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidProcessRequest) as info:
        validate_spec(spec("true", **fields))
    assert info.value.field == field


# -- ending the whole group ---------------------------------------------------


async def test_cancellation_kills_the_child_and_its_grandchild() -> None:
    run = Run()
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, spec("sh", "-c", "sleep 60 & sleep 60"))
            await _wait_for_members(run, 3)  # sh and two sleeps
            scope.cancel()
    assert scope.cancelled_caught
    assert session_members(run.pid) == []


async def test_a_child_ignoring_sigterm_is_killed_after_the_grace() -> None:
    run = Run()
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            # The sleeps inherit the ignored SIGTERM.
            nursery.start_soon(run, spec("sh", "-c", "trap '' TERM; sleep 60 & sleep 60"))
            await _wait_for_members(run, 3)
            cancelled_at = trio.current_time()
            scope.cancel()
    assert trio.current_time() - cancelled_at >= GRACE  # SIGTERM alone did not do it
    assert session_members(run.pid) == []


async def test_what_a_cancelled_child_prints_in_its_grace_is_kept() -> None:
    # Its output is read while the group ends: a TERM handler's last words are kept.
    run = Run()
    script = "trap 'echo cleaned; exit 0' TERM; echo ready; while :; do sleep 0.05; done"
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, spec("sh", "-c", script))
            with trio.fail_after(5):
                while run.stdout.text() != "ready\n":  # noqa: ASYNC110
                    await trio.sleep(0.02)
            scope.cancel()
    assert scope.cancelled_caught
    assert run.stdout.text() == "ready\ncleaned\n"
    assert session_members(run.pid) == []


async def test_a_deadline_ends_the_group_the_same_way() -> None:
    run = Run()
    with pytest.raises(trio.TooSlowError):
        with trio.fail_after(0.3):
            await run(spec("sh", "-c", "sleep 60 & sleep 60"))
    assert len(run.started) == 1
    assert session_members(run.pid) == []


async def test_a_grandchild_left_behind_after_a_normal_exit_is_killed() -> None:
    run = Run()
    # The grandchild redirects its output, so nothing but the group check ends it.
    code = await run(spec("sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!; exit 4"))
    assert code == 4
    grandchild = int(run.stdout.text())
    assert grandchild != run.pid
    assert not _alive(grandchild)
    assert session_members(run.pid) == []


async def test_a_process_that_left_the_group_cannot_hold_the_run_open(tmp_path: Path) -> None:
    # It keeps stdout open in a session of its own (only a cgroup could reach it):
    # the run still ends, after a bounded drain of the pipes.
    announce = tmp_path / "escaped.pid"
    script = (
        f"setsid sh -c 'echo $$ > {announce}; exec sleep 60' & "
        f"while [ ! -s {announce} ]; do sleep 0.01; done"
    )
    run = Run()
    started = trio.current_time()
    try:
        assert await run(spec("sh", "-c", script)) == 0
        assert trio.current_time() - started < 2.5
        assert _alive(int(announce.read_text()))
    finally:
        if announce.exists():
            os.kill(int(announce.read_text()), signal.SIGKILL)


async def test_keyboard_interrupt_ends_the_group_and_propagates() -> None:
    run = Run()

    async def on_started(pid: int, start_ticks: int | None) -> None:
        await run.on_started(pid, start_ticks)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        await run(spec("sh", "-c", "sleep 60 & sleep 60"), on_started=on_started)
    assert session_members(run.pid) == []


async def test_terminate_group_works_on_a_group_we_do_not_wait_for() -> None:
    # As journal reconciliation would: only the pgid is known, nobody reaps the leader.
    child = await trio.lowlevel.open_process(
        ["sh", "-c", "trap '' TERM; echo ready; sleep 60"],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert child.stdout is not None
    try:
        with trio.fail_after(2):
            assert await child.stdout.receive_some() == b"ready\n"  # the trap is set
        started = trio.current_time()
        assert await terminate_group(child.pid, 0.2)
        assert trio.current_time() - started >= 0.2
        with trio.fail_after(2):
            assert await child.wait() == -signal.SIGKILL
    finally:
        with trio.CancelScope(shield=True):
            child.kill()
            await child.wait()
            await child.stdout.aclose()


async def test_terminate_group_of_a_missing_group_is_done_at_once() -> None:
    child = await trio.lowlevel.open_process(["true"], start_new_session=True)
    await child.wait()
    started = trio.current_time()
    assert await terminate_group(child.pid, 5)
    assert trio.current_time() - started < 1


# -- memory limits and affinity -------------------------------------------------

LIMIT = 128 * 1024 * 1024
PRINT_RLIMIT = (PY, "-c", "import resource; print(resource.getrlimit(resource.RLIMIT_AS)[0])")
ALLOCATE = (PY, "-c", f"b = bytearray({2 * LIMIT}); print('allocated')")


async def test_cpu_only_work_gets_rlimit_as_without_cgroups() -> None:
    run = Run()
    assert await run(spec(*PRINT_RLIMIT, memory_limit_bytes=LIMIT, cpu_only=True)) == 0
    assert int(run.stdout.text()) == LIMIT
    run = Run()
    assert await run(spec(*ALLOCATE, memory_limit_bytes=LIMIT, cpu_only=True)) != 0
    assert "MemoryError" in run.stderr.text()


async def test_gpu_work_never_gets_rlimit_as() -> None:
    unlimited = resource.getrlimit(resource.RLIMIT_AS)[0]
    run = Run()
    assert await run(spec(*PRINT_RLIMIT, memory_limit_bytes=LIMIT, cpu_only=False)) == 0
    assert int(run.stdout.text()) == unlimited
    run = Run()
    assert await run(spec(*ALLOCATE, memory_limit_bytes=LIMIT, cpu_only=False)) == 0
    assert run.stdout.text() == "allocated\n"


async def test_cpu_affinity_is_applied() -> None:
    cpu = min(os.sched_getaffinity(0))
    run = Run()
    argv = (PY, "-c", "import os; print(sorted(os.sched_getaffinity(0)))")
    assert await run(spec(*argv, cpu_affinity=(cpu,))) == 0
    assert run.stdout.text() == f"[{cpu}]\n"


def _fake_cgroups(tmp_path: Path) -> tuple[Cgroups, Path]:
    """cgroup v2 imitated by a directory, the daemon in /daemon.service."""
    fake = FakeCgroupV2(tmp_path)
    found = Cgroups.detect(fake.root, fake.self_cgroup, fs=fake.fs)
    assert isinstance(found, Cgroups)
    return found, fake.own


async def test_memory_limit_goes_to_a_cgroup_when_one_can_be_made(tmp_path: Path) -> None:
    cgroups, own = _fake_cgroups(tmp_path)
    expected = own / "litegraph-inv-1"
    written: list[str] = []
    run = Run()

    async def on_started(pid: int, start_ticks: int | None) -> None:
        await run.on_started(pid, start_ticks)
        written.append((expected / "memory.max").read_text())

    process_spec = spec(*PRINT_RLIMIT, memory_limit_bytes=LIMIT, cpu_only=True, cgroup_name="inv-1")
    assert await run(process_spec, cgroups=cgroups, on_started=on_started) == 0
    assert written == [str(LIMIT)]
    # The cgroup enforces the limit, so no address-space limit on top.
    assert int(run.stdout.text()) == resource.getrlimit(resource.RLIMIT_AS)[0]
    assert not expected.exists()


async def test_the_cgroup_is_removed_when_the_run_is_cancelled(tmp_path: Path) -> None:
    cgroups, _ = _fake_cgroups(tmp_path)
    run = Run()
    with trio.move_on_after(0.2):
        await run(spec("sleep", "60", memory_limit_bytes=LIMIT, cgroup_name="i2"), cgroups=cgroups)
    assert run.started
    assert cgroups.leftovers() == []


async def test_the_cgroup_is_removed_when_spawning_fails(tmp_path: Path) -> None:
    cgroups, _ = _fake_cgroups(tmp_path)
    run = Run()
    with pytest.raises(FileNotFoundError):
        await run(spec("true", cwd="/nonexistent/dir", memory_limit_bytes=LIMIT), cgroups=cgroups)
    assert cgroups.leftovers() == []


@pytest.mark.parametrize("cpu_only", [True, False])
async def test_a_cgroup_that_cannot_be_made_fails_the_run_before_anything_runs(
    tmp_path: Path, cpu_only: bool
) -> None:
    cgroups, own = _fake_cgroups(tmp_path)
    (own / "litegraph-taken").mkdir()  # a leftover under the same name is never reused
    marker = tmp_path / "ran"
    run = Run()
    argv = spec(
        "touch", str(marker), memory_limit_bytes=LIMIT, cpu_only=cpu_only, cgroup_name="taken"
    )
    with pytest.raises(ConfinementFailed, match="taken"):
        await run(argv, cgroups=cgroups)
    assert run.started == [] and not marker.exists()
    assert sorted(p.name for p in own.iterdir() if p.is_dir()) == ["litegraph-taken"]


async def test_a_real_cgroup_kills_what_left_the_process_group() -> None:
    found = system_cgroups()
    if os.geteuid() != 0 or not isinstance(found, Cgroups):
        pytest.skip(f"needs root and usable cgroups: {found}")
    run = Run()
    name = f"t{os.getpid()}-escape"
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    print(os.getpid(), flush=True)\n"
        "    os.close(1)\n"
        "    time.sleep(60)\n"
    )
    argv = spec(PY, "-c", code, memory_limit_bytes=LIMIT, cpu_only=False, cgroup_name=name)
    assert await run(argv, cgroups=found) == 0
    assert await gone_within(int(run.stdout.text()))
    assert name not in found.leftovers()


def _survives_sigkill(monkeypatch: pytest.MonkeyPatch) -> None:
    """The group ends, yet its ending reports a member that survived SIGKILL (as one
    stuck in the kernel would, or a sandboxed guest whose bubblewrap exited)."""
    real = supervisor.process.terminate_group

    async def survived(*args: object, **kwargs: object) -> bool:
        await real(*args, **kwargs)  # type: ignore[arg-type]
        return False

    monkeypatch.setattr(supervisor.process, "terminate_group", survived)


async def test_a_run_whose_group_survived_sigkill_is_stuck_however_it_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _survives_sigkill(monkeypatch)
    ended = Run()
    with pytest.raises(ProcessStuck):
        await ended(spec("true"))  # its leader exited 0: still stuck, not succeeded
    assert ended.stuck == 1
    cancelled = Run()
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancelled, spec("sleep", "60"))
            with trio.fail_after(5):
                while not cancelled.started:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            scope.cancel()
    assert scope.cancelled_caught  # the cancel goes on; the caller learns it all the same
    assert cancelled.stuck == 1
    assert Run().stuck == 0


async def test_a_run_whose_cgroup_kept_a_process_past_sigkill_is_stuck(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its group ended, as bubblewrap's does while a guest in its own session is stuck.
    async def kept(*args: object) -> bool:
        return True

    monkeypatch.setattr(supervisor.process, "end_cgroup", kept)
    cgroups, _ = _fake_cgroups(tmp_path)
    run = Run()
    with pytest.raises(ProcessStuck):
        await run(spec("true", memory_limit_bytes=LIMIT, cgroup_name="kept"), cgroups=cgroups)
    assert run.stuck == 1


async def test_a_hurried_ending_does_not_wait_the_kill_grace() -> None:
    # The daemon's second Ctrl-C: a guest that ignores SIGTERM is killed at once.
    hurry = trio.Event()
    out, err = OutputRing(4096), OutputRing(4096)
    started: list[int] = []

    async def on_started(pid: int, _ticks: int | None) -> None:
        started.append(pid)

    stubborn = spec("sh", "-c", "trap '' TERM; echo ready; sleep 60")
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                functools.partial(
                    run_process,
                    stubborn,
                    stdout=out,
                    stderr=err,
                    on_started=on_started,
                    kill_grace=60,
                    cgroups=None,
                    hurry=hurry,
                )
            )
            with trio.fail_after(5):
                while out.text() != "ready\n":  # noqa: ASYNC110
                    await trio.sleep(0.01)
            hurry.set()
            cancelled_at = trio.current_time()
            scope.cancel()
    assert trio.current_time() - cancelled_at < 10
    assert session_members(started[0]) == []
