"""Guest identities: one unprivileged uid (and gid of the same number) per running invocation.

Two guests with different uids cannot read each other's /proc/<pid>/environ,
signal or ptrace each other, and neither can touch the daemon's 0700 state dir.
A uid goes back to the pool only once nothing runs under it any more (the
caller releases it after the invocation's processes are all gone); the pool
hands out uids round-robin so a just-released one is the last to come back.
"""

from __future__ import annotations

import ctypes
import os
import re

__all__ = [
    "UidPool",
    "UidRangeError",
    "UidsExhausted",
    "become",
    "can_switch_users",
    "drop_capabilities",
    "parse_uid_range",
]

_RANGE_RE = re.compile(r"(\d{1,10})-(\d{1,10})")
# Below this are system accounts; at and above 2**31 some tools misbehave.
MIN_GUEST_UID = 1000
MAX_GUEST_UID = 2**31 - 2
_CAP_SETGID = 6
_CAP_SETUID = 7


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


class UidPool:
    def __init__(self, uids: range) -> None:
        if not uids:
            raise UidRangeError("the guest uid range is empty")
        self._uids = uids
        self._in_use: set[int] = set()
        self._next = 0

    @property
    def in_use(self) -> frozenset[int]:
        return frozenset(self._in_use)

    def allocate(self) -> int:
        if len(self._in_use) >= len(self._uids):
            raise UidsExhausted(f"all {len(self._uids)} guest uids are in use")
        while True:
            uid = self._uids[self._next]
            self._next = (self._next + 1) % len(self._uids)
            if uid not in self._in_use:
                self._in_use.add(uid)
                return uid

    def release(self, uid: int) -> None:
        self._in_use.discard(uid)
