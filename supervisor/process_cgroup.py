"""A guest's cgroup: made with its limits before the guest starts, watched for OOM
while it runs, emptied, read and removed after it.

Memory: a per-invocation cgroup (v1 or v2, `machine.cgroups`) when the host allows it;
otherwise RLIMIT_AS, but only for CPU-only work (CUDA reserves huge virtual
address ranges, so an address-space limit would break GPU work); otherwise
the limit is not enforced by the kernel and a warning is logged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Literal

import trio

from machine.cgroups import (
    CgroupError,
    CgroupKillFailed,
    CgroupLimits,
    Cgroups,
    CgroupUsage,
    InvocationCgroup,
    system_cgroups,
)
from machine.kept_thread import KeptThread
from supervisor.launch import Launch, plan
from supervisor.process_spec import ProcessSpec

__all__ = [
    "CGROUP_THREAD",
    "SYSTEM_CGROUPS",
    "ConfinementFailed",
    "end_cgroup",
    "memory_plan",
    "prepare_launch",
    "resolve_cgroups",
    "watch_oom",
]

# The name these lines have always been logged under: operators' filters keep matching.
log = logging.getLogger("supervisor.process")

# Every guest's cgroup work (mkdir, limits, usage, rmdir: blocking cgroupfs calls) runs
# on this one thread, in turn.
CGROUP_THREAD = KeptThread("litegraph-cgroups", idle_exit=None)

# run_process's default: this host's cgroups, detected on first use.
SYSTEM_CGROUPS: Literal["system"] = "system"
# Until CPU and pids limits are part of the spec: the whole machine, and the kernel's pid cap.
_NO_PIDS_LIMIT = 4_194_304


class ConfinementFailed(RuntimeError):
    """The guest's cgroup could not be made: it does not run without its limits."""


def resolve_cgroups(cgroups: Cgroups | Literal["system"] | None) -> Cgroups | None:
    if isinstance(cgroups, str):  # SYSTEM_CGROUPS
        found = system_cgroups()
        return found if isinstance(found, Cgroups) else None
    return cgroups


def _cgroup_limits(spec: ProcessSpec, memory_bytes: int) -> CgroupLimits:
    cpus = len(os.sched_getaffinity(0))
    # A sandboxed guest may open only its grant's device nodes (v1's devices controller).
    nodes = spec.sandbox.device_nodes if spec.sandbox is not None else None
    return CgroupLimits(
        memory_bytes=memory_bytes,
        cpu_millis=spec.cpu_millis or cpus * 1000,
        pids_max=spec.pids_max or _NO_PIDS_LIMIT,
        devices=None if nodes is None else tuple(str(node) for node in nodes),
    )


def memory_plan(
    spec: ProcessSpec, cgroups: Cgroups | None
) -> tuple[InvocationCgroup | None, int | None]:
    """(cgroup, RLIMIT_AS bytes) enforcing spec.memory_limit_bytes (and the other limits)."""
    limit = spec.memory_limit_bytes
    if limit is None:
        return None, None
    if cgroups is not None:
        limits = _cgroup_limits(spec, limit)
        try:
            return cgroups.create(spec.cgroup_name, limits), None
        except CgroupError as exc:
            # The node has cgroups: a guest without one would escape its CPU, pids
            # and device limits and the whole-cgroup kill. It does not run.
            raise ConfinementFailed(f"no cgroup for {spec.cgroup_name}: {exc}") from exc
    if spec.cpu_only:
        return None, limit
    log.warning(
        "memory limit of %d bytes for %s not enforced: no usable cgroup and "
        "RLIMIT_AS would break GPU work",
        limit,
        spec.cgroup_name,
    )
    return None, None


def prepare_launch(
    spec: ProcessSpec, cgroups: Cgroups | None, env: Mapping[str, str]
) -> tuple[InvocationCgroup | None, Launch]:
    """The cgroup (made here) and how the child starts; blocking, for the cgroup thread."""
    cgroup, rlimit_as = memory_plan(spec, cgroups)
    try:
        launch = plan(
            spec.argv,
            env=env,
            sandbox=spec.sandbox,
            uid=spec.uid,
            cgroup=cgroup,
            rlimit_as=rlimit_as,
            affinity=spec.cpu_affinity,
        )
    except BaseException:
        if cgroup is not None:
            cgroup.finish_if_empty()  # nothing joined it yet
        raise
    return cgroup, launch


async def watch_oom(cgroup: InvocationCgroup, scope: trio.CancelScope) -> None:
    with scope:
        await cgroup.kill_after_oom()


async def end_cgroup(
    cgroup: InvocationCgroup, name: str, on_usage: Callable[[CgroupUsage], None] | None
) -> bool:
    """Once the guest's group has ended: its usage to `on_usage`, then the cgroup
    removed, after killing whatever escaped the group. True when something in it
    survived SIGKILL (stuck in the kernel): the cgroup's word, which sees a sandboxed
    guest's processes in their own sessions too. Callers shield this."""
    # Usually nothing is left: usage and removal in one worker-thread call.
    finished = await CGROUP_THREAD.run(cgroup.finish_if_empty, shield=True)
    if finished is not None:
        usage, removed = finished
        if on_usage is not None and usage is not None:
            on_usage(usage)
        if not removed:
            await cgroup.remove()
        return False
    # What escaped the group (a setsid() grandchild) is still in the cgroup.
    stuck = False
    try:
        await cgroup.kill()
    except CgroupKillFailed as exc:
        log.error("%s: %s", name, exc)
        stuck = True
    except CgroupError as exc:
        log.error("%s: %s", name, exc)
    if on_usage is not None:
        try:
            on_usage(cgroup.usage())
        except CgroupError as exc:  # unread counters never keep the cgroup
            log.error("%s: no usage: %s", name, exc)
    if not await cgroup.remove():
        # Its own kill may have failed where the one above could not even be tried.
        try:
            stuck = stuck or bool(cgroup.pids())
        except CgroupError:
            pass  # its folders are gone: nothing can be left in them
    return stuck
