"""Where an invocation's lane sessions run: in its own cgroup, so that the CPU, host
memory and processes its lane hosts spend are charged to it, within its own limits.

- A process invocation's sessions join its guest's cgroup, once the guest has one
  (a session asked for before that waits for it, bounded), while the guest runs:
  guest and hosts share one CPU quota, one memory limit, one pids limit, and the
  usage its status reports counts both. When the guest ends, its sessions end
  first (`guest_ending`), then its cgroup is read and removed; lane work asked for
  after that is refused (409 `invocation_not_running`).
- Any other invocation (a builtin) gets a cgroup for its lane work alone, made at
  its first session with its reservation's CPU and memory, shared by its sessions
  on every lane, and read (its status's `usage`) and removed when it ends
  (`release`).
- A standing hold's sessions (a Kubernetes claim's, `supervisor.standing_holds`) run
  in the node's own cgroup: its pods are charged in theirs, its buffers by the lane.
- Where the node has no cgroups (`GuestPolicy.cgroups` is None: an unprivileged
  daemon, or no usable hierarchy), sessions run uncharged, as its guests do.

A cgroup's limits are the invocation's: a host that exhausts its memory is
OOM-killed there (its session ends `out_of_memory`), and nobody else's work is in it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Mapping

import trio

from machine.cgroups import CgroupError, CgroupLimits, InvocationCgroup
from supervisor.guests import GuestPolicy
from supervisor.invocation import Invocation
from supervisor.lane_owner import LaneOwner
from supervisor.lane_session import CLOSE_SECONDS
from supervisor.lane_work import LaneWorkError
from supervisor.process_cgroup import CGROUP_THREAD, end_cgroup
from supervisor.wire import ProcessWork

__all__ = ["GUEST_WAIT_SECONDS", "HOST_MEMORY_BYTES", "LaneCharges"]

log = logging.getLogger(__name__)

# How long a process invocation's first lane work waits for its guest's cgroup.
GUEST_WAIT_SECONDS = 30.0
# What a lane host itself needs (the interpreter and NumPy: 31 MiB resident, measured),
# added to the invocation's memory limit for each lane it has a host on: its
# `memory_bytes` stay its own, what its kernels and buffers touch is charged on top.
HOST_MEMORY_BYTES = 64 * 2**20


@dataclasses.dataclass(eq=False)
class _Charge:
    cgroup: InvocationCgroup | None = None
    owned: bool = False  # made here for lane work alone (a builtin's): removed here
    ready: trio.Event = dataclasses.field(default_factory=trio.Event)
    over: bool = False  # its guest has ended: no new session joins its cgroup
    hosted: set[str] = dataclasses.field(default_factory=set)  # lanes its limit grew for


class LaneCharges:
    def __init__(
        self,
        live: Mapping[str, Invocation],
        owners: Mapping[str, LaneOwner],
        guests: Callable[[], GuestPolicy],
        holds: Mapping[str, object] | None = None,
    ) -> None:
        self._live = live  # the supervisor's own tables, read as they change
        self._holds: Mapping[str, object] = {} if holds is None else holds
        self._owners = owners
        self._guests = guests
        self._charges: dict[str, _Charge] = {}  # by live invocation

    def _charge(self, invocation_id: str) -> _Charge:
        charge = self._charges.get(invocation_id)
        if charge is None:
            charge = self._charges[invocation_id] = _Charge()
        return charge

    # -- a process invocation's guest -----------------------------------------------
    def guest_confined(self, invocation_id: str, cgroup: InvocationCgroup) -> None:
        """Its guest's cgroup is made: its lane sessions join it from now on."""
        charge = self._charge(invocation_id)
        charge.cgroup = cgroup
        charge.ready.set()

    async def guest_ending(self, inv: Invocation) -> None:
        """Its guest has exited: no session joins its cgroup any more, and those that
        did end now, before the cgroup is read and removed. Bounded; shielded by
        the caller."""
        charge = self._charge(inv.id)
        charge.over = True
        charge.ready.set()
        with trio.move_on_after(CLOSE_SECONDS + 1):
            await self.end_sessions(inv)

    def owners_holding(self, inv: Invocation) -> list[LaneOwner]:
        """The owners of its lanes where it has a session or holds a buffer."""
        owners = self._owners
        grants = inv.reservation.lanes if inv.reservation else ()
        return [
            owner
            for grant in grants
            if (owner := owners.get(grant.lane_id)) is not None and owner.holds(inv.id)
        ]

    async def end_sessions(self, inv: Invocation) -> None:
        """End its sessions on every lane, and with their hosts every buffer it held."""
        for owner in self.owners_holding(inv):
            await owner.free_invocation(inv.id)

    # -- what a lane owner asks ------------------------------------------------------
    async def place(self, lane_id: str, invocation_id: str) -> InvocationCgroup | None:
        """The cgroup the invocation's new lane session runs in (None: uncharged, the
        node has no cgroups), its limit grown by the host's own memory the first time
        for each lane; LaneWorkError when its work may not run anywhere."""
        cgroup = await self._cgroup_for(invocation_id)
        charge = self._charges.get(invocation_id)
        if cgroup is None or charge is None or lane_id in charge.hosted:
            return cgroup
        try:
            await CGROUP_THREAD.run(
                functools.partial(cgroup.grow_memory, HOST_MEMORY_BYTES), shield=True
            )
        except CgroupError as exc:
            log.error("%s: no room made for its lane host: %s", invocation_id, exc)
            raise LaneWorkError(503, "confinement_failed", "no room for its lane host") from None
        charge.hosted.add(lane_id)
        return cgroup

    async def _cgroup_for(self, invocation_id: str) -> InvocationCgroup | None:
        inv = self._live.get(invocation_id)
        if inv is None and invocation_id in self._holds:
            return None  # a standing hold's: the node's own (supervisor.standing_holds)
        if inv is None:
            raise LaneWorkError(409, "invocation_not_live", "the invocation has ended")
        policy = self._guests()
        cgroups = policy.cgroups
        if cgroups is None:
            return None
        charge = self._charge(invocation_id)
        if isinstance(inv.request.work, ProcessWork):
            with trio.move_on_after(GUEST_WAIT_SECONDS):
                await charge.ready.wait()
            if charge.over or charge.cgroup is None:
                raise LaneWorkError(
                    409,
                    "invocation_not_running",
                    "a process invocation's lane work runs while its process does",
                )
            return charge.cgroup
        if not charge.ready.is_set() and not charge.owned:
            charge.owned = True  # this caller makes it; others wait for it
            resources = inv.request.resources
            limits = CgroupLimits(
                memory_bytes=max(resources.memory_bytes, 1),
                cpu_millis=resources.cpu_millis or len(os.sched_getaffinity(0)) * 1000,
                pids_max=policy.pids_max,
            )
            try:
                charge.cgroup = await CGROUP_THREAD.run(
                    functools.partial(cgroups.create, invocation_id, limits), shield=True
                )
            except CgroupError as exc:
                log.error("%s: no cgroup for its lane work: %s", invocation_id, exc)
            finally:
                charge.ready.set()
        await charge.ready.wait()
        if charge.cgroup is None:  # fail closed: never an uncharged host beside a cgroup
            raise LaneWorkError(503, "confinement_failed", "no cgroup for its lane work")
        return charge.cgroup

    # -- its ending -----------------------------------------------------------------
    def holds(self, invocation_id: str) -> bool:
        """Whether its ending has a cgroup of ours to end (`release` must be awaited);
        otherwise `forget` is enough, and the ending stays on its fast path."""
        charge = self._charges.get(invocation_id)
        return charge is not None and charge.owned and charge.cgroup is not None

    def forget(self, invocation_id: str) -> None:
        """Its ending, with nothing to end here (a guest's cgroup is its process's)."""
        self._charges.pop(invocation_id, None)

    async def release(self, invocation_id: str) -> None:
        """After its sessions have ended: a cgroup made for its lane work alone is
        read (its usage, for its status) and removed. Callers shield this."""
        charge = self._charges.pop(invocation_id, None)
        if charge is None or not charge.owned or charge.cgroup is None:
            return  # a guest's cgroup is its process's to end
        inv = self._live.get(invocation_id)
        await end_cgroup(charge.cgroup, invocation_id, None if inv is None else inv.record_usage)
