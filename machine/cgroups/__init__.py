"""Per-invocation cgroups (v1 and v2): memory, CPU, pids and device limits the kernel enforces.

`Cgroups.detect()` finds what this host offers; `create` makes one
invocation's cgroup, which its child joins between fork and exec.
"""

from machine.cgroups.common import (
    CGROUP_NAME_RE,
    PREFIX,
    CgroupError,
    CgroupFs,
    CgroupKillFailed,
    CgroupLimits,
    CgroupsUnavailable,
    CgroupUsage,
    pool_cgroup_prefix,
)
from machine.cgroups.host import Cgroups, system_cgroups
from machine.cgroups.invocation import InvocationCgroup

__all__ = [
    "CGROUP_NAME_RE",
    "PREFIX",
    "CgroupError",
    "CgroupFs",
    "CgroupKillFailed",
    "CgroupLimits",
    "CgroupUsage",
    "Cgroups",
    "CgroupsUnavailable",
    "InvocationCgroup",
    "pool_cgroup_prefix",
    "system_cgroups",
]
