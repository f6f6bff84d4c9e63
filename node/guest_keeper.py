"""Where guests' sandboxes find litegraph-gate, their keeper (`supervisor/gate.py`):
bubblewrap runs as the guest's uid, so the gate must lie where that uid can reach it."""

from __future__ import annotations

import pathlib

from supervisor.gate import install_keeper

__all__ = ["KEEPERLESS_NOTE", "closed_to_others", "keeper_path"]

KEEPERLESS_NOTE = (
    "guests start without litegraph-gate's keeper ({why}): an ending's grace reaches "
    "their first process only, and no sandbox is made ahead"
)


def closed_to_others(path: pathlib.Path) -> bool:
    """Whether a folder above `path` does not let other uids through (a 0700 home)."""
    try:
        return any(not parent.stat().st_mode & 0o001 for parent in path.parents)
    except OSError:
        return True


def keeper_path(gate: pathlib.Path, run_dir: pathlib.Path) -> pathlib.Path:
    """The gate where guests' uids reach it: itself where they can, else its copy in
    the run folder (blocking: for a worker thread)."""
    if not closed_to_others(gate) and gate.stat().st_mode & 0o005 == 0o005:
        return gate
    return install_keeper(gate, run_dir)
