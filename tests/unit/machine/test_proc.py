"""/proc/<pid>/stat parsing: the start time that identifies a process across pid reuse."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil  # type: ignore[import-untyped,unused-ignore]

from machine.proc import (
    ProcStat,
    parse_stat,
    process_cgroups,
    process_start_ticks,
    read_stat,
)

# comm may hold spaces and ")" - here it looks like the start of other fields.
TRICKY_COMM = b"a) R 1 1 1 (b"


def test_parse_stat_reads_the_fields_after_the_last_paren() -> None:
    line = b"42 (" + TRICKY_COMM + b") S 7 42 42 0 -1 4194560 " + b"0 " * 12 + b"987654 1 2\n"
    assert parse_stat(42, line) == ProcStat(
        pid=42, state="S", ppid=7, pgrp=42, session=42, start_ticks=987654
    )


def test_parse_stat_refuses_what_is_not_a_stat_line_for_that_pid() -> None:
    good = b"42 (x) S 7 42 42 0 -1 4194560 " + b"0 " * 12 + b"987654\n"
    assert parse_stat(42, good) is not None
    assert parse_stat(43, good) is None  # another process's line
    assert parse_stat(42, b"42 (x) S 7 42 42\n") is None  # cut short
    assert parse_stat(42, b"42 x S 7 42 42 0 -1 4194560 " + b"0 " * 12 + b"9\n") is None
    assert parse_stat(42, good.replace(b"987654", b"9x")) is None
    assert read_stat(0) is None and read_stat(-1) is None


def test_start_ticks_of_a_process_named_to_confuse_the_parser() -> None:
    # The child renames itself (prctl PR_SET_NAME) and then waits for us.
    script = (
        "import ctypes, sys\n"
        f"ctypes.CDLL(None).prctl(15, {TRICKY_COMM!r}, 0, 0, 0)\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        assert psutil.Process(child.pid).name() == TRICKY_COMM.decode()
        stat = read_stat(child.pid)
        assert stat is not None
        assert (stat.pgrp, stat.session, stat.ppid) == (child.pid, child.pid, os.getpid())
        ticks = process_start_ticks(child.pid)
        assert ticks == stat.start_ticks
        # The same instant psutil reports as wall-clock seconds (boot time + ticks).
        clock = os.sysconf("SC_CLK_TCK")
        assert abs(psutil.boot_time() + ticks / clock - psutil.Process(child.pid).create_time()) < 1
    finally:
        child.kill()
        child.communicate()
    assert process_start_ticks(child.pid) is None  # reaped: no such process


def test_cgroups_of_every_hierarchy_are_read(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(
        "4:memory:/daemon/litegraph-inv\n1:name=systemd:/odd:path\n0::/\n"
    )
    assert process_cgroups(42, tmp_path) == ["/daemon/litegraph-inv", "/odd:path", "/"]
    assert process_cgroups(43, tmp_path) is None
    assert process_cgroups(os.getpid()) is not None
