"""The state folder: the daemon's own, private, and never reached through a symlink.

It holds the signing keys, the operator secrets and the journal, so a folder
that other users can write to (they could swap those files), one owned by
someone else, or a symlink (it could point into another user's folder) would
hand them over. The check runs before anything binds a port or writes a
file; a folder that is missing is created with mode 0700.
"""

from __future__ import annotations

import os
import pathlib
import stat

__all__ = ["StateDirError", "prepare_state_dir"]


class StateDirError(Exception):
    """The state folder is unsafe; the message says which rule it broke and the fix."""


def prepare_state_dir(path: pathlib.Path) -> None:
    """Create `path` (mode 0700) if it is missing; refuse it unless it is our own
    private folder. Only the last component is checked: parents such as a
    symlinked /var/lib are the system's business."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)  # whatever the umask said
    except FileExistsError:
        pass
    except OSError as exc:
        raise StateDirError(f"state folder {path} cannot be created: {exc.strerror}") from exc
    try:
        found = path.lstat()
    except OSError as exc:
        raise StateDirError(f"state folder {path} cannot be read: {exc.strerror}") from exc
    _check(path, found)


def _check(path: pathlib.Path, found: os.stat_result) -> None:
    where = f"state folder {path}"
    if stat.S_ISLNK(found.st_mode):
        raise StateDirError(
            f"{where} is a symlink: it could lead into another user's folder"
            " (give the real folder instead)"
        )
    if not stat.S_ISDIR(found.st_mode):
        raise StateDirError(f"{where} is not a folder")
    if found.st_uid != os.geteuid():
        raise StateDirError(
            f"{where} is owned by uid {found.st_uid}, not by this daemon (uid {os.geteuid()}):"
            " its owner could read or replace its keys and secrets"
        )
    mode = stat.S_IMODE(found.st_mode)
    if mode & 0o077:
        raise StateDirError(
            f"{where} has mode {mode:04o}: other users could read or replace its keys and"
            " secrets (chmod 700 it)"
        )
