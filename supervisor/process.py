"""The `process` executor: run one invocation as a child process group.

The child starts in its own session (so its process group id is its pid) with
stdin from /dev/null, a tight environment, the devices it was granted and
nothing else, and optionally a memory limit and a CPU set. However the run
ends - normal exit, an exception, the caller's cancel scope or deadline,
KeyboardInterrupt - the whole process group is ended: SIGTERM, up to
`kill_grace` seconds for it to empty, then SIGKILL. A sandboxed guest's SIGTERM
goes to its own processes inside the sandbox, not to bubblewrap, which would die
of it and take the guest with it by SIGKILL (`machine.procgroup.terminate_sandbox`).
That cleanup runs shielded and with its own deadline, its output is read to the end
meanwhile (what a TERM handler prints is kept), and then whatever ended the run
propagates.

What a request may ask is checked by `supervisor.process_validation`, the child's
environment is made by `supervisor.process_env`, and its memory and other limits
are enforced by `supervisor.process_cgroup` (a cgroup, else RLIMIT_AS for
CPU-only work, else a warning).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Literal

import trio

from machine.cgroups import CgroupError, Cgroups, CgroupUsage, InvocationCgroup
from machine.proc import process_start_ticks
from machine.procgroup import terminate_group, terminate_sandbox
from supervisor.gate import stage_message
from supervisor.output import OutputRing, Sink, pump
from supervisor.pipe_writes import write_all
from supervisor.process_cgroup import (
    CGROUP_THREAD,
    SYSTEM_CGROUPS,
    ConfinementFailed,
    end_cgroup,
    prepare_launch,
    resolve_cgroups,
    watch_oom,
)
from supervisor.process_env import ENV_ALLOW_LIST, RESERVED_ENV_NAMES, build_environment
from supervisor.process_spec import ProcessSpec
from supervisor.process_validation import (
    InvalidProcessRequest,
    validate_argv,
    validate_env,
    validate_spec,
)
from supervisor.spawn import Child, spawn

if TYPE_CHECKING:
    from supervisor.sandbox_pool import ReadySandbox

__all__ = [
    "ENV_ALLOW_LIST",
    "RESERVED_ENV_NAMES",
    "SYSTEM_CGROUPS",
    "ConfinementFailed",
    "InvalidProcessRequest",
    "ProcessSpec",
    "ProcessStuck",
    "build_environment",
    "run_process",
    "terminate_group",
    "validate_argv",
    "validate_env",
    "validate_spec",
]

# After the group is gone: how long the pumps may take to read what is left
# in the pipes (longer only if something outside the group holds them).
_DRAIN_SECONDS = 1.0


class ProcessStuck(RuntimeError):
    """The child survived SIGKILL within the wait (e.g. stuck in the kernel)."""

    def __init__(self, pid: int) -> None:
        super().__init__(f"process {pid} did not exit after SIGKILL")
        self.pid = pid


# -- ending a process group --------------------------------------------------
# terminate_group (SIGTERM, grace, SIGKILL) lives in machine.procgroup, shared with
# reconcile; it is re-exported here.


async def _wait_exit_unreaped(proc: Child, pidfd: int | None) -> None:
    """Wait for the leader to exit but leave it a zombie.

    While the zombie exists its pid - the group id - cannot be reused, so the
    SIGTERM that follows cannot reach an unrelated process group.
    """
    if pidfd is None:
        await proc.wait()
    else:
        await trio.lowlevel.wait_readable(pidfd)


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None  # old kernel: fall back to waiting with reaping


# -- running -----------------------------------------------------------------


async def _pump_both(
    scope: trio.CancelScope,
    proc: Child,
    stdout: OutputRing,
    stderr: OutputRing,
    sinks: tuple[Sink, Sink] | None,
) -> None:
    """Both streams to their rings and sinks until EOF, or until `scope` ends it."""
    out_sink, err_sink = sinks or (None, None)
    with scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump, proc.stdout, stdout, out_sink)
            nursery.start_soon(pump, proc.stderr, stderr, err_sink)


async def _start(
    spec: ProcessSpec, cgroups: Cgroups | None, env: Mapping[str, str]
) -> tuple[InvocationCgroup | None, Child, int]:
    """The cgroup and the child waiting at its gate, and the gate's write end."""
    # mkdir and the limit writes cost milliseconds of kernel time: not on the event
    # loop. Never lost to a cancel (the job completes; spawn's failure path below
    # removes the cgroup).
    cgroup, launch = await CGROUP_THREAD.run(
        functools.partial(prepare_launch, spec, cgroups, env), shield=True
    )
    gate_read, gate_write = os.pipe()
    try:
        proc = await spawn(
            launch.argv,
            stdin=gate_read,
            env=launch.env,
            # In a sandbox the guest's folder is bound by bwrap; the guest's uid
            # may not be able to enter the daemon's own working directory.
            cwd="/" if spec.sandbox is not None else spec.cwd,
            preexec_fn=launch.preexec_fn,
            place=launch.place,
            pass_fds=launch.pass_fds,
        )
    except BaseException:
        os.close(gate_write)
        if cgroup is not None:
            with trio.move_on_after(10, shield=True):
                await cgroup.remove()
        raise
    finally:
        os.close(gate_read)
        launch.close()
    return cgroup, proc, gate_write


