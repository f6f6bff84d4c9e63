"""The supervisor's shared state: one object that all its collaborators read and write.

The invocation table (live, ended, and the journal's history), the lanes' owners,
the nursery, the run slots, the machine and token handles, and the settings
the collaborators read each live here, once: no collaborator keeps a copy.
`Shared` lets the `Supervisor` facade expose them as its own attributes.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar, overload

import trio

from capabilities import LaneValidator, TokenService
from machine import Machine
from supervisor.events import EventHub
from supervisor.guests import GuestPolicy
from supervisor.history import History
from supervisor.hold import Hold
from supervisor.invocation import Invocation
from supervisor.lane_charges import LaneCharges
from supervisor.lane_owner import LaneOwner
from supervisor.logstore import LogStore
from supervisor.sandbox_pool import SandboxPool
from supervisor.wire import InvocationState, NodeEvent

__all__ = ["Shared", "SupervisorState"]

T = TypeVar("T")


@dataclasses.dataclass(eq=False)
class SupervisorState:
    machine: Machine
    # Every invocation's stdout and stderr on disk; None keeps only the status's tail.
    logs: LogStore | None
    guests: GuestPolicy
    tokens: TokenService
    validator: LaneValidator
    events: EventHub[NodeEvent]
    node_url: str
    max_queued: int
    kill_grace: float
    # Set once the daemon must stop at once: guests' kill grace is cut short.
    hurry: trio.Event
    cleanup_deadline: float
    lane_work_deadline: float
    retain_ended: int
    on_change: Callable[[], None]
    slots: trio.Semaphore  # the run slots (`--max-running`)
    # Every ending the journal remembers (from before a restart too), for the list.
    history: History
    live: dict[str, Invocation] = dataclasses.field(default_factory=dict)
    # Standing holds (a Kubernetes claim's lanes), by subject (supervisor.standing_holds).
    holds: dict[str, Hold] = dataclasses.field(default_factory=dict)
    waiting: int = 0  # live invocations in `queued` (admitted or being admitted)
    ended: OrderedDict[str, Invocation] = dataclasses.field(default_factory=OrderedDict)
    # Invocations ended since start, by final state: only ever grows (unlike `ended`).
    ended_totals: dict[InvocationState, int] = dataclasses.field(default_factory=dict)
    accepting: bool = True
    # An operator's whole-node drain: kept in memory only (a restart forgets it).
    drained: bool = False
    nursery: trio.Nursery | None = None
    owners: dict[str, LaneOwner] = dataclasses.field(default_factory=dict)
    # Where lane sessions run (made by the facade over `live` and `owners`).
    charges: LaneCharges = dataclasses.field(init=False)
    # Sandboxes made ahead for cwd-less guests; None: none are (`--sandbox-pool 0`).
    pool: SandboxPool | None = None

    def __post_init__(self) -> None:
        self.charges = LaneCharges(self.live, self.owners, lambda: self.guests, self.holds)


class _HasState(Protocol):
    @property
    def _state(self) -> SupervisorState: ...


class Shared(Generic[T]):
    """An attribute of the facade that lives on its `SupervisorState` under the same
    name: read and written there, so a change is seen by every collaborator."""

    def __set_name__(self, owner: type[object], name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type[object]) -> Shared[T]: ...

    @overload
    def __get__(self, obj: _HasState, owner: type[object]) -> T: ...

    def __get__(self, obj: _HasState | None, owner: type[object]) -> T | Shared[T]:
        if obj is None:
            return self
        value: T = getattr(obj._state, self._name)
        return value

    def __set__(self, obj: _HasState, value: T) -> None:
        setattr(obj._state, self._name, value)
