"""litegraph-gate (`native/litegraph-gate.c`): a guest's first exec, and a pooled
sandbox's stage.

One small static binary does what a gate shell and setpriv did in two dynamically
linked execs: it holds the guest at its gate until the daemon has journaled the
start, then takes the guest's uid (no supplementary group, no capability in any set)
and execs bwrap. Inside a ready sandbox (`supervisor/sandbox_pool.py`) it is the
stage: it reads the guest's command, environment and tokens from its stdin and
runs the command. Inside every sandbox it is the guest's keeper, the sandbox's first
process, so an ending gives all the guest's processes their grace (`install_keeper`).

It is built by `make` (scripts/build-gate) next to the venv's Python. Where it is
missing or does not work here, guests start through the gate shell and setpriv, and
no sandbox is pooled.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from machine.journal_replay import write_aside
from supervisor.sandbox import STAGE_PATH

__all__ = [
    "GATE_NAME",
    "STAGE_PATH",
    "find_gate",
    "gate_argv",
    "install_keeper",
    "stage_argv",
    "stage_message",
]

GATE_NAME = "litegraph-gate"
_MAGIC = b"litegraph-stage-1"
_PROBE_SECONDS = 5.0


@functools.cache
def find_gate() -> Path | None:
    """The helper beside this Python (the venv's bin), once it ran here; else None."""
    candidate = Path(sys.executable).parent / GATE_NAME
    true = "/bin/true" if os.path.exists("/bin/true") else "/usr/bin/true"
    try:
        probe = subprocess.run(
            [str(candidate), "gate", "--", true],
            input=b"\n",
            capture_output=True,
            timeout=_PROBE_SECONDS,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return candidate if probe.returncode == 0 else None


def install_keeper(gate: Path, folder: Path) -> Path:
    """A copy of `gate` in `folder` (the run folder: the daemon's own, which guests may
    enter but not write), read-only and the daemon's: bubblewrap, run as the guest's uid,
    binds it as the guest's keeper, and a venv in a 0700 home is out of that uid's reach.
    Written aside and renamed over, so a guest starting meanwhile sees a whole file."""
    target = folder / GATE_NAME
    write_aside(target, gate.read_bytes(), mode=0o555)
    return target


def gate_argv(gate: Path, uid: int | None, *, keep_stdin: bool = False) -> list[str]:
    """The helper's command line up to `--`: wait for the gate's line, then (with `uid`)
    become it with no group and no capability; `keep_stdin` leaves fd 0 for a stage."""
    args = [str(gate), "gate"]
    if uid is not None:
        args += ["-u", str(uid)]
    if keep_stdin:
        args.append("-k")
    return [*args, "--"]


def stage_argv(token_file: str) -> list[str]:
    """What a pooled sandbox runs until its guest's command arrives."""
    return [STAGE_PATH, "stage", token_file]


def stage_message(argv: Sequence[str], env: Mapping[str, str], tokens: bytes) -> bytes:
    """The stage's input: NUL-terminated records, complete only with the last ".";
    a message cut short runs nothing (names and values hold no NUL: validated)."""
    records = [_MAGIC]
    if tokens:
        records.append(b"T" + tokens)
    records += [b"E" + f"{name}={value}".encode() for name, value in env.items()]
    records += [b"A" + arg.encode() for arg in argv]
    records.append(b".")
    return b"\0".join(records) + b"\0"
