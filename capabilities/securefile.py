"""Reading and writing files that hold secrets, failing closed.

A secret file must be a regular file (not a symlink), owned by us, and not
readable or writable by group or others; otherwise `SecretFileError` says
which of these it broke. Writes are atomic (temp file, fsync, rename, fsync
of the folder) and never go through a symlink.
"""

from __future__ import annotations

import os
import pathlib
import secrets
import stat
from enum import StrEnum

__all__ = [
    "SecretFileError",
    "SecretFileProblem",
    "fsync_dir",
    "read_secret_file",
    "write_secret_file",
]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class SecretFileProblem(StrEnum):
    symlink = "symlink"
    not_regular = "not_regular"
    wrong_owner = "wrong_owner"
    loose_mode = "loose_mode"
    too_large = "too_large"
    unreadable = "unreadable"


class SecretFileError(Exception):
    """A secret file the daemon refuses to use (operator's fault, fix the file)."""

    def __init__(self, path: pathlib.Path, problem: SecretFileProblem, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.problem = problem


def _check(path: pathlib.Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise SecretFileError(path, SecretFileProblem.symlink, "is a symlink; refusing to follow")
    if not stat.S_ISREG(st.st_mode):
        raise SecretFileError(path, SecretFileProblem.not_regular, "is not a regular file")
    if st.st_uid != os.geteuid():
        raise SecretFileError(
            path, SecretFileProblem.wrong_owner, f"is owned by uid {st.st_uid}, not by us"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise SecretFileError(
            path,
            SecretFileProblem.loose_mode,
            f"has mode {mode:04o}; others could read it (chmod 600, and rotate if it leaked)",
        )


def read_secret_file(path: pathlib.Path, max_bytes: int = 64 * 1024) -> bytes:
    """The file's bytes, after checking what it is, who owns it and its mode."""
    try:
        checked = path.lstat()
        _check(path, checked)
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except SecretFileError:
        raise
    except OSError as exc:
        raise SecretFileError(path, SecretFileProblem.unreadable, str(exc)) from exc
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (checked.st_dev, checked.st_ino):
            raise SecretFileError(path, SecretFileProblem.unreadable, "changed while opened")
        _check(path, opened)  # the file we opened, not one swapped in since
        data = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise SecretFileError(path, SecretFileProblem.too_large, f"is over {max_bytes} bytes")
    return data


def fsync_dir(directory: pathlib.Path) -> None:
    """Make a rename or unlink in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_secret_file(path: pathlib.Path, data: bytes) -> None:
    """Write atomically with mode 0600; a crash leaves the old file or the new one."""
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
