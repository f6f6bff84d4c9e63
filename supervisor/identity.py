"""Guest identities: one unprivileged uid (and gid of the same number) per running invocation.

Two guests with different uids cannot read each other's /proc/<pid>/environ,
signal or ptrace each other, and neither can touch the daemon's 0700 state dir.
A uid goes back to the pool only once nothing runs under it any more (the
caller releases it after the invocation's processes are all gone; one whose
process survived SIGKILL is never released). The pool hands out uids
round-robin so a just-released one is the last to come back, and the round
survives restarts (`UidCursor`, a file in the state folder): what a tenant left
under its uid meets no new tenant before the whole range has gone round. At
start-up, a uid under which a process still runs is held back (`running_uids`).
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Iterable
from pathlib import Path

from capabilities.securefile import SecretFileError, read_secret_file, write_secret_file

__all__ = [
    "UID_CURSOR_FILENAME",
    "UidCursor",
    "UidCursorError",
    "UidPool",
    "UidRangeError",
    "UidsExhausted",
    "become",
    "can_switch_users",
    "drop_capabilities",
    "parse_uid_range",
    "running_uids",
]

_RANGE_RE = re.compile(r"(\d{1,10})-(\d{1,10})")
# Below this are system accounts; at and above 2**31 some tools misbehave.
MIN_GUEST_UID = 1000
MAX_GUEST_UID = 2**31 - 2
_CAP_SETGID = 6
_CAP_SETUID = 7
UID_CURSOR_FILENAME = "guest-uid-cursor"
# The most uids a restart skips (the saved point runs this far ahead of the round,
# so the file is written once per this many turns): a 64th of the range, at most 256.
_MAX_LEASE = 256


_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


# Made before any fork: the child only makes the call.
_capset = ctypes.CDLL(None, use_errno=True).capset
_NO_CAPS_HEADER = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
_NO_CAPS = (_CapData * 2)()


class UidRangeError(ValueError):
    """The configured range is malformed or unsafe."""


class UidsExhausted(RuntimeError):
    """Every uid of the range belongs to a running invocation."""


class UidCursorError(ValueError):
    """The saved cursor is not a 0600 file of the daemon's holding one uid."""


def parse_uid_range(text: str, *, daemon_uid: int | None = None) -> range:
    """`LOW-HIGH` (inclusive) -> range; refuses system uids and the daemon's own uid."""
    match = _RANGE_RE.fullmatch(text.strip())
    if match is None:
        raise UidRangeError(f"{text!r} is not LOW-HIGH (for example 200000-265535)")
    low, high = int(match.group(1)), int(match.group(2))
    if not MIN_GUEST_UID <= low <= high <= MAX_GUEST_UID:
        raise UidRangeError(f"must lie within {MIN_GUEST_UID}-{MAX_GUEST_UID} with LOW <= HIGH")
    uid = os.geteuid() if daemon_uid is None else daemon_uid
    if low <= uid <= high:
        raise UidRangeError(f"contains the daemon's own uid {uid}")
    return range(low, high + 1)


def can_switch_users() -> bool:
    """Root, or holding CAP_SETUID and CAP_SETGID (a systemd unit's ambient capabilities)."""
    if os.geteuid() == 0:
        return True
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            line = next((row for row in status if row.startswith("CapEff:")), "CapEff:\t0")
    except OSError:
        return False
    effective = int(line.split()[1], 16)
    return bool(effective >> _CAP_SETUID & 1 and effective >> _CAP_SETGID & 1)


def become(uid: int) -> None:
    """Take `uid` (and the gid of the same number), with no supplementary groups
    and no capability.

    For a forked child before exec: plain syscalls only; gid before uid, since
    a process that gave up root can no longer change its groups. Leaving root
    clears capabilities by itself, but a daemon that is not root and holds
    ambient ones (systemd's User= with AmbientCapabilities=) keeps them across
    a switch between two other uids and across exec: the guest would get
    CAP_SETUID. So every set is emptied (the ambient set with them).
    """
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    drop_capabilities()


