"""Which cgroup version this host offers, and the invocation cgroups made with it.

Detection is "can we really do it", never a guess: a pure v2 host has
cgroup.controllers at the root; otherwise the v1 hierarchies named in
/proc/self/cgroup must be real cgroup directories (a hybrid host's
/sys/fs/cgroup is a plain tmpfs) that we may write.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Collection
from pathlib import Path

from machine.cgroups.common import (
    CGROUP_NAME_RE,
    PREFIX,
    CgroupError,
    CgroupFs,
    CgroupLimits,
    CgroupsUnavailable,
)
from machine.cgroups.invocation import InvocationCgroup
from machine.cgroups.v1 import V1Backend, detect_v1
from machine.cgroups.v2 import V2Backend, detect_v2

__all__ = ["Cgroups", "parse_self_cgroup", "system_cgroups"]

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


def parse_self_cgroup(text: str) -> tuple[dict[str, tuple[str, str]], str | None]:
    """({v1 controller: (its mount's name, path)}, the v2 path or None)."""
    v1: dict[str, tuple[str, str]] = {}
    unified = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            unified = path
        for controller in controllers.split(","):
            if controller and not controller.startswith("name="):
                v1[controller] = (controllers, path)
    return v1, unified


class Cgroups:
    """Invocation cgroups on this host; build with `detect`."""

    def __init__(self, backend: V1Backend | V2Backend) -> None:
        self._backend = backend
        self.version = backend.version
        # v1 only: the devices controller enforces CgroupLimits.devices.
        self.restricts_devices = backend.restricts_devices

    @classmethod
    def detect(
        cls,
        root: Path = ROOT,
        self_cgroup: Path = SELF_CGROUP,
        *,
        fs: CgroupFs | None = None,
    ) -> Cgroups | CgroupsUnavailable:
        fs = fs or CgroupFs()
        try:
            v1, unified = parse_self_cgroup(self_cgroup.read_text())
        except OSError as exc:
            return CgroupsUnavailable(f"cannot read {self_cgroup}: {exc}")
        found: V1Backend | V2Backend | CgroupsUnavailable
        if (root / "cgroup.controllers").is_file() and unified is not None:
            found = detect_v2(root, unified, fs)
        elif "memory" in v1:
            found = detect_v1(root, v1, unified, fs)
        else:
            found = CgroupsUnavailable(f"no cgroup v2 at {root} and no cgroup v1 memory hierarchy")
        return found if isinstance(found, CgroupsUnavailable) else cls(found)

    def create(self, name: str, limits: CgroupLimits) -> InvocationCgroup:
        """Make `litegraph-<name>` with `limits`; CgroupError (nothing left behind) if not."""
        if not CGROUP_NAME_RE.fullmatch(name):
            raise CgroupError("invalid_name", f"{name!r}")
        return self._backend.create(name, limits)

    def leftovers(self) -> list[str]:
        """Names of the invocation cgroups present (after a crash: a dead daemon's)."""
        names: set[str] = set()
        for parent in set(self._backend.parents.values()):
            try:
                entries = list(parent.iterdir())
            except OSError as exc:
                log.warning("cgroup: cannot list %s: %s", parent, exc)
                continue
            for entry in entries:
                name = entry.name.removeprefix(PREFIX)
                if entry.name.startswith(PREFIX) and CGROUP_NAME_RE.fullmatch(name):
                    if entry.is_dir():
                        names.add(name)
        return sorted(names)

    def existing(self, name: str) -> InvocationCgroup:
        """The directories of `name` that exist now (for cleaning up after a crash)."""
        return self._backend.existing(name)

    async def remove_leftovers(self, only: Collection[str] | None = None) -> list[str]:
        """Kill what is in the leftovers (those in `only`, if given) and remove them.

        Returns the names removed; one that stays is logged by `remove`.
        """
        removed = []
        for name in self.leftovers():
            if only is not None and name not in only:
                continue
            if await self._backend.existing(name).remove():
                removed.append(name)
        if removed:
            log.warning(
                "cgroup: removed %d leftover invocation cgroup(s): %s", len(removed), removed
            )
        return removed

    def describe(self) -> str:
        parents = sorted({str(p) for p in self._backend.parents.values()})
        return f"cgroup {self.version} under {', '.join(parents)}"


@functools.cache
def system_cgroups() -> Cgroups | CgroupsUnavailable:
    """This host's cgroups, detected once (v2 detection may move the daemon into a leaf)."""
    found = Cgroups.detect()
    if isinstance(found, CgroupsUnavailable):
        log.warning("cgroups unavailable: %s", found.reason)
    else:
        log.info("limits enforced with %s", found.describe())
    return found
