"""Shared rig for the supervisor tests: a sim Machine, tokens, events and a running
Supervisor, plus the checks every ending must pass (ledger back to baseline, tokens
revoked, release journaled, no process left)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil  # type: ignore[import-untyped,unused-ignore]
import trio
import trio.lowlevel
import trio.testing

from capabilities import KeyRing, LaneOp, TokenRefusal, TokenRefused, TokenService
from machine import Machine
from machine.health import HealthTransition
from machine.inventory import CpuInfo, MemoryInfo
from machine.journal import Journal, JournalError
from machine.lanes import Isolation, Lane, LaneKind, Requirement
from machine.ledger import CapacityView
from supervisor.core import Supervisor
from supervisor.events import Dropped, EventHub
from supervisor.lane_owner import LaneOwner
from supervisor.lane_work import LaneDevice
from supervisor.wire import (
    BuiltinWork,
    EventKind,
    InvocationRequest,
    InvocationState,
    NodeEvent,
    ProcessWork,
    Resources,
    SubmitResponse,
)
from tests.lane_doubles import InProcessHost, InProcessHosts

T = TypeVar("T")
NODE = "n1"
WAIT_SECONDS = 15.0  # real-time bound of the polling waits
GiB = 2**30
TERMINAL = frozenset(
    {
        InvocationState.succeeded,
        InvocationState.failed,
        InvocationState.cancelled,
        InvocationState.timed_out,
    }
)
SIM_GPU = "GPU-5e1d0a3c-0000-4000-8000-5157a0000001"
SIM_MIG_GPU = "GPU-5e1d0a3c-0000-4000-8000-5157a0000002"


class InlineJournalMachine(Machine):
    """Writes the same journal records, on the event-loop thread instead of a worker.

    Only for runs under a frozen MockClock (the hypothesis state machine): with no
    thread in flight, `wait_all_tasks_blocked` means "everything settled"."""

    async def _journal(self, write: Callable[[], T]) -> T:
        await trio.lowlevel.checkpoint()
        return write()


class FaultyJournalMachine(Machine):
    """The real machine, but journal writes can be held at a gate or made to fail
    (a full disk, a dead state dir): a test double for the journal's failure paths."""

    gate: trio.Event | None = None
    fail: bool = False
    writes_waiting: int = 0

    async def _journal(self, write: Callable[[], T]) -> T:
        if self.gate is not None:
            self.writes_waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.writes_waiting -= 1
        if self.fail:
            await trio.lowlevel.checkpoint()
            raise JournalError("injected journal failure")
        return await super()._journal(write)


# A host with room for the sim workstation's 48 GiB of VRAM, whatever machine runs
# the tests: its lanes keep their declared sizes (machine/sim_vram.py caps them).
ROOMY_HOST = (
    CpuInfo(logical_cores=16, physical_cores=8, model="test", numa_nodes=1, capacity_millis=16000),
    MemoryInfo(total_bytes=128 * GiB, available_bytes=128 * GiB, capacity_bytes=128 * GiB),
)


async def open_machine(state_dir: Path, *, cls: type[Machine] = Machine, **kw: Any) -> Machine:
    return await cls.open(
        node_id=NODE,
        devices="sim",
        sim_file=None,
        state_dir=state_dir,
        reserved_cpu_millis=0,
        reserved_memory_bytes=0,
        vram_headroom_bytes=0,
        **{"host": ROOMY_HOST, **kw},
    )


