"""Answers about invocations: one's status, the list and its pages, the counts.

Live ones and those ended since the start come from the table; older endings
from the journal (one by id) or its decoded history (for the list).
"""

from __future__ import annotations

import functools

import trio

from supervisor.listing import Listed, ListQuery, page
from supervisor.remembered import recorded_status
from supervisor.state import SupervisorState
from supervisor.wire import InvocationList, InvocationState, InvocationStatus

__all__ = ["Lookup", "UnknownInvocation"]


class UnknownInvocation(KeyError):
    pass


def _same(status: InvocationStatus) -> InvocationStatus:
    return status


class Lookup:
    def __init__(self, state: SupervisorState) -> None:
        self._state = state

    def get(self, invocation_id: str) -> InvocationStatus:
        state = self._state
        inv = state.live.get(invocation_id) or state.ended.get(invocation_id)
        if inv is not None:
            return inv.status()
        record = state.machine.ended_invocation(invocation_id)
        if record is None:
            raise UnknownInvocation(invocation_id)
        return recorded_status(record)  # ended before a restart (or long ago)

    def until_ended(self, invocation_id: str) -> trio.Event | None:
        """Set once the invocation has ended and released everything; None when it is not
        live (already ended, or unknown)."""
        inv = self._state.live.get(invocation_id)
        return None if inv is None else inv.finished

    def statuses(self) -> list[InvocationStatus]:
        state = self._state
        return [inv.status() for inv in (*state.live.values(), *state.ended.values())]

    def list_page(self, query: ListQuery) -> InvocationList:
        """One page of the invocations `get` answers for, newest first (see listing.py):
        live ones, those ended since the start, and those the journal remembers."""
        state = self._state
        here = (*state.live.values(), *state.ended.values())
        known = {inv.id for inv in here}
        listed = [
            Listed((inv.submitted_at, inv.id), inv.state, inv.status, inv.request.labels)
            for inv in here
        ]
        listed.extend(
            Listed(
                (status.submitted_at, status.id),
                status.state,
                functools.partial(_same, status),
                status.labels,
            )
            for status in state.history.statuses()
            if status.id not in known
        )
        return page(listed, query)

    def ended_totals(self) -> dict[InvocationState, int]:
        """How many invocations ended since start, by final state (never decreases)."""
        return dict(self._state.ended_totals)

    def counts(self) -> dict[InvocationState, int]:
        state = self._state
        counts = dict.fromkeys(InvocationState, 0)
        for inv in (*state.live.values(), *state.ended.values()):
            counts[inv.state] += 1
        return counts