def drop_capabilities() -> None:
    """Empty every capability set of this process (for a forked child before exec)."""
    if _capset(ctypes.byref(_NO_CAPS_HEADER), _NO_CAPS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capset: {os.strerror(err)}")


class UidCursor:
    """Where the pool's round stands, kept across restarts: one uid in a 0600 file
    of the daemon's, replaced whole (temp file, fsync, rename, fsync of the folder)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> int | None:
        """The saved uid; None when none was saved. Raises UidCursorError."""
        try:
            text = read_secret_file(self.path, max_bytes=32).decode("ascii", errors="replace")
        except SecretFileError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return None
            raise UidCursorError(str(exc)) from exc
        if not text.strip().isdigit():
            raise UidCursorError(f"{self.path}: holds {text.strip()!r}, not a uid")
        return int(text)

    def save(self, uid: int) -> None:
        write_secret_file(self.path, f"{uid}\n".encode("ascii"))


def running_uids(uids: range, proc_root: Path = Path("/proc")) -> set[int]:
    """The uids of `uids` that some live process runs under (real, effective, saved or
    filesystem uid): a guest that survived SIGKILL, or its daemon. A zombie is dead
    (it holds nothing, an init that is slow to reap it keeps it)."""
    found: set[int] = set()
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(proc_root / entry / "status", encoding="ascii", errors="replace") as status:
                fields = dict(row.partition(":")[::2] for row in status)
        except OSError:  # gone meanwhile
            continue
        if fields.get("State", "").split()[:1] in (["Z"], ["X"]):
            continue
        found.update(uid for uid in map(int, fields.get("Uid", "").split()) if uid in uids)
    return found


class UidPool:
    """Distinct uids for running guests, round-robin over `uids`.

    With a `cursor`, the round goes on across restarts: before it moves past the
    point last saved, the pool saves a point `lease` turns ahead, so a restart
    resumes past every uid handed out (skipping at most `lease`), never at the
    bottom of the range. `held`: uids never handed out (processes still run under
    them). A failed save (OSError) hands out nothing.
    """

    def __init__(
        self, uids: range, *, cursor: UidCursor | None = None, held: Iterable[int] = ()
    ) -> None:
        if not uids:
            raise UidRangeError("the guest uid range is empty")
        self._uids = uids
        self._in_use = {uid for uid in held if uid in uids}
        self._cursor = cursor
        saved = None if cursor is None else cursor.load()
        # A range changed since the save: start again at its bottom.
        self._next = uids.index(saved) if saved is not None and saved in uids else 0
        self.lease = max(1, min(_MAX_LEASE, len(uids) // 64))
        self._covered = 0  # turns the saved point still covers

    @property
    def any_guest(self) -> int:
        """A uid of the range, to judge at admission what a guest's uid may reach
        (through the permissions every other user has: no guest owns the folders)."""
        return self._uids[0]

    @property
    def in_use(self) -> frozenset[int]:
        return frozenset(self._in_use)

    @property
    def available(self) -> int:
        """How many uids no guest holds now."""
        return len(self._uids) - len(self._in_use)

    def allocate(self) -> int:
        if len(self._in_use) >= len(self._uids):
            raise UidsExhausted(f"all {len(self._uids)} guest uids are in use")
        while True:
            if self._cursor is not None and self._covered == 0:
                self._cursor.save(self._uids[(self._next + self.lease) % len(self._uids)])
                self._covered = self.lease
            uid = self._uids[self._next]
            self._next = (self._next + 1) % len(self._uids)
            if self._cursor is not None:
                self._covered -= 1
            if uid not in self._in_use:
                self._in_use.add(uid)
                return uid

    def release(self, uid: int) -> None:
        self._in_use.discard(uid)
