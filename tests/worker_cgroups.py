"""Under pytest-xdist each worker runs in cgroups of its own.

A daemon makes its invocations' cgroups beside each other in its own cgroup,
named by invocation id. Two workers' daemons would otherwise share that parent,
and two tests that both run an invocation called `long` at once would collide.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from machine.cgroups.common import CgroupsUnavailable
from machine.cgroups.host import Cgroups


def _own_cgroup_dirs() -> list[Path]:
    found = Cgroups.detect()
    if isinstance(found, CgroupsUnavailable):
        return []
    return sorted(set(found._backend.parents.values()))  # every hierarchy the daemon uses


@contextlib.contextmanager
def own_cgroups(name: str) -> Iterator[list[Path]]:
    """Move this process into `<its cgroup>/<name>` in every hierarchy a daemon uses, and
    back out at the end; children started meanwhile inherit them."""
    moved: list[tuple[Path, Path]] = []
    try:
        for parent in _own_cgroup_dirs():
            child = parent / name
            child.mkdir(exist_ok=True)
            (child / "cgroup.procs").write_text(str(os.getpid()))
            moved.append((parent, child))
        yield [child for _, child in moved]
    finally:
        for parent, child in moved:
            with contextlib.suppress(OSError):
                (parent / "cgroup.procs").write_text(str(os.getpid()))
            with contextlib.suppress(OSError):
                child.rmdir()  # a test's leftovers keep it; the next run reuses the name
