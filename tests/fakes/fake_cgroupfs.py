"""A directory that imitates a cgroup v2 tree, for hosts whose kernel cannot be used.

New directories get the control files the kernel would make. Writes to
cgroup.subtree_control and cgroup.procs follow the kernel's rules that matter
here: enabling controllers in a cgroup that holds processes is refused with
EBUSY, and writing a pid moves it out of every other cgroup.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from machine.cgroups import CgroupFs
from machine.cgroups.common import write_control

CONTROL_FILES = {
    "cgroup.procs": "",
    "cgroup.kill": "",
    "cgroup.freeze": "0\n",
    "cgroup.events": "populated 0\nfrozen 0\n",
    "cgroup.controllers": "",
    "cgroup.subtree_control": "",
    "memory.max": "max\n",
    "memory.swap.max": "max\n",
    "memory.oom.group": "0\n",
    "memory.peak": "0\n",
    "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n",
    "cpu.max": "max 100000\n",
    "cpu.stat": "usage_usec 0\nuser_usec 0\nsystem_usec 0\n",
    "pids.max": "max\n",
    "pids.events": "max 0\n",
}


class FakeCgroupV2:
    def __init__(
        self,
        tmp_path: Path,
        *,
        own: str = "/daemon.service",
        controllers: str = "cpu io memory pids",
        subtree: str = "cpu memory pids",
        procs: str = "",
    ) -> None:
        self.root = tmp_path / "cgroup"
        self.own = self.root / own.lstrip("/")
        self.self_cgroup = tmp_path / "self-cgroup"
        self.self_cgroup.write_text(f"0::{own}\n")
        self.refused: set[str] = set()  # control file names whose writes fail
        self.root.mkdir()
        self._populate(self.root, controllers, subtree=controllers)
        self.own.mkdir(parents=True)
        self._populate(self.own, controllers, subtree=subtree)
        (self.own / "cgroup.procs").write_text(procs)
        self.fs = CgroupFs(mkdir=self.mkdir, rmdir=shutil.rmtree, write=self.write, join=False)

    def _populate(self, path: Path, controllers: str, *, subtree: str = "") -> None:
        for name, text in CONTROL_FILES.items():
            (path / name).write_text(text)
        (path / "cgroup.controllers").write_text(controllers + "\n")
        (path / "cgroup.subtree_control").write_text(subtree + "\n")

    def mkdir(self, path: Path) -> None:
        os.mkdir(path)
        self._populate(path, (path.parent / "cgroup.subtree_control").read_text().strip())

    def write(self, path: Path, text: str) -> None:
        if path.name in self.refused:
            raise PermissionError(errno.EACCES, "refused by the test", str(path))
        if path.name == "cgroup.subtree_control":
            cgroup = path.parent
            if cgroup != self.root and (cgroup / "cgroup.procs").read_text().split():
                raise OSError(errno.EBUSY, "no internal processes", str(path))
            available = (cgroup / "cgroup.controllers").read_text().split()
            enabled = set(path.read_text().split())
            enabled |= {t[1:] for t in text.split() if t.startswith("+") and t[1:] in available}
            path.write_text(" ".join(sorted(enabled)) + "\n")
        elif path.name == "cgroup.procs":
            for procs in self.root.rglob("cgroup.procs"):
                kept = [pid for pid in procs.read_text().split() if pid != text]
                procs.write_text("".join(f"{pid}\n" for pid in kept))
            with path.open("a") as out:
                out.write(f"{text}\n")
        else:
            write_control(path, text)