def _tokens(spec: ProcessSpec) -> bytes:
    """The guest's tokens, from the sealed memfd its direct start would have bound."""
    fd = None if spec.sandbox is None else spec.sandbox.token_fd
    if fd is None:
        return b""
    return os.pread(fd, os.fstat(fd).st_size, 0)


def _members(cgroup: InvocationCgroup) -> frozenset[int] | None:
    """Every process in the guest's cgroup (its whole sandbox); None if unreadable."""
    try:
        return cgroup.pids()
    except CgroupError:
        return None


async def _send_all(fd: int, data: bytes) -> None:
    """Write `data` to the pipe `fd` without blocking the event loop (a stage's message
    may be larger than the pipe holds)."""
    if len(data) <= 1:
        os.write(fd, data)
        return
    os.set_blocking(fd, False)
    await write_all(fd, data)


async def run_process(
    spec: ProcessSpec,
    *,
    stdout: OutputRing,
    stderr: OutputRing,
    on_started: Callable[[int, int | None], Awaitable[None]],
    kill_grace: float = 5.0,
    cgroups: Cgroups | Literal["system"] | None = SYSTEM_CGROUPS,
    parent_env: Mapping[str, str] | None = None,
    on_usage: Callable[[CgroupUsage], None] | None = None,
    sinks: tuple[Sink, Sink] | None = None,
    on_cgroup: Callable[[InvocationCgroup], None] | None = None,
    before_cgroup_end: Callable[[], Awaitable[None]] | None = None,
    ready: ReadySandbox | None = None,
    on_stuck: Callable[[], None] | None = None,
    hurry: trio.Event | None = None,
) -> int:
    """Run `spec` to the end and return its exit code (negative: killed by that signal).

    `on_started(pid, start_ticks)` is awaited right after spawn and before the
    argv runs (the child waits for it); (pid, start_ticks) identifies the
    process even after pid reuse. If it raises, the child is killed without
    ever running the argv. `cgroups=None` never uses cgroups; `parent_env`
    defaults to os.environ. `sinks` (stdout's, stderr's) see every chunk of output
    as it comes (the invocation's log files). `on_usage` gets the cgroup's own counters (CPU time,
    peak memory, OOM kills, refused forks) once everything in it has ended.
    `on_cgroup` learns of the cgroup once it is made (others may join it: the
    invocation's lane hosts), and `before_cgroup_end` is awaited once the guest's
    group has ended, before the cgroup is emptied, read and removed. `ready`: a
    sandbox made ahead for `spec`'s shape and uid, now this run's to start or end.
    `on_stuck` is called, however the run ends, when something of it survived SIGKILL
    (a cancel still propagates; a normal end raises ProcessStuck then). `hurry`, once
    set (the daemon's second Ctrl-C), cuts the kill grace short.
    """
    try:
        validate_spec(spec)
        env = build_environment(spec, os.environ if parent_env is None else parent_env)
    except BaseException:
        if ready is not None:
            await ready.end()
        raise
    cgroups = resolve_cgroups(cgroups)
    if ready is not None:
        # Made ahead (`supervisor/sandbox_pool.py`): its stage waits for this message.
        cgroup, proc, gate_write = ready.cgroup, ready.proc, ready.command
        opening = stage_message(spec.argv, env, _tokens(spec))
    else:
        cgroup, proc, gate_write = await _start(spec, cgroups, env)
        opening = b"\n"
    if cgroup is not None and on_cgroup is not None:
        on_cgroup(cgroup)
    pgid = proc.pid  # start_new_session: the child leads its own group
    pidfd = _open_pidfd(proc.pid)
    ended = stuck = False

    async def end_group() -> None:
        # Once only: after the group is gone its id could be reused.
        nonlocal ended, stuck
        if ended:
            return
        ended = True
        gone = False
        # The hook bounds itself; the group's ending and the cgroup's have this.
        with trio.move_on_after(kill_grace + 15, shield=True):
            if spec.sandbox is not None:
                members = None if cgroup is None else functools.partial(_members, cgroup)
                gone = await terminate_sandbox(
                    pgid, kill_grace, leader=proc, members=members, hurry=hurry
                )
            else:
                gone = await terminate_group(pgid, kill_grace, leader=proc, hurry=hurry)
        with trio.CancelScope(shield=True):
            if cgroup is not None and before_cgroup_end is not None:
                await before_cgroup_end()
        # Stuck if either says so: a sandboxed guest's processes are in sessions of their
        # own, so bubblewrap's group can be gone while the cgroup still holds one.
        with trio.move_on_after(15, shield=True) as removing:
            if cgroup is not None:
                gone = not await end_cgroup(cgroup, spec.cgroup_name, on_usage) and gone
        stuck = not gone or removing.cancelled_caught
        if stuck and on_stuck is not None:
            on_stuck()

    try:
        try:
            # Not reaped yet, so /proc still shows it even if it already exited.
            ticks = ready.start_ticks if ready is not None else process_start_ticks(proc.pid)
            await on_started(proc.pid, ticks)
            await _send_all(gate_write, opening)
        except BaseException:
            # Kill before the pipe closes: a closed gate must never let the argv run.
            await end_group()
            raise
        finally:
            os.close(gate_write)
        async with trio.open_nursery() as nursery:
            # Shielded: a cancel or deadline that ends the run does not stop the
            # reading; what the guest writes while it ends (its TERM handler) is kept.
            reading = trio.CancelScope(shield=True)
            nursery.start_soon(_pump_both, reading, proc, stdout, stderr, sinks)
            try:
                oom_watch = trio.CancelScope()
                if cgroup is not None and cgroup.version == "v1":
                    # v1's OOM killer ends one process; an invocation ends whole (v2: oom.group).
                    nursery.start_soon(watch_oom, cgroup, oom_watch)
                await _wait_exit_unreaped(proc, pidfd)
                oom_watch.cancel()
            finally:
                # A normal exit too ends the group: grandchildren left behind go as
                # well, and then the pipes reach EOF. A cancel ends it here, while
                # the output is still read.
                try:
                    await end_group()
                finally:
                    reading.deadline = min(reading.deadline, trio.current_time() + _DRAIN_SECONDS)
    finally:
        # Exception, cancellation, KeyboardInterrupt: same ending, then it propagates.
        await end_group()
        if pidfd is not None:
            os.close(pidfd)
        await proc.aclose()
    if proc.returncode is None or stuck:
        raise ProcessStuck(proc.pid)
    return proc.returncode
