"""A lane host's process: its command and environment, its start, its exit, its end.

The host is started with the lane's environment (its device in
`CUDA_VISIBLE_DEVICES`, none for the CPU pool) and never outlives the daemon:
it leads its own process group, which every ending kills, and it is started
with PR_SET_PDEATHSIG = SIGKILL, so a daemon killed with SIGKILL takes its
hosts with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

import trio

from supervisor.identity import drop_capabilities
from supervisor.lane_host_pipes import HostPipes
from supervisor.process_env import DEVICE_ENV_NAMES, ENV_ALLOW_LIST
from supervisor.spawn import popen

__all__ = ["DEFAULT_COMMAND", "REAP_SECONDS", "HostProcess", "host_environment", "start_host"]

# The name these lines have always been logged under: operators' filters keep matching.
log = logging.getLogger("supervisor.lane_host")

# -P: the daemon's working directory is not put on sys.path, so a planted
# lanehost/ or numpy.py there is never imported into the trusted host.
DEFAULT_COMMAND: tuple[str, ...] = (sys.executable, "-P", "-m", "lanehost")

REAP_SECONDS = 5.0  # after SIGKILL: how long the process may take to be gone
_PR_SET_PDEATHSIG = 1


def _libc_prctl() -> Callable[..., int] | None:
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_prctl = _libc_prctl()


def _die_with_parent(parent: int, join: Callable[[], None] | None = None) -> Callable[[], None]:
    # Runs in the forked child before exec, with other threads' locks possibly
    # held: syscalls only - no imports, logging or allocation-heavy work.
    def setup() -> None:
        if join is not None:  # the invocation's cgroups, before anything is charged
            join()
        # Trusted, yet it needs none of the capabilities a non-root daemon holds (the
        # unit's CAP_SETUID, CAP_KILL...). Root would get them all back at exec, which
        # also clears the parent-death signal. First: a change of credentials clears it.
        if os.geteuid() != 0:
            drop_capabilities()
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the daemon died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return setup


def host_environment(
    visible_devices: Sequence[str], extra: Mapping[str, str], parent: Mapping[str, str]
) -> dict[str, str]:
    """Allow-listed daemon variables and the daemon's module path < `extra` < the
    lane's devices ("" = none)."""
    env = {name: parent[name] for name in ENV_ALLOW_LIST if name in parent}
    module_path = _absolute_entries(parent.get("PYTHONPATH", ""))
    if module_path:
        # The trusted host imports from where the daemon does (a daemon found only
        # through PYTHONPATH would start hosts that exit with "No module named").
        env["PYTHONPATH"] = module_path
    env.update(extra)
    for name in DEVICE_ENV_NAMES:
        env[name] = ",".join(visible_devices)
    return env


def _absolute_entries(path: str) -> str:
    # An empty or relative entry names the working directory, which `-P` keeps out.
    return os.pathsep.join(p for p in path.split(os.pathsep) if os.path.isabs(p))


async def start_host(
    lane_id: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    join: Callable[[], None] | None = None,
) -> HostProcess:
    """Start the host with its stdin and stdout piped to us, first in the cgroups
    `join` enters (what it spends is then charged there); raises what `popen` raises
    (a join that fails: SubprocessError, and the host never runs)."""
    # On the daemon's fork thread, as guests are (supervisor/spawn.py):
    # PR_SET_PDEATHSIG fires when the *thread* that forked the child ends,
    # and that thread lives as long as the daemon.
    child_in, to_host = os.pipe()
    from_host, child_out = os.pipe()
    try:
        started = await popen(
            argv,
            stdin=child_in,
            stdout=child_out,
            env=env,
            start_new_session=True,  # its own process group, away from terminal signals
            preexec_fn=_die_with_parent(os.getpid(), join),
        )
    except BaseException:
        os.close(to_host)
        os.close(from_host)
        raise
    finally:
        os.close(child_in)
        os.close(child_out)
    return HostProcess(lane_id, started, HostPipes(to_host, from_host))


class HostProcess:
    """One started host: its leader, a pidfd on it, and our ends of its pipes
    (None once closed)."""

    def __init__(self, lane_id: str, popen: subprocess.Popen[bytes], pipes: HostPipes) -> None:
        self.lane_id = lane_id
        self.popen = popen
        self.pipes: HostPipes | None = pipes
        self.pidfd: int | None
        try:
            self.pidfd = os.pidfd_open(popen.pid)
        except OSError:
            self.pidfd = None  # old kernel: exits are polled

    def kill_group(self) -> None:
        # Only while the leader is unreaped: its pid, the group id, cannot be reused.
        if self.popen.returncode is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def wait_exited(self) -> None:
        """Return once the process has exited, however it ended. It neither reaps
        nor kills: a watcher beside the conversation, waiting on its own copy of
        the pidfd, which `end` may close meanwhile."""
        popen = self.popen
        if popen.returncode is not None:
            return
        if self.pidfd is None:
            with contextlib.suppress(ChildProcessError):  # reaped meanwhile: gone
                await trio.to_thread.run_sync(
                    os.waitid,
                    os.P_PID,
                    popen.pid,
                    os.WEXITED | os.WNOWAIT,
                    abandon_on_cancel=True,
                )
            return
        fd = os.dup(self.pidfd)
        try:
            await trio.lowlevel.wait_readable(fd)
        finally:
            os.close(fd)

    async def _wait_exit(self) -> None:
        if self.pidfd is not None:
            await trio.lowlevel.wait_readable(self.pidfd)
            return
        pid = self.popen.pid  # no pidfd (an old kernel): wait in a thread, without reaping
        await trio.to_thread.run_sync(
            os.waitid, os.P_PID, pid, os.WEXITED | os.WNOWAIT, abandon_on_cancel=True
        )

    async def end(self, *, graceful: bool, close_timeout: float) -> None:
        """Close our pipe ends, see the process exit (EOF first if `graceful`, then
        SIGKILL to the group), reap it. Callers shield this."""
        if self.pipes is not None:
            self.pipes.close()
            self.pipes = None
        popen = self.popen
        if popen.returncode is not None:
            return
        if graceful:  # the host exits on EOF, which closing our end just sent
            with trio.move_on_after(close_timeout):
                await self._wait_exit()
        self.kill_group()  # also any process the host left in its group
        with trio.move_on_after(REAP_SECONDS):
            await self._wait_exit()
        try:
            popen.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            log.error("lane host %s (pid %d) survived SIGKILL", self.lane_id, popen.pid)
            return
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
