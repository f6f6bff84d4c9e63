"""How a guest's process starts: its gate, its uid, its environment and its place.

The gate: the child blocks on its stdin (a pipe) until the daemon has journaled
its start, so nothing runs that a crash could leave unrecorded. A shell reads
one line, then execs the rest with stdin from /dev/null; a closed pipe without
the line means "never run".

The daemon's child runs no Python between fork and exec, so it is vforked
(`supervisor/spawn.py`): the daemon's page tables are not copied and nobody
pays copy-on-write faults. While the child waits at the gate, the daemon puts
it in its cgroups and sets its RLIMIT_AS and CPU set from outside (`place`).
After the gate, setpriv (util-linux) takes the guest's uid and gid, drops the
supplementary groups and empties the inheritable and ambient capability sets
(a daemon that is not root may hold ambient ones), so its exec of bwrap leaves
the guest no capability. The gate and setpriv run as the daemon's user, so
they get an empty environment: the guest's own reaches bwrap through a memfd
(`--args`: `--clearenv`, then `--setenv` each), never through a command line,
which every local user can read.

A daemon that is not root takes a guest's uid another way: its subordinate uids
are mapped into one user namespace (`supervisor/subuids.py`), and after the gate
nsenter (util-linux) enters it, drops the supplementary groups and takes the
guest's uid and gid there (`userns_entry`); its exec of bwrap leaves the guest no
capability either. That needs nsenter and a bwrap with `--clearenv`: there is no
other way in (`SandboxUnavailable` otherwise; the start-up probe falls back).

Where that cannot be done (no setpriv, a bwrap without `--clearenv`, or a guest
with a uid of its own but no sandbox, whose environment would reach the gate),
the daemon forks in full and the child joins its cgroups, sets its limits and
takes its uid itself before exec (`become`); bwrap is then its own gate
(`--block-fd`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import resource
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from machine.cgroups import InvocationCgroup
from supervisor.gate import gate_argv
from supervisor.identity import become
from supervisor.sandbox import SandboxSpec, SandboxUnavailable, bwrap_argv

__all__ = [
    "GATE_SHELL",
    "Launch",
    "bwrap_takes_env",
    "find_nsenter",
    "find_setpriv",
    "plan",
    "uid_drop",
    "userns_entry",
]

GATE_SHELL = (
    "/bin/sh",
    "-c",
    'read -r _ || exit 126; exec "$@" </dev/null',
    "litegraph-gate",
)
# Root runs setpriv: only from the system's own folders, never the daemon's PATH.
_SYSTEM_PATH = "/usr/bin:/bin"
_PROBE_SECONDS = 5.0


@functools.cache
def find_setpriv() -> str | None:
    return shutil.which("setpriv", path=_SYSTEM_PATH)


@functools.cache
def find_nsenter() -> str | None:
    return shutil.which("nsenter", path=_SYSTEM_PATH)


@functools.cache
def bwrap_takes_env(bwrap: Path) -> bool:
    """Whether this bwrap has `--clearenv` (bubblewrap 0.5 and later); run once per path."""
    try:
        shown = subprocess.run(
            [str(bwrap), "--help"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=_PROBE_SECONDS,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return b"--clearenv" in shown.stdout + shown.stderr


def uid_drop(setpriv: str, uid: int) -> list[str]:
    """setpriv's command line that becomes `uid` (and the gid of that number) with no
    supplementary groups and no inheritable or ambient capability, then execs the rest."""
    return [
        setpriv,
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--ambient-caps=-all",
        "--",
    ]


def userns_entry(nsenter: str, userns_fd: int, uid: int) -> list[str]:
    """nsenter's command line that enters the user namespace the daemon holds open as
    `userns_fd` (through the daemon's own /proc entry: nothing is inherited, so no
    guest holds it), drops every supplementary group, takes `uid` and the gid of that
    number there, then execs the rest (which starts with no capability)."""
    return [
        nsenter,
        f"--user=/proc/{os.getpid()}/fd/{userns_fd}",
        f"--setuid={uid}",
        f"--setgid={uid}",
        "--",
    ]


@dataclass
class Launch:
    """What `spawn` gets: the command, its environment, and either the old in-child
    hook (`preexec_fn`) or what places the gated child from outside (`place`)."""

    argv: list[str]
    env: dict[str, str]
    preexec_fn: Callable[[], None] | None = None
    place: Callable[[int], None] | None = None
    # Inherited by the child (the environment's memfd); the parent's copies go with close().
    pass_fds: tuple[int, ...] = field(default=())

    def close(self) -> None:
        for fd in self.pass_fds:
            os.close(fd)
        self.pass_fds = ()


def _env_fd(env: Mapping[str, str]) -> int:
    """A memfd holding bwrap's `--clearenv` and one `--setenv NAME VALUE` per variable,
    NUL-separated (names and values hold no NUL: validated before)."""
    parts = [b"--clearenv"]
    for name, value in env.items():
        parts += [b"--setenv", name.encode(), value.encode()]
    data = b"\0".join(parts) + b"\0"
    fd = os.memfd_create("litegraph-guest-env", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _placer(
    cgroup: InvocationCgroup | None, rlimit_as: int | None, affinity: tuple[int, ...] | None
) -> Callable[[int], None] | None:
    if cgroup is None and rlimit_as is None and affinity is None:
        return None

    def place(pid: int) -> None:
        if cgroup is not None:
            cgroup.admit(pid)
        if rlimit_as is not None:
            resource.prlimit(pid, resource.RLIMIT_AS, (rlimit_as, rlimit_as))
        if affinity is not None:
            os.sched_setaffinity(pid, affinity)

    return place


# preexec_fn forks with other threads alive (trio's spawn thread among them);
# the hook therefore only makes syscalls - no imports, locks or logging.
def _preexec(
    affinity: tuple[int, ...] | None,
    rlimit_as: int | None,
    join_cgroup: Callable[[], None] | None,
    uid: int | None,
) -> Callable[[], None] | None:
    if affinity is None and rlimit_as is None and join_cgroup is None and uid is None:
        return None

    def setup() -> None:
        # Runs in the forked child before exec: syscalls only. Joining the cgroup
        # needs the daemon's rights, so the uid is dropped last.
        if join_cgroup is not None:
            join_cgroup()
        if rlimit_as is not None:
            resource.setrlimit(resource.RLIMIT_AS, (rlimit_as, rlimit_as))
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
        if uid is not None:
            become(uid)

    return setup


def _userns_entry(bwrap: Path, userns_fd: int, uid: int | None) -> list[str]:
    nsenter = find_nsenter()
    if uid is None or nsenter is None or not bwrap_takes_env(bwrap):
        raise SandboxUnavailable(
            "a guest takes a subordinate uid only with a uid, nsenter (util-linux) and "
            "a bwrap with --clearenv"
        )
    return userns_entry(nsenter, userns_fd, uid)


def plan(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    sandbox: SandboxSpec | None,
    uid: int | None,
    cgroup: InvocationCgroup | None,
    rlimit_as: int | None = None,
    affinity: tuple[int, ...] | None = None,
) -> Launch:
    """How to start `argv` (blocking: may run `bwrap --help` once per bwrap)."""
    place = _placer(cgroup, rlimit_as, affinity)
    if sandbox is None and uid is None:
        # Nobody to protect the gate from: it runs as the guest would.
        return Launch([*GATE_SHELL, *argv], dict(env), place=place)
    join = cgroup.preexec_join if cgroup is not None else None
    if sandbox is None:
        hook = _preexec(affinity, rlimit_as, join() if join else None, uid)
        return Launch([*GATE_SHELL, *argv], dict(env), preexec_fn=hook)
    gate = sandbox.gate
    own_drop = uid is not None and sandbox.userns_fd is None
    setpriv = find_setpriv() if own_drop and gate is None else None
    # The launch's own copies of the cwd's and the tokens' descriptors, closed with
    # it; the caller's stay. bwrap closes both in the child once it has used them.
    cwd_fd = None if sandbox.cwd_fd is None else os.dup(sandbox.cwd_fd)
    fds: tuple[int, ...] = () if cwd_fd is None else (cwd_fd,)
    try:
        token_fd = None if sandbox.token_fd is None else os.dup(sandbox.token_fd)
        fds += () if token_fd is None else (token_fd,)
        sandbox = dataclasses.replace(sandbox, cwd_fd=cwd_fd, token_fd=token_fd)
        # The gate: litegraph-gate (taking the uid itself where nothing else does),
        # else the gate shell; then what takes the uid, if anything else does.
        held = (
            list(GATE_SHELL)
            if gate is None
            else gate_argv(gate, uid if own_drop else None, keep_stdin=sandbox.stage)
        )
        drop: list[str] | None = None
        if sandbox.userns_fd is not None:
            drop = _userns_entry(sandbox.bwrap, sandbox.userns_fd, uid)
        elif (not own_drop or gate is not None or setpriv is not None) and bwrap_takes_env(
            sandbox.bwrap
        ):
            drop = [] if setpriv is None or uid is None else uid_drop(setpriv, uid)
        if drop is not None:
            env_fd = _env_fd(env)
            fds = (env_fd, *fds)
            command = bwrap_argv(sandbox, argv, env_fd=env_fd)
            return Launch([*held, *drop, *command], {}, place=place, pass_fds=fds)
        if sandbox.stage:
            raise SandboxUnavailable("a pooled sandbox needs a bwrap with --clearenv")
        hook = _preexec(affinity, rlimit_as, join() if join else None, uid)
        # bwrap reads one byte from fd 0 before it runs the guest.
        command = bwrap_argv(sandbox, argv, block_fd=0)
        return Launch(command, dict(env), preexec_fn=hook, pass_fds=fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
