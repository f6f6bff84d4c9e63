"""Health coupling: work on a failed device, a faulted lane or a failed lane host is
cancelled, a faulted lane is shown unhealthy (with why) until it recovers, and the
lane hosts that keep the node from being ready are named."""

from __future__ import annotations

from collections.abc import Iterable

from machine.health import HealthState, HealthTransition
from supervisor.invocation import utc_now
from supervisor.lane_owner import CUDA_UNAVAILABLE
from supervisor.state import SupervisorState
from supervisor.wire import EventKind, NodeEvent

__all__ = ["FAILED_STATES", "HealthCoupling"]

FAILED_STATES = frozenset({HealthState.UNHEALTHY, HealthState.LOST})
_PROBLEM_CHARS = 200  # of a restarting host's last failure, per lane, in /readyz
_HOST = "lane_host"  # the ledger's cause for a lane whose host failed too often
_STUCK = "process_stuck: a process that survived SIGKILL holds the lane"


class HealthCoupling:
    def __init__(self, state: SupervisorState) -> None:
        self._state = state

    def on_health(self, event: HealthTransition) -> None:
        """Health coupling: work on a failed device is cancelled with `lane_unhealthy`."""
        state = self._state
        if event.to_state in FAILED_STATES:
            for inv in list(state.live.values()):
                if inv.reservation and any(
                    event.device_id in (g.device_id, g.visible_uuid)  # a GPU, or a MIG instance
                    for g in inv.reservation.lanes
                ):
                    inv.cancel("lane_unhealthy")
        state.events.publish(
            NodeEvent(
                kind=EventKind.health,
                at=utc_now(),
                device_id=event.device_id,
                from_state=event.from_state.value,
                to_state=event.to_state.value,
                reasons=list(event.reasons),
            )
        )
        state.on_change()

    def lane_faulted(self, lane_id: str, reason: str = _STUCK, *, cause: str = "process") -> None:
        """A GPU lane that cannot be trusted (a process that survived SIGKILL holds
        it): unhealthy with `reason`, out of allocatable, its work cancelled."""
        self._fault(lane_id, reason, cause=cause, allocatable=False)

    def lane_host_faulted(self, lane_id: str, reason: str) -> None:
        """A lane's host failed too often: the lane is unhealthy, with `reason`, in the
        snapshot until it recovers. A GPU lane leaves allocatable and its work is
        cancelled; the CPU pool's processes and builtins never use its host, so
        they go on (and the pool stays allocatable for them): only its lane work
        is out. A device lane whose hosts cannot run CUDA (`cuda_unavailable: ...`)
        is like the pool: its device is healthy and processes that bring their own
        CUDA run there, so only its lane work is out (never run on the CPU)."""
        lane = self._state.machine.ledger.lane(lane_id)
        gpu = lane is not None and lane.is_gpu
        no_cuda = reason.startswith(f"{CUDA_UNAVAILABLE}:")
        self._fault(lane_id, reason, cause=_HOST, allocatable=not gpu or no_cuda)

    def _fault(self, lane_id: str, reason: str, *, cause: str, allocatable: bool) -> None:
        state = self._state
        state.machine.ledger.fault_lane(lane_id, reason, cause=cause, allocatable=allocatable)
        if not allocatable:
            for inv in list(state.live.values()):
                if inv.reservation and any(g.lane_id == lane_id for g in inv.reservation.lanes):
                    inv.cancel("lane_unhealthy")
        self._lane_event(lane_id, "unhealthy", reasons=[reason])

    def lane_recovered(self, lane_id: str) -> None:
        """A faulted lane's probe started a host that answered: back in service, with
        its device's health (`healthy` unless the device itself is not, or another
        fault of the lane's own, a stuck process, still holds it)."""
        ledger = self._state.machine.ledger
        ledger.clear_lane_fault(lane_id, _HOST)
        self._lane_event(lane_id, ledger.lane_health_shown(lane_id).value, from_state="unhealthy")

    def _lane_event(
        self,
        lane_id: str,
        to_state: str,
        *,
        from_state: str | None = None,
        reasons: Iterable[str] = (),
    ) -> None:
        self._state.events.publish(
            NodeEvent(
                kind=EventKind.lane,
                at=utc_now(),
                lane_id=lane_id,
                from_state=from_state,
                to_state=to_state,
                reasons=list(reasons),
            )
        )
        self._state.on_change()

    def lane_session_failed(self, lane_id: str, invocation_id: str, reason: str) -> None:
        """An invocation's own lane session failed (`kernel_timeout`, `lane_session_failed`):
        its buffers went with its host, so it ends with that reason; nobody else does."""
        inv = self._state.live.get(invocation_id)
        if inv is not None:
            inv.cancel(reason)

    def lane_hosts_problem(self) -> str | None:
        """Lanes whose host has not answered its hello yet, or not again since it
        failed: the node is not ready while one is on its way (for /readyz)."""
        waiting = [
            f"{lane_id} ({owner.host_status}{': ' if owner.host_problem else ''}"
            f"{owner.host_problem[:_PROBLEM_CHARS]})"
            for lane_id, owner in sorted(self._state.owners.items())
            if owner.host_status in ("starting", "restarting")
        ]
        return "waiting for lane hosts: " + "; ".join(waiting) if waiting else None

    def faulted_lanes(self) -> str | None:
        """Lanes whose host failed too often and are out of service until a probe
        brings them back (a note: the other lanes still serve)."""
        owners = self._state.owners
        faulted = sorted(
            lane_id
            for lane_id, owner in owners.items()
            if owner.faulted and not owner.cuda_unavailable
        )
        return "lane hosts failed too often: " + ", ".join(faulted) if faulted else None

    def cuda_unavailable_lanes(self) -> str | None:
        """Device lanes whose hosts cannot run CUDA, each with why (a note for /readyz:
        their lane work is refused, never run on the CPU; the rest of the node serves)."""
        lanes = [
            f"{lane_id} ({owner.fault_reason[:_PROBLEM_CHARS]})"
            for lane_id, owner in sorted(self._state.owners.items())
            if owner.faulted and owner.cuda_unavailable
        ]
        return f"{CUDA_UNAVAILABLE}: " + "; ".join(lanes) if lanes else None
