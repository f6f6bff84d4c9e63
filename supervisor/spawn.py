"""Forking guests and lane hosts from one thread that lives as long as the daemon.

A child's parent-death signal (bwrap's `--die-with-parent`, PR_SET_PDEATHSIG)
fires when the *thread* that forked it exits, not the process. trio forks in
its worker threads, which retire after ten idle seconds, so a sandboxed guest
was killed ten seconds after the node went quiet. Here every fork happens on
one thread started once and never ended while the daemon runs: a child dies
with the daemon, and only then, and the fork never blocks the event loop.

A child started without a `preexec_fn` is vforked (CPython does so when no Python
runs between fork and exec): the daemon's page tables are not copied, and
neither it nor the child pays for copy-on-write faults, which cost more than
the rest of a guest's start. `place(pid)` then puts the child where it must be
(its cgroups) before the caller lets it go on.
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

from machine.kept_thread import KeptThread

__all__ = ["Child", "popen", "spawn"]

# Never idle-ended: a child dies with the thread that forked it.
_FORKER = KeptThread("litegraph-fork", idle_exit=None)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None  # an old kernel: waits poll instead


class Child:
    """A spawned process: its pid, its output as trio streams, and a reaping wait."""

    POLL_SECONDS = 0.01

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        stdout: trio.lowlevel.FdStream,
        stderr: trio.lowlevel.FdStream,
    ) -> None:
        self._popen = popen
        self.stdout = stdout
        self.stderr = stderr
        self._pidfd = _pidfd(popen.pid)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def poll(self) -> int | None:
        """Its exit code if it has exited (reaping it), else None."""
        return self._popen.poll()

    async def wait(self) -> int:
        """Wait until it exits and reap it."""
        while (code := self.poll()) is None:
            if self._pidfd is not None:
                await trio.lowlevel.wait_readable(self._pidfd)
            else:
                await trio.sleep(self.POLL_SECONDS)
        return code

    async def aclose(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        await trio.aclose_forcefully(self.stdout)
        await trio.aclose_forcefully(self.stderr)


def _start(
    argv: list[str], place: Callable[[int], None] | None, kwargs: dict[str, Any]
) -> subprocess.Popen[bytes]:
    child = subprocess.Popen(argv, **kwargs)
    if place is not None:
        try:
            place(child.pid)
        except BaseException:
            # It waits at its gate and has run nothing of the caller's: end it here.
            child.kill()
            child.wait()
            raise
    return child


async def popen(
    argv: Sequence[str], *, place: Callable[[int], None] | None = None, **kwargs: Any
) -> subprocess.Popen[bytes]:
    """`subprocess.Popen(argv, **kwargs)` on the fork thread, then `place(pid)` there
    (if it raises, the child is killed and reaped). A fork under way completes even
    if the caller is cancelled, so its child is never lost."""
    child: subprocess.Popen[bytes] = await _FORKER.run(
        functools.partial(_start, list(argv), place, kwargs), shield=True
    )
    return child


async def spawn(
    argv: Sequence[str],
    *,
    stdin: int,
    env: Mapping[str, str],
    cwd: str | None,
    preexec_fn: Callable[[], None] | None,
    place: Callable[[int], None] | None = None,
    pass_fds: tuple[int, ...] = (),
) -> Child:
    """Start `argv` in a session of its own, stdout and stderr piped to us; then
    `place(pid)` on the fork thread (see `popen`)."""
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        child = await popen(
            argv,
            stdin=stdin,
            stdout=out_write,
            stderr=err_write,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
            preexec_fn=preexec_fn,
            place=place,
            pass_fds=pass_fds,
        )
    except BaseException:
        os.close(out_read)
        os.close(err_read)
        raise
    finally:
        os.close(out_write)
        os.close(err_write)
    return Child(child, trio.lowlevel.FdStream(out_read), trio.lowlevel.FdStream(err_read))
