"""A hypothesis state machine over the supervisor: submits (builtin sleep/echo/fail on
CPU, GPU and MIG lanes, every isolation class), resubmits, cancels, device faults and
recoveries, lane work and lane-owner crashes, and time passing, interleaved. After
every step it checks the ledger against the live invocations and that everything an
ended invocation held is gone.

One trio run per example lives in a worker thread under a frozen MockClock (time
moves only when the `advance` rule jumps it); the journal is written inline on the
event loop (`InlineJournalMachine`), so `wait_all_tasks_blocked` means "settled" and
every example is deterministic. Between calls the run is settled (every task blocked,
the clock frozen): the rules and the invariant read its state from this thread, with
no round trip to the worker's (a round trip costs more than the check)."""

from __future__ import annotations

import os
import queue
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import tests.lane_doubles
from capabilities import LaneOp, TokenRefusal, TokenRefused
from lanehost.kernels import load_kernels
from machine.health import HealthState, Signal
from machine.lanes import Isolation, Requirement
from supervisor.admission import AdmissionRefused
from supervisor.core import Supervisor
from supervisor.lane_owner import LaneWorkError
from supervisor.lane_work import Execute, MemoryReserve
from supervisor.wire import InvocationRequest, InvocationState, SubmitResponse
from tests.supervisor_fixtures import (
    SIM_GPU,
    SIM_MIG_GPU,
    TERMINAL,
    GiB,
    InlineJournalMachine,
    Rig,
    builtin,
    open_rig,
)

T = TypeVar("T")
S = InvocationState
MAX_QUEUED = 3
MAX_RUNNING = 2
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None
LIVE = frozenset({S.queued, S.running})
FAILED = frozenset({HealthState.UNHEALTHY, HealthState.LOST})

PLACEMENTS: list[tuple[Requirement, Isolation, bool]] = [
    (Requirement.CPU, Isolation.SHARED, False),
    (Requirement.CPU, Isolation.SANDBOX, False),
    (Requirement.GPU, Isolation.SHARED, True),
    (Requirement.GPU, Isolation.SANDBOX, True),
    (Requirement.GPU, Isolation.DEDICATED, False),
    (Requirement.GPU, Isolation.PARTITIONED, False),
    (Requirement.AUTO, Isolation.SHARED, True),
]
REFUSALS = {
    "queue_full",
    "insufficient_vram",
    "insufficient_gpus",
    "lane_unhealthy",
    "no_lane",
}


@pytest.fixture(autouse=True, scope="module")
def _kernels_loaded_once() -> Iterator[None]:
    """Each in-process lane host loads its kernel table (entry points read from the
    installed packages' metadata, 15 ms), and an example starts a handful: here they
    share one table, loaded once (each host still gets its own dict of it)."""
    kernels = load_kernels()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tests.lane_doubles, "load_kernels", lambda: dict(kernels))
        yield


class SupervisorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.TemporaryDirectory(dir=SHM)
        self._ready: queue.Queue[object] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        item = self._ready.get(timeout=60)
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, tuple)
        self.trio_token, self.rig, self.clock = item
        self.requests: dict[str, InvocationRequest] = {}
        self.responses: dict[str, SubmitResponse] = {}
        self.count = 0
        self.call(trio.lowlevel.checkpoint)  # settled: what the rig started is waiting

    # -- the trio side ----------------------------------------------------------------
    def _serve(self) -> None:
        clock = trio.testing.MockClock()
        try:
            trio.run(self._main, clock, clock=clock)
        except BaseException as exc:
            self._ready.put(exc)

    async def _main(self, clock: trio.testing.MockClock) -> None:
        self._stop = trio.Event()
        async with open_rig(
            Path(self._dir.name),
            machine_cls=InlineJournalMachine,
            max_queued=MAX_QUEUED,
            max_running=MAX_RUNNING,
        ) as rig:
            self._ready.put((trio.lowlevel.current_trio_token(), rig, clock))
            await self._stop.wait()

    def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        async def settled() -> T:
            result = await fn()
            await trio.testing.wait_all_tasks_blocked()
            return result

        return trio.from_thread.run(settled, trio_token=self.trio_token)

    def teardown(self) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self.trio_token)
        self._thread.join(60)
        assert not self._thread.is_alive()
        self._dir.cleanup()

    # -- helpers ----------------------------------------------------------------------
    @property
    def sup(self) -> Supervisor:
        sup: Supervisor = self.rig.sup
        return sup

    def pick(self, index: int, *, live: bool | None = None) -> str | None:
        ids = sorted(self.responses)
        if live is not None:
            ids = [i for i in ids if (self.sup.get(i).state in LIVE) is live]
        return ids[index % len(ids)] if ids else None

    # -- rules ------------------------------------------------------------------------
    @rule(
        name=st.sampled_from(["sleep", "sleep", "echo", "fail"]),
        placement=st.sampled_from(PLACEMENTS),
        seconds=st.sampled_from([0, 1, 2, 5, 20]),
        timeout=st.sampled_from([1, 3, 10, 100]),
        vram_gib=st.integers(0, 14),
    )
    def submit(
        self,
        name: str,
        placement: tuple[Requirement, Isolation, bool],
        seconds: int,
        timeout: int,
        vram_gib: int,
    ) -> None:
        requirement, isolation, wants_vram = placement
        invocation_id = f"i{self.count}"
        self.count += 1
        args: dict[str, Any] = {"seconds": seconds} if name == "sleep" else {}
        request = builtin(
            invocation_id,
            name,
            requirement=requirement,
            isolation=isolation,
            gpus=0 if requirement is Requirement.CPU else 1,
            vram_bytes=vram_gib * GiB if wants_vram else 0,
            timeout_s=timeout,
            **args,
        )
        ledger = self.rig.machine.ledger
        before = (ledger.capacity(), self.rig.tokens.live_tokens, len(self.sup.list()))

        async def go() -> SubmitResponse | AdmissionRefused:
            try:
                return await self.sup.submit(request)
            except AdmissionRefused as refused:
                return refused

        answer = self.call(go)
        if isinstance(answer, AdmissionRefused):
            assert answer.reason in REFUSALS, answer.reason
            assert answer.status == (429 if answer.reason == "queue_full" else 409) or (
                answer.reason == "no_lane" and answer.status == 422
            )
            # A refusal changed nothing (time did not move: nothing else could have).
            after = (ledger.capacity(), self.rig.tokens.live_tokens, len(self.sup.list()))
            assert after == before
        else:
            assert answer.id == invocation_id and answer.tokens
            self.requests[invocation_id] = request
            self.responses[invocation_id] = answer

    @precondition(lambda self: bool(self.responses))
    @rule(index=st.integers(0, 1000))
    def resubmit(self, index: int) -> None:
        invocation_id = self.pick(index)
        assert invocation_id is not None
        runs = len(self.sup.list())
        answer = self.call(lambda: self.sup.submit(self.requests[invocation_id]))
        assert answer.id == invocation_id
        assert answer.tokens == self.responses[invocation_id].tokens
        assert len(self.sup.list()) == runs

    @precondition(lambda self: bool(self.responses))
    @rule(index=st.integers(0, 1000))
    def cancel(self, index: int) -> None:
        invocation_id = self.pick(index)
        assert invocation_id is not None
        was = self.sup.get(invocation_id)
        status = self.call(lambda: self.sup.cancel(invocation_id))
        assert status.state in TERMINAL
        if was.state not in LIVE:
            assert status == was  # cancelling an ended invocation changes nothing
        elif status.state is S.cancelled:
            assert status.reason == "cancel_requested"

    @rule(seconds=st.sampled_from([0.5, 1, 2, 5, 30]))
    def advance(self, seconds: float) -> None:
        async def jump() -> None:
            self.clock.jump(seconds)
            await trio.lowlevel.checkpoint()

        self.call(jump)

    @rule(
        device=st.sampled_from([SIM_GPU, SIM_MIG_GPU]),
        signal=st.sampled_from(
            [Signal.FATAL_XID, Signal.LOST, Signal.ECC, Signal.APP_XID, Signal.READ_FAILED]
        ),
    )
    def fault(self, device: str, signal: Signal) -> None:
        async def apply() -> None:
            self.rig.machine.health.apply(device, signal, signal.value, at=trio.current_time())
            await trio.lowlevel.checkpoint()

        self.call(apply)

    @rule(device=st.sampled_from([SIM_GPU, SIM_MIG_GPU]))
    def recover(self, device: str) -> None:
        async def apply() -> None:
            health = self.rig.machine.health
            health.apply(device, Signal.REDISCOVERED, at=trio.current_time())
            health.apply(device, Signal.RESET, at=trio.current_time())
            for _ in range(health.recovery_probes):
                health.apply(device, Signal.GOOD, at=trio.current_time())
            await trio.lowlevel.checkpoint()

        self.call(apply)

    @precondition(lambda self: bool(self.responses))
    @rule(index=st.integers(0, 1000), gib=st.integers(1, 8), crash=st.booleans())
    def lane_work(self, index: int, gib: int, crash: bool) -> None:
        invocation_id = self.pick(index)
        assert invocation_id is not None
        live = self.sup.get(invocation_id).state in LIVE
        lane_id, token = next(iter(self.responses[invocation_id].tokens.items()))
        work = Execute(kernel="boom") if crash else MemoryReserve(dtype="uint8", shape=[gib * GiB])

        async def go() -> object:
            try:
                return await self.sup.lane_work(lane_id, token, work)
            except (TokenRefused, LaneWorkError) as refused:
                return refused

        answer = self.call(go)
        if not live:
            assert isinstance(answer, TokenRefused | LaneWorkError)
            if isinstance(answer, TokenRefused):
                assert answer.reason is TokenRefusal.REVOKED
            else:
                assert answer.code == "lane_unhealthy"  # a faulted owner answers first

    # -- invariants -------------------------------------------------------------------
    @invariant()
    def accounts_balance(self) -> None:
        self._check()  # the run is settled: see the module's docstring

    def _check(self) -> None:
        rig: Rig = self.rig
        ledger = rig.machine.ledger
        statuses = {s.id: s for s in self.sup.list()}
        live = {i for i, s in statuses.items() if s.state in LIVE}
        ended = set(statuses) - live
        reservations = ledger.reservations()
        assert set(reservations) == live
        assert set(rig.machine.journal.reservations()) == live
        cap = ledger.capacity()
        for amounts in (cap.cpu_millis, cap.memory_bytes, cap.gpus, *(u.vram for u in cap.lanes)):
            assert amounts.allocated >= 0
            assert 0 <= amounts.allocatable <= amounts.capacity - amounts.reserved
        assert cap.cpu_millis.allocated == sum(r.cpu_millis for r in reservations.values())
        assert cap.cpu_millis.allocated == sum(self.requests[i].resources.cpu_millis for i in live)
        assert cap.memory_bytes.allocated == sum(
            self.requests[i].resources.memory_bytes for i in live
        )
        for usage in cap.lanes:
            grants = [
                g for r in reservations.values() for g in r.lanes if g.lane_id == usage.lane_id
            ]
            assert usage.vram.allocated == sum(g.vram_bytes for g in grants)
            assert usage.holders == len(grants)
        counts = self.sup.counts()
        assert counts[S.running] <= MAX_RUNNING
        assert len(live) <= MAX_QUEUED + MAX_RUNNING
        for invocation_id in live:
            # Health reaches running work: nothing live sits on a failed lane (an
            # unknown reading alone ends no work; it only stops new admissions).
            for grant in reservations[invocation_id].lanes:
                assert ledger.lane_health(grant.lane_id) not in FAILED
            for lane_id, token in self.responses[invocation_id].tokens.items():
                rig.sup.validator.validate(token, lane_id=lane_id, op=LaneOp.EXECUTE)
        for invocation_id in ended:
            for lane_id, token in self.responses[invocation_id].tokens.items():
                try:
                    rig.sup.validator.validate(token, lane_id=lane_id, op=LaneOp.EXECUTE)
                except TokenRefused as refused:
                    assert refused.reason is TokenRefusal.REVOKED
                else:
                    raise AssertionError(f"{invocation_id}'s token outlived it")
            for owner in rig.sup.owners.values():
                assert owner.held_by(invocation_id) == 0
        for owner in rig.sup.owners.values():
            assert owner.used_bytes == sum(owner.held_by(i) for i in live)
            assert owner.used_bytes <= owner.lane.vram_bytes
        assert rig.tokens.live_tokens == sum(len(self.responses[i].tokens) for i in live)


SupervisorMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSupervisorMachine = SupervisorMachine.TestCase
