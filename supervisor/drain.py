"""Cordoning: an operator drains the whole node (in memory) or one lane (in the
ledger); drained, nothing new is admitted there and running work finishes."""

from __future__ import annotations

from supervisor.invocation import utc_now
from supervisor.state import SupervisorState
from supervisor.wire import EventKind, NodeEvent

__all__ = ["Drain"]


class Drain:
    def __init__(self, state: SupervisorState) -> None:
        self._state = state

    def drain_reason(self) -> str | None:
        """Why readiness is blocked while the node is drained (None when it is not)."""
        return "node_draining: drained by an operator; no new work" if self._state.drained else None

    def set_node_drained(self, drained: bool) -> None:
        """Cordon the whole node (no new admissions; running work finishes) or lift it.
        Idempotent: a repeat changes nothing and announces nothing."""
        state = self._state
        if drained == state.drained:
            return
        state.drained = drained
        state.events.publish(
            NodeEvent(
                kind=EventKind.node,
                at=utc_now(),
                to_state="drained" if drained else "resumed",
            )
        )
        state.on_change()

    def set_drained(self, lane_id: str, drained: bool) -> None:
        """Cordon a lane (no new admissions; running work finishes) or lift it."""
        state = self._state
        if drained:
            state.machine.ledger.drain(lane_id)
        else:
            state.machine.ledger.resume(lane_id)
        state.events.publish(
            NodeEvent(
                kind=EventKind.lane,
                at=utc_now(),
                lane_id=lane_id,
                to_state="drained" if drained else "resumed",
            )
        )
        state.on_change()
