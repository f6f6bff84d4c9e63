"""The state folder's lock: one holder, named when refused, gone with its process."""

from __future__ import annotations

import fcntl
import functools
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import trio

from node.statedir import StateDirError
from node.statelock import LOCK_FILE, StateLock, lock_state_dir


def _lock(state_dir: pathlib.Path, wait: float) -> StateLock:
    """The lock taken outside a trio run, for the tests that run children."""
    return trio.run(functools.partial(lock_state_dir, state_dir, wait=wait))


async def test_a_second_lock_is_refused_naming_the_holder_and_released_with_it(
    tmp_path: pathlib.Path,
) -> None:
    held = await lock_state_dir(tmp_path, wait=0)
    lock_file = tmp_path / LOCK_FILE
    assert lock_file.read_text() == f"{os.getpid()}\n"
    assert lock_file.stat().st_mode & 0o777 == 0o600
    with pytest.raises(StateDirError) as refused:
        await lock_state_dir(tmp_path, wait=0)
    assert str(refused.value) == (
        f"state folder {tmp_path} is in use by pid {os.getpid()} (another serve or dev);"
        " waited 0s for it to stop (--state-lock-wait)"
    )
    held.release()
    again = await lock_state_dir(tmp_path, wait=0)
    again.release()
    assert lock_file.exists()  # never removed: a waiter may hold it open


async def test_a_waiter_gets_the_lock_once_the_holder_lets_go(tmp_path: pathlib.Path) -> None:
    held = await lock_state_dir(tmp_path, wait=0)

    async def let_go() -> None:
        await trio.sleep(0.3)
        held.release()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(let_go)
        with trio.fail_after(5):
            started = trio.current_time()
            waiter = await lock_state_dir(tmp_path, wait=10)
        assert trio.current_time() - started >= 0.3
    waiter.release()


def test_the_lock_of_a_killed_holder_is_free_at_once(tmp_path: pathlib.Path) -> None:
    """SIGKILL leaves no stale lock: the kernel drops a flock with its last descriptor."""
    holder = (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(tmp_path / LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT, 0o600)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'%d\\n' % os.getpid())\n"
        "print('held', flush=True); time.sleep(60)\n"
    )
    with subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE) as child:
        assert child.stdout is not None and child.stdout.readline() == b"held\n"
        with pytest.raises(StateDirError, match=f"in use by pid {child.pid} "):
            _lock(tmp_path, wait=0.2)
        child.send_signal(signal.SIGKILL)
        child.wait()
    _lock(tmp_path, wait=0).release()


def test_no_child_inherits_the_lock(tmp_path: pathlib.Path) -> None:
    """Guests and lane hosts are exec'd children: the descriptor is close-on-exec, so
    none of them keeps the folder locked after the daemon is gone."""
    held = _lock(tmp_path, wait=0)
    assert fcntl.fcntl(held.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    with subprocess.Popen(["sleep", "30"], close_fds=False) as child:
        try:
            links = [os.readlink(p) for p in pathlib.Path(f"/proc/{child.pid}/fd").iterdir()]
            assert str(tmp_path / LOCK_FILE) not in links
        finally:
            child.kill()
    held.release()


async def test_a_lock_file_that_is_a_symlink_or_not_a_file_is_refused(
    tmp_path: pathlib.Path,
) -> None:
    (tmp_path / LOCK_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StateDirError, match="is a symlink"):
        await lock_state_dir(tmp_path, wait=0)
    assert not (tmp_path / "elsewhere").exists()
    (tmp_path / LOCK_FILE).unlink()
    (tmp_path / LOCK_FILE).mkdir()
    with pytest.raises(StateDirError, match=r"cannot be opened|not a plain file"):
        await lock_state_dir(tmp_path, wait=0)
