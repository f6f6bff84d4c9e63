"""The invocation lifecycle as data: one transition table, no I/O.

    queued --start--> running --succeed--> succeeded
       |                 |-----fail------> failed
       |                 |-----cancel----> cancelled
       |                 '-----timeout---> timed_out
       '--cancel / timeout / fail--> (the same terminal states)

`rejected` is never stored: admission refuses before an invocation exists,
and the refusal is announced as an event with that state.
"""

from __future__ import annotations

from enum import StrEnum

from supervisor.wire import InvocationState

__all__ = ["TERMINAL", "Ending", "IllegalTransition", "next_state"]


class Ending(StrEnum):
    """What happened to an invocation; the table maps it to the next state."""

    start = "start"
    succeed = "succeed"
    fail = "fail"
    cancel = "cancel"
    timeout = "timeout"


S = InvocationState
TRANSITIONS: dict[tuple[InvocationState, Ending], InvocationState] = {
    (S.queued, Ending.start): S.running,
    (S.queued, Ending.fail): S.failed,
    (S.queued, Ending.cancel): S.cancelled,
    (S.queued, Ending.timeout): S.timed_out,
    (S.running, Ending.succeed): S.succeeded,
    (S.running, Ending.fail): S.failed,
    (S.running, Ending.cancel): S.cancelled,
    (S.running, Ending.timeout): S.timed_out,
}
TERMINAL = frozenset({S.succeeded, S.failed, S.cancelled, S.timed_out, S.rejected})


class IllegalTransition(Exception):
    """A bug in the supervisor: the table has no such edge (local fault)."""


def next_state(current: InvocationState, ending: Ending) -> InvocationState:
    try:
        return TRANSITIONS[(current, ending)]
    except KeyError:
        raise IllegalTransition(f"{ending} is not allowed from {current}") from None