@dataclass
class Rig:
    machine: Machine
    keyring: KeyRing
    tokens: TokenService
    events: EventHub[NodeEvent]
    sup: Supervisor
    state_dir: Path
    baseline: CapacityView
    transitions: list[HealthTransition] = field(default_factory=list)
    # Every event published since the rig opened (a collector task drains the hub).
    seen: list[NodeEvent] = field(default_factory=list)
    hosts: Callable[[Lane], LaneDevice] | None = None

    def invocation_events(self, invocation_id: str) -> list[InvocationState]:
        return [
            e.invocation.state
            for e in self.seen
            if e.kind is EventKind.invocation
            and e.invocation is not None
            and e.invocation.id == invocation_id
        ]

    def lane_events(self, lane_id: str) -> list[str | None]:
        """The `to_state` of every event published about this lane, in order."""
        return [e.to_state for e in self.seen if e.lane_id == lane_id]

    @property
    def in_process_hosts(self) -> InProcessHosts:
        """The rig's default lane hosts (only when `open_rig` was given none of its own)."""
        assert isinstance(self.hosts, InProcessHosts)
        return self.hosts

    async def fault_lane(self, lane_id: str) -> LaneOwner:
        """The lane's sentinel host exits six times in a row, idle: past the default limit
        of five restarts a minute, the lane faults."""
        owner = self.sup.owners[lane_id]
        for _ in range(6):
            sentinel = owner.sentinel
            if owner.faulted:  # hosts that fail to start get there sooner
                break
            if isinstance(sentinel, InProcessHost):
                sentinel.die()
            await trio.testing.wait_all_tasks_blocked()
        assert owner.faulted and owner.host_status == "faulted"
        return owner

    # -- lanes ---------------------------------------------------------------------
    def lane_ids(self, kind: LaneKind) -> list[str]:
        return sorted(lane.lane_id for lane in self.machine.ledger.lanes() if lane.kind is kind)

    @property
    def cpu_lane(self) -> str:
        return self.lane_ids(LaneKind.CPU)[0]

    @property
    def gpu_lane(self) -> str:
        return self.lane_ids(LaneKind.GPU)[0]

    # -- checks --------------------------------------------------------------------
    def assert_baseline(self) -> None:
        assert len(self.machine.ledger) == 0
        assert self.machine.ledger.capacity() == self.baseline

    def assert_revoked(self, tokens: dict[str, str]) -> None:
        assert tokens, "the invocation was given no token"
        for lane_id, token in tokens.items():
            lane = self.machine.ledger.lane(lane_id)
            assert lane is not None
            op = LaneOp.EXECUTE
            try:
                self.sup.validator.validate(token, lane_id=lane_id, op=op)
            except TokenRefused as refused:
                assert refused.reason is TokenRefusal.REVOKED, refused
            else:
                raise AssertionError(f"token for {lane_id} still accepted")

    def assert_journal_released(self, invocation_id: str) -> None:
        """A fresh replay of the journal file holds no reservation or process for it."""
        assert invocation_id not in self.machine.journal.reservations()
        journal, replay = Journal.open(self.state_dir)
        journal.close()
        assert invocation_id not in replay.reservations
        assert all(p.reservation_id != invocation_id for p in replay.processes.values())

    def assert_released(self, invocation_id: str, tokens: dict[str, str]) -> None:
        self.assert_baseline()
        self.assert_revoked(tokens)
        self.assert_journal_released(invocation_id)
        assert self.sup.get(invocation_id).state in TERMINAL
        for owner in self.sup.owners.values():
            assert owner.held_by(invocation_id) == 0

    async def wait_terminal(self, invocation_id: str) -> InvocationState:
        """Poll (checkpoints only, so it works under a frozen MockClock) with a
        real-time bound."""
        end = time.monotonic() + WAIT_SECONDS
        while (state := self.sup.get(invocation_id).state) not in TERMINAL:
            if time.monotonic() > end:
                raise AssertionError(f"{invocation_id} still {state} after {WAIT_SECONDS}s")
            await trio.lowlevel.checkpoint() if _frozen() else await trio.sleep(0.005)
        return state

    async def wait_state(self, invocation_id: str, state: InvocationState) -> None:
        end = time.monotonic() + WAIT_SECONDS
        while self.sup.get(invocation_id).state is not state:
            if time.monotonic() > end:
                raise AssertionError(f"{invocation_id} never reached {state}")
            await trio.lowlevel.checkpoint() if _frozen() else await trio.sleep(0.005)


