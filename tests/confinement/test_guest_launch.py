"""How a guest starts: the daemon is vforked, never copied, and its child is placed in
its cgroups from outside while it waits at its gate; the guest still gets its own uid,
no capability and exactly its environment, which never reaches a command line or the
root-run gate. Where setpriv or a bwrap with --clearenv is missing, the full fork
confines the same."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

from machine.cgroups import Cgroups, system_cgroups
from supervisor import launch
from supervisor.output import OutputRing
from supervisor.process import ProcessSpec, build_environment, run_process
from supervisor.sandbox import SandboxSpec
from tests.helpers import guest_cwd

GUEST_UID = 200_457
SECRET = "s3cret-value-4711"
MiB = 1 << 20
# Inside the sandbox: the uid, the capability sets, then the environment NUL-separated.
PROBE = (
    "/bin/sh",
    "-c",
    "id -u; grep -E '^Cap(Inh|Prm|Eff|Amb)' /proc/self/status; printf '%s\\0' END; env -0",
)


def _cgroups() -> Cgroups:
    found = system_cgroups()
    if not isinstance(found, Cgroups):
        pytest.skip(f"needs usable cgroups: {found}")
    return found


def _spec(name: str) -> ProcessSpec:
    bwrap = shutil.which("bwrap")
    assert bwrap is not None
    return ProcessSpec(
        argv=PROBE,
        env={"GUEST_SECRET": SECRET},
        memory_limit_bytes=256 * MiB,
        cpu_only=True,
        cgroup_name=f"t{os.getpid()}-{name}",
        uid=GUEST_UID,
        sandbox=SandboxSpec(bwrap=Path(bwrap).resolve(), isolate_network=True),
        cpu_millis=500,
        pids_max=64,
    )


class _Seen:
    """What the host sees of the gated child, and the hooks each spawn was given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, spec: ProcessSpec) -> None:
        assert spec.sandbox is not None
        launch.bwrap_takes_env(spec.sandbox.bwrap)  # its one `bwrap --help` is no guest
        self.hooks: list[object] = []
        self.cgroup = ""
        self.environ = b""
        self.cmdline = b""
        real = subprocess.Popen

        def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
            self.hooks.append(kwargs.get("preexec_fn"))
            return real(*args, **kwargs)

        monkeypatch.setattr(subprocess, "Popen", popen)

    async def on_started(self, pid: int, _ticks: int | None) -> None:
        # The child waits at its gate: nothing of the guest has run yet.
        self.cgroup = await trio.Path(f"/proc/{pid}/cgroup").read_text()
        self.environ = await trio.Path(f"/proc/{pid}/environ").read_bytes()
        self.cmdline = await trio.Path(f"/proc/{pid}/cmdline").read_bytes()


async def _run(spec: ProcessSpec, seen: _Seen) -> tuple[int, str]:
    stdout, stderr = OutputRing(64 * 1024), OutputRing(64 * 1024)
    code = await run_process(
        spec,
        stdout=stdout,
        stderr=stderr,
        on_started=seen.on_started,
        kill_grace=1.0,
        cgroups=_cgroups(),
        parent_env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
    )
    assert code == 0, stderr.text()
    return code, stdout.text()


def _check_placed(spec: ProcessSpec, cgroup: str) -> None:
    """Every hierarchy that enforces a limit lists the child in the invocation's cgroup."""
    name = f"litegraph-{spec.cgroup_name}"
    placed: set[str] = set()
    for line in cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if path.rsplit("/", 1)[-1] == name:
            placed.update(controllers.split(",") if controllers else ["unified"])
    wanted = {"unified"} if _cgroups().version == "v2" else {"memory", "cpu", "pids", "freezer"}
    assert wanted <= placed, cgroup


def _check_guest(spec: ProcessSpec, out: str) -> None:
    head, _, env_text = out.partition("END\0")
    lines = head.splitlines()
    assert lines[0] == str(GUEST_UID)
    for line in lines[1:]:
        assert line.split()[1] == "0000000000000000", head
    env = dict(item.split("=", 1) for item in env_text.split("\0") if item)
    expected = build_environment(spec, {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    # The probe's shell adds PWD; everything else is exactly the guest's environment.
    env.pop("PWD", None)
    assert env == expected


async def test_a_guest_is_vforked_and_in_its_cgroups_before_its_gate_opens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = _spec("vfork")
    seen = _Seen(monkeypatch, spec)
    _code, out = await _run(spec, seen)
    # No Python ran in the daemon's child: CPython vforks only then.
    assert seen.hooks == [None]
    _check_placed(spec, seen.cgroup)
    # The gate runs as the daemon's user: it holds none of the guest's variables,
    # and they are on no command line, which every user can read.
    assert seen.environ == b""
    assert SECRET.encode() not in seen.cmdline
    _check_guest(spec, out)


@pytest.mark.parametrize("missing", ["setpriv", "clearenv"])
async def test_without_setpriv_or_clearenv_the_full_fork_confines_the_same(
    monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    if missing == "setpriv":
        monkeypatch.setattr(launch, "find_setpriv", lambda: None)
    else:
        monkeypatch.setattr(launch, "bwrap_takes_env", lambda _bwrap: False)
    spec = _spec(missing)
    seen = _Seen(monkeypatch, spec)
    _code, out = await _run(spec, seen)
    assert len(seen.hooks) == 1 and seen.hooks[0] is not None
    _check_placed(spec, seen.cgroup)  # joined in its own hook
    assert SECRET.encode() not in seen.cmdline
    _check_guest(spec, out)


@pytest.mark.parametrize("missing", ["nothing", "setpriv", "clearenv"])
async def test_every_launch_binds_the_opened_cwd_not_the_folder_its_name_leads_to_now(
    monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    if missing == "setpriv":
        monkeypatch.setattr(launch, "find_setpriv", lambda: None)
    elif missing == "clearenv":
        monkeypatch.setattr(launch, "bwrap_takes_env", lambda _bwrap: False)
    folder = guest_cwd() / "work"
    folder.mkdir(mode=0o755)
    (folder / "marker").write_text("opened\n")
    opened = os.open(folder, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        folder.rename(folder.with_name("moved"))  # the name now leads to another folder
        folder.mkdir(mode=0o755)
        (folder / "marker").write_text("swapped in\n")
        for path in (folder / "marker", folder.with_name("moved") / "marker"):
            path.chmod(0o644)
        base = _spec(f"cwd-{missing}")
        assert base.sandbox is not None
        sandbox = dataclasses.replace(base.sandbox, cwd=str(folder), cwd_fd=opened)
        spec = dataclasses.replace(base, argv=("/bin/sh", "-c", "pwd; cat marker"), sandbox=sandbox)
        _code, out = await _run(spec, _Seen(monkeypatch, spec))
    finally:
        os.close(opened)
    assert out == f"{folder}\nopened\n"
