"""One daemon per state folder: an exclusive `flock` on `<state-dir>/daemon.lock`.

Two daemons on one folder replace each other's signing key and address file and
interleave their journal records, so `serve` and `dev` take this lock after the
folder's own checks and before anything in it is read or written, and hold it
until they stop. The kernel drops it however the process ends (SIGKILL
included), so a stale lock cannot outlive its daemon. The file is never removed:
a waiter could otherwise lock a file that is no longer the folder's. Its text is
the holder's pid, only so that a refusal can name it; the lock itself is the
`flock`. The descriptor is close-on-exec: guests and lane hosts never hold it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import pathlib
import stat

import trio

from node.statedir import StateDirError

__all__ = ["LOCK_FILE", "StateLock", "lock_state_dir"]

LOCK_FILE = "daemon.lock"
# How often a waiting daemon tries again: small beside any sensible wait.
_RETRY_SECONDS = 0.05
log = logging.getLogger(__name__)


class StateLock:
    """The held lock; `release` (or the process's end) lets the next daemon in."""

    def __init__(self, fd: int, path: pathlib.Path) -> None:
        self.fd = fd
        self.path = path

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = -1


async def lock_state_dir(state_dir: pathlib.Path, *, wait: float) -> StateLock:
    """The folder's lock, waiting up to `wait` seconds for a daemon that holds it
    (one still in its shutdown grace, say); StateDirError naming the holder's pid
    past that, or when the lock file is not a plain file of ours."""
    path = state_dir / LOCK_FILE
    fd = _open(path)
    try:
        deadline = trio.current_time() + wait
        said = False
        while not _try_lock(fd, path):
            holder = _holder(path)
            if trio.current_time() >= deadline:
                raise StateDirError(
                    f"state folder {state_dir} is in use by {holder} (another serve or dev);"
                    f" waited {wait:g}s for it to stop (--state-lock-wait)"
                )
            if not said:
                log.info(
                    "state folder %s is in use by %s; waiting up to %gs for it to stop",
                    state_dir,
                    holder,
                    wait,
                )
                said = True
            await trio.sleep(_RETRY_SECONDS)
    except BaseException:
        os.close(fd)
        raise
    _write_pid(fd)
    return StateLock(fd, path)


def _open(path: pathlib.Path) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StateDirError(f"lock file {path} is a symlink (remove it)") from exc
        raise StateDirError(f"lock file {path} cannot be opened: {exc.strerror}") from exc
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
        os.close(fd)
        raise StateDirError(f"lock file {path} is not a plain file of this daemon's (remove it)")
    return fd


def _try_lock(fd: int, path: pathlib.Path) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        raise StateDirError(f"lock file {path} cannot be locked: {exc.strerror}") from exc
    return True


def _write_pid(fd: int) -> None:
    # Best effort: only the message of a refused daemon reads it.
    text = f"{os.getpid()}\n".encode()
    try:
        os.pwrite(fd, text, 0)
        os.ftruncate(fd, len(text))
    except OSError as exc:
        log.warning("cannot write this daemon's pid into the state folder's lock file: %s", exc)


def _holder(path: pathlib.Path) -> str:
    """'pid N' of the daemon holding the lock, as it wrote it; 'another process' if unsaid."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            text = os.read(fd, 64)
        finally:
            os.close(fd)
    except OSError:
        return "another process"
    first = text.split(b"\n", 1)[0].strip()
    return f"pid {int(first)}" if first.isdigit() and len(first) < 12 else "another process"
