"""What can be wrong with the journal's files, and the checks that find it.

Every file the journal keeps in the state folder (the journal, its mark, the
index of ended invocations) must be a regular file of ours, closed to others:
`check_safe` refuses anything else rather than use it.
"""

from __future__ import annotations

import enum
import logging
import os
import stat
from pathlib import Path

__all__ = [
    "JournalCorrupt",
    "JournalError",
    "JournalLost",
    "JournalUnsafe",
    "UnsafeReason",
    "check_loss",
    "check_safe",
]

log = logging.getLogger("machine.journal")


class JournalError(Exception):
    """Base of the journal's errors (local fault: the state dir is not usable)."""


class UnsafeReason(enum.StrEnum):
    SYMLINK = "symlink"
    NOT_REGULAR_FILE = "not_regular_file"
    WRONG_OWNER = "wrong_owner"
    OPEN_PERMISSIONS = "open_permissions"


class JournalUnsafe(JournalError):
    def __init__(self, reason: UnsafeReason, path: Path) -> None:
        self.reason = reason
        self.path = path
        super().__init__(f"{reason.value}: refusing journal at {path}")


class JournalCorrupt(JournalError):
    """The journal is damaged where a crash cannot damage it: nothing is dropped."""

    def __init__(self, path: Path, offset: int, problem: str) -> None:
        self.path = path
        self.offset = offset
        self.problem = problem
        super().__init__(
            f"journal {path} is corrupt at byte {offset} ({problem}); the file is left "
            "as it was: inspect it, or move it aside and start with --accept-journal-loss"
        )


class JournalLost(JournalError):
    """The journal holds fewer records than it acknowledged: something cut it."""

    def __init__(self, path: Path, held: int, mark: Path, acknowledged: int | None) -> None:
        self.path = path
        self.held = held
        self.mark = mark
        self.acknowledged = acknowledged
        said = "is unreadable" if acknowledged is None else f"says {acknowledged} were acknowledged"
        self.what = f"journal {path} holds {held} records, {mark} {said}"
        super().__init__(f"{self.what}; --accept-journal-loss to start anyway")


def check_loss(
    path: Path, held: int, mark: Path, acknowledged: int | None, *, accept: bool
) -> None:
    """Refuse a journal holding fewer records than its mark says it acknowledged."""
    if acknowledged is not None and held >= acknowledged:
        return
    lost = JournalLost(path, held, mark, acknowledged)
    if not accept:
        raise lost
    log.warning("%s: starting anyway (--accept-journal-loss); lost ids may run again", lost.what)


def check_safe(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise JournalUnsafe(UnsafeReason.SYMLINK, path)
    if not stat.S_ISREG(st.st_mode):
        raise JournalUnsafe(UnsafeReason.NOT_REGULAR_FILE, path)
    if st.st_uid != os.geteuid():
        raise JournalUnsafe(UnsafeReason.WRONG_OWNER, path)
    if st.st_mode & 0o077:
        raise JournalUnsafe(UnsafeReason.OPEN_PERMISSIONS, path)