async def _collect(
    events: EventHub[NodeEvent],
    into: list[NodeEvent],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    async with events.subscribe() as subscription:
        task_status.started()
        async for item in subscription:
            assert not isinstance(item, Dropped), "the test's collector fell behind"
            into.append(item.event)


def _frozen() -> bool:
    clock = trio.lowlevel.current_clock()
    return isinstance(clock, trio.testing.MockClock) and clock.rate == 0


def unstarted_supervisor(
    machine: Machine, state_dir: Path, **kw: Any
) -> tuple[Supervisor, TokenService]:
    """A supervisor (and its token service) for tests that run and stop it themselves."""
    tokens = TokenService(NODE, KeyRing.open(state_dir), ttl=900)
    options: dict[str, Any] = {"max_queued": 4, "max_running": 4, **kw}
    sup = Supervisor(
        machine,
        tokens,
        EventHub[NodeEvent](max_subscribers=2, buffer=64),
        InProcessHosts(),
        **options,
    )
    return sup, tokens


@contextlib.asynccontextmanager
async def open_unstarted(
    tmp_path: Path, *, machine_cls: type[Machine] = Machine, **sup_kw: Any
) -> AsyncIterator[tuple[Machine, Supervisor, TokenService]]:
    """A sim machine and an `unstarted_supervisor` over it, for tests that run and stop
    the supervisor themselves; the machine is closed on exit."""
    state_dir = tmp_path / "state"
    machine = await open_machine(state_dir, cls=machine_cls)
    try:
        sup, tokens = unstarted_supervisor(machine, state_dir, **sup_kw)
        yield machine, sup, tokens
    finally:
        await machine.aclose()


@contextlib.asynccontextmanager
async def open_rig(
    tmp_path: Path,
    *,
    max_queued: int = 8,
    max_running: int = 4,
    kill_grace: float = 0.5,
    lane_hosts: Callable[[Lane], LaneDevice] | None = None,
    machine_cls: type[Machine] = Machine,
    tokens: TokenService | None = None,
    machine_kw: dict[str, Any] | None = None,
    **sup_kw: Any,
) -> AsyncIterator[Rig]:
    """A running supervisor over the sim workstation; shut down and closed on exit.

    `tokens` replaces the default token service (to give it a clock or a bound);
    `machine_kw` goes to `Machine.open`."""
    state_dir = tmp_path / "state"
    box: list[Supervisor] = []
    transitions: list[HealthTransition] = []

    def on_transition(event: HealthTransition) -> None:
        transitions.append(event)
        if box:
            box[0].on_health(event)

    machine = await open_machine(
        state_dir, cls=machine_cls, on_transition=on_transition, **(machine_kw or {})
    )
    try:
        if tokens is None:
            tokens = TokenService(NODE, KeyRing.open(state_dir), ttl=900)
        keyring = tokens.keyring
        events = EventHub[NodeEvent](max_subscribers=8, buffer=256)
        hosts = lane_hosts or InProcessHosts()
        sup = Supervisor(
            machine,
            tokens,
            events,
            hosts,
            max_queued=max_queued,
            max_running=max_running,
            kill_grace=kill_grace,
            node_url="http://127.0.0.1:7777",
            **sup_kw,
        )
        box.append(sup)
        rig = Rig(
            machine=machine,
            keyring=keyring,
            tokens=tokens,
            events=events,
            sup=sup,
            state_dir=state_dir,
            baseline=machine.ledger.capacity(),
            transitions=transitions,
            hosts=hosts,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(_collect, events, rig.seen)
            await nursery.start(sup.run)
            try:
                yield rig
            finally:
                with trio.CancelScope(shield=True):
                    await sup.shutdown(0)
                nursery.cancel_scope.cancel()
    finally:
        await machine.aclose()


# -- requests ------------------------------------------------------------------------


def builtin(
    invocation_id: str,
    name: str = "sleep",
    *,
    requirement: Requirement = Requirement.CPU,
    isolation: Isolation = Isolation.SHARED,
    gpus: int = 0,
    vram_bytes: int = 0,
    cpu_millis: int = 100,
    memory_bytes: int = 64 * 2**20,
    timeout_s: float = 3600.0,
    **args: Any,
) -> InvocationRequest:
    return InvocationRequest(
        id=invocation_id,
        work=BuiltinWork(name=name, args=args),
        requirement=requirement,
        isolation=isolation,
        resources=Resources(
            cpu_millis=cpu_millis, memory_bytes=memory_bytes, gpus=gpus, vram_bytes=vram_bytes
        ),
        timeout_s=timeout_s,
    )


def gpu_builtin(invocation_id: str, name: str = "sleep", **kw: Any) -> InvocationRequest:
    """`builtin` work on one GPU: a share of one by default, or (`isolation=`) a whole
    one or a MIG instance."""
    return builtin(invocation_id, name, requirement=Requirement.GPU, gpus=1, **kw)


def only_lane(response: SubmitResponse) -> tuple[str, str]:
    """The one (lane id, token) an admission of single-lane work answered with."""
    ((lane_id, token),) = response.tokens.items()
    return lane_id, token


def process(
    invocation_id: str,
    *argv: str,
    requirement: Requirement = Requirement.CPU,
    isolation: Isolation = Isolation.SHARED,
    gpus: int = 0,
    vram_bytes: int = 0,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    memory_bytes: int = 256 * 2**20,
) -> InvocationRequest:
    return InvocationRequest(
        id=invocation_id,
        work=ProcessWork(argv=list(argv), env=env or {}),
        requirement=requirement,
        isolation=isolation,
        resources=Resources(
            cpu_millis=100, memory_bytes=memory_bytes, gpus=gpus, vram_bytes=vram_bytes
        ),
        timeout_s=timeout_s,
    )


# -- processes -----------------------------------------------------------------------

# Prints its own pid (= its session and process group), then leaves a grandchild.
TREE = ("sh", "-c", 'echo "$$"; sleep 60 & sleep 60')


def session_members(sid: int) -> list[int]:
    """Live (non-zombie) processes in session or process group `sid`."""
    found = []
    for proc in psutil.process_iter():
        try:
            if sid in (os.getpgid(proc.pid), os.getsid(proc.pid)):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc.pid)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return found


async def tree_pid(rig: Rig, invocation_id: str, *, members: int = 2) -> int:
    """The pid the TREE command printed, once `members` processes of its group live."""
    with trio.fail_after(10):
        while True:
            tail = rig.sup.get(invocation_id).stdout_tail.strip()
            if tail.isdigit() and len(session_members(int(tail))) >= members:
                return int(tail)
            await trio.sleep(0.01)


def kill_leftovers(sid: int) -> None:
    """Never leave processes behind, even when an assertion failed."""
    for pid in session_members(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
