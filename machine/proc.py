"""What /proc says about a process: its group, session, state and start time.

A process is identified across pid reuse by (pid, start time). The start time
used is field 22 of /proc/<pid>/stat, `starttime`: clock ticks since boot. It
never moves, whereas a wall-clock start time (psutil's `create_time()`, boot
time + ticks) is recomputed from the clock on every read and shifts when the
clock is stepped.

The comm field (2) is the executable name in parentheses and may itself hold
spaces and ")" (a process can name itself anything): the fields after it are
found after the LAST ")", which no later field contains.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "PROC_ROOT",
    "ProcStat",
    "iter_stats",
    "parse_stat",
    "process_cgroups",
    "process_start_ticks",
    "read_stat",
]

PROC_ROOT = Path("/proc")
# Counted from field 3 (state), the first after comm: starttime is field 22.
_STATE, _PPID, _PGRP, _SESSION, _STARTTIME = 0, 1, 2, 3, 19


class ProcStat(NamedTuple):
    pid: int
    state: str  # "Z" zombie, "X" dead: neither holds anything any more
    ppid: int
    pgrp: int
    session: int
    start_ticks: int  # since boot, in sysconf(SC_CLK_TCK) units

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X")


def parse_stat(pid: int, data: bytes) -> ProcStat | None:
    """The fields of one /proc/<pid>/stat line; None if it is not one for `pid`."""
    head, paren, tail = data.rpartition(b")")
    if not paren or not head.startswith(b"%d (" % pid):
        return None
    fields = tail.split()
    if len(fields) <= _STARTTIME:
        return None
    try:
        return ProcStat(
            pid=pid,
            state=fields[_STATE].decode("ascii"),
            ppid=int(fields[_PPID]),
            pgrp=int(fields[_PGRP]),
            session=int(fields[_SESSION]),
            start_ticks=int(fields[_STARTTIME]),
        )
    except (UnicodeDecodeError, ValueError):
        return None


def read_stat(pid: int, proc_root: Path = PROC_ROOT) -> ProcStat | None:
    """None when there is no such process (or /proc cannot be read)."""
    if pid <= 0:
        return None  # /proc/0 does not exist; never read a negative "pid" as a path
    try:
        with open(proc_root / str(pid) / "stat", "rb") as stat:
            data = stat.read()
    except OSError:
        return None
    return parse_stat(pid, data)


def process_start_ticks(pid: int) -> int | None:
    """Boot-relative start time of `pid` in clock ticks; None if it does not exist.

    Read it while the process cannot be reaped yet (right after spawning our own
    child) so the pid cannot name another process meanwhile.
    """
    stat = read_stat(pid)
    return None if stat is None else stat.start_ticks


def iter_stats(proc_root: Path = PROC_ROOT) -> Iterator[ProcStat] | None:
    """Every process /proc lists (those that exit meanwhile are skipped); None if it
    cannot be listed."""
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return None
    return (
        stat
        for stat in (read_stat(int(e), proc_root) for e in entries if e.isdigit())
        if stat is not None
    )


def process_cgroups(pid: int, proc_root: Path = PROC_ROOT) -> list[str] | None:
    """The cgroup path of `pid` in every hierarchy (v2 and each v1 one), or None."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text()
    except (OSError, UnicodeDecodeError):
        return None
    # "hierarchy-id:controllers:path"; the path may itself hold ":".
    return [line.split(":", 2)[2] for line in text.splitlines() if line.count(":") >= 2]
