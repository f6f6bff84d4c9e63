"""The supervisor: admits invocations, runs each as an ephemeral actor, owns the lanes.

`Supervisor` is the facade the node and the HTTP edge use; it owns its own
lifetime (`run`, `shutdown`) and wires the collaborators, which share one
`SupervisorState` (state.py):

- submission.py: admission and submission, handing each to its actor;
- endings.py: the actor, cancelling, and the cleanup in order;
- health_coupling.py: cancelling work on failed devices, lanes and lane hosts;
- lane_routing.py: lane work and tokens, routed to the lanes' owners;
- drain.py: cordoning the node or a lane;
- lookup.py: one invocation's status, the list, its pages and the counts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from capabilities import Claims, LaneOp, LaneValidator, MintedToken, TokenService
from machine import Machine
from machine.health import HealthTransition
from machine.lanes import Lane
from supervisor.drain import Drain
from supervisor.endings import Endings
from supervisor.events import EventHub
from supervisor.guests import GuestPolicy
from supervisor.health_coupling import HealthCoupling
from supervisor.history import History
from supervisor.lane_buffers import BUFFERS_PER_INVOCATION
from supervisor.lane_owner import KERNEL_SECONDS, LaneOwner
from supervisor.lane_routing import LaneRouting
from supervisor.lane_work import Download, LaneDevice, LaneJob, LaneWorkReply
from supervisor.listing import ListQuery
from supervisor.logstore import LogStore
from supervisor.lookup import Lookup, UnknownInvocation
from supervisor.sandbox_pool import SandboxPool
from supervisor.standing_holds import StandingHolds
from supervisor.state import Shared, SupervisorState
from supervisor.submission import Submission
from supervisor.wire import (
    InvocationList,
    InvocationRequest,
    InvocationState,
    InvocationStatus,
    NodeEvent,
    SubmitResponse,
)

__all__ = ["Supervisor", "UnknownInvocation"]


class Supervisor:
    # Kept on the shared state: a change here is seen by every collaborator.
    machine = Shared[Machine]()
    logs = Shared[LogStore | None]()
    guests = Shared[GuestPolicy]()
    tokens = Shared[TokenService]()
    validator = Shared[LaneValidator]()
    events = Shared[EventHub[NodeEvent]]()
    node_url = Shared[str]()
    max_queued = Shared[int]()
    kill_grace = Shared[float]()
    cleanup_deadline = Shared[float]()
    lane_work_deadline = Shared[float]()
    accepting = Shared[bool]()
    drained = Shared[bool]()
    owners = Shared[dict[str, LaneOwner]]()
    pool = Shared[SandboxPool | None]()

    def __init__(
        self,
        machine: Machine,
        tokens: TokenService,
        events: EventHub[NodeEvent],
        lane_hosts: Callable[[Lane], LaneDevice],
        *,
        max_queued: int,
        max_running: int,
        node_url: str = "",
        kill_grace: float = 5.0,
        cleanup_deadline: float = 30.0,
        lane_work_deadline: float = 120.0,
        lane_host_start_wait: float = 60.0,
        lane_buffers_per_invocation: int = BUFFERS_PER_INVOCATION,
        max_kernel_seconds: float = KERNEL_SECONDS,
        retain_ended: int = 1024,
        on_change: Callable[[], None] = lambda: None,
        guests: GuestPolicy | None = None,
        logs: LogStore | None = None,
        on_lane_host_call: Callable[[str, float], None] = lambda _op, _seconds: None,
        sandbox_pool: int = 0,
        hurry: trio.Event | None = None,
    ) -> None:
        self._state = state = SupervisorState(
            machine=machine,
            logs=logs,
            # Tests of the supervisor's own logic run guests unconfined; the daemon confines.
            guests=guests or GuestPolicy.unconfined(machine.journal.path.parent),
            tokens=tokens,
            validator=tokens.validator(),
            events=events,
            node_url=node_url,
            max_queued=max_queued,
            kill_grace=kill_grace,
            hurry=trio.Event() if hurry is None else hurry,
            cleanup_deadline=cleanup_deadline,
            # A caller waits at least as long as its kernel may run, and then some.
            lane_work_deadline=max(lane_work_deadline, max_kernel_seconds + 30),
            retain_ended=retain_ended,
            on_change=on_change,
            slots=trio.Semaphore(max_running),
            history=History(machine.replay.ended.values(), seconds=machine.journal.index.window_s),
        )
        policy = state.guests
        if sandbox_pool > 0 and policy.bwrap is not None and policy.keeper is not None:
            state.pool = SandboxPool(
                size=sandbox_pool,
                uids=policy.uids,
                cgroups=policy.cgroups,
                state_dir=policy.state_dir,
                keep_uids=max_running,
            )
        self.max_running = max_running
        self.lane_host_start_wait = lane_host_start_wait
        self._live = state.live  # the same table, never rebound (tests look into it)
        self._health = HealthCoupling(state)
        self._endings = Endings(state, self._health)
        self._submission = Submission(state, self._endings)
        self._lanes = LaneRouting(state)
        self.holds = StandingHolds(state)
        self._drain = Drain(state)
        self._lookup = Lookup(state)
        state.owners.update(
            (
                lane.lane_id,
                LaneOwner(
                    lane,
                    state.validator,
                    lane_hosts,
                    is_live=lambda sub: sub in state.live or sub in state.holds,
                    usable=machine.ledger.available,
                    on_fault=self._health.lane_host_faulted,
                    on_recovered=self._health.lane_recovered,
                    on_session_failed=self._health.lane_session_failed,
                    on_host_call=on_lane_host_call,
                    on_reserved=self._lane_host_reserved,
                    place=state.charges.place,
                    max_buffers_per_invocation=lane_buffers_per_invocation,
                    max_kernel_seconds=max_kernel_seconds,
                ),
            )
            for lane in machine.ledger.lanes()
        )

    # -- running ------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        state = self._state
        try:
            async with trio.open_nursery() as nursery:
                state.nursery = nursery
                for owner in state.owners.values():
                    nursery.start_soon(owner.run)
                if state.pool is not None:
                    nursery.start_soon(state.pool.run)
                await self._endings.remember_restart_endings()
                self.holds.restore()
                nursery.start_soon(self.holds.keep_fresh)
                # Ready once every lane's host has answered its hello (or failed to, and
                # is being restarted: lane_hosts_problem says so); each start is bounded.
                with trio.move_on_after(self.lane_host_start_wait):
                    for owner in state.owners.values():
                        await owner.first_start.wait()
                task_status.started()
                await trio.sleep_forever()
        finally:
            # A closed nursery takes no actor: refuse before reserving, never after.
            state.accepting = False
            state.nursery = None

    def shutdown_seconds(self, grace: float) -> float:
        """The most `shutdown(grace)` waits: the grace, then the cancelled work's
        endings (each guest's kill grace) and cleanup."""
        return grace + self._state.cleanup_deadline + self._state.kill_grace

    async def shutdown(self, grace: float) -> int:
        """Stop admitting; give running work `grace` seconds, then cancel the rest and
        wait (bounded) until everything is released. Says how many were still live."""
        state = self._state
        state.accepting = False
        live = len(state.live)
        with trio.move_on_after(grace):
            for inv in list(state.live.values()):
                await inv.finished.wait()
        for inv in list(state.live.values()):
            inv.cancel("shutdown")
        with trio.move_on_after(self.shutdown_seconds(0)):
            for inv in list(state.live.values()):
                await inv.finished.wait()
        return live

    def background(self, task: Callable[[], Awaitable[None]]) -> None:
        """Run `task` in the supervisor's nursery (bookkeeping beside an invocation)."""
        assert self._state.nursery is not None
        self._state.nursery.start_soon(task)

    # -- submitting and cancelling (submission.py, endings.py) --------------------------
    async def submit(self, request: InvocationRequest) -> SubmitResponse:
        return await self._submission.submit(request)

    async def cancel(self, invocation_id: str) -> InvocationStatus:
        """Cancel and answer only once everything the invocation held is released."""
        inv = self._state.live.get(invocation_id)
        if inv is None:
            return self.get(invocation_id)
        return await self._endings.cancel(inv)

    # -- health (health_coupling.py) ----------------------------------------------------
    def on_health(self, event: HealthTransition) -> None:
        self._health.on_health(event)

    def lane_hosts_problem(self) -> str | None:
        return self._health.lane_hosts_problem()

    def faulted_lanes(self) -> str | None:
        return self._health.faulted_lanes()

    def cuda_unavailable_lanes(self) -> str | None:
        return self._health.cuda_unavailable_lanes()

    def _lane_host_reserved(self, lane_id: str, nbytes: int) -> None:
        """A lane's own host holds `nbytes` of its device for itself (its CUDA
        context): the ledger keeps them back, so a guest is never granted them."""
        state = self._state
        state.machine.ledger.set_host_reserved(lane_id, nbytes)
        state.on_change()

    # -- lane work (lane_routing.py) ----------------------------------------------------
    def lane_caller(self, lane_id: str, token: str) -> Claims:
        return self._lanes.lane_caller(lane_id, token)

    async def lane_work(self, lane_id: str, token: str, work: LaneJob) -> LaneWorkReply:
        return await self._lanes.lane_work(lane_id, token, work)

    async def lane_download(self, lane_id: str, token: str, work: Download) -> bytes:
        return await self._lanes.lane_download(lane_id, token, work)

    def check_holder(
        self, lane_id: str, token: str, op: LaneOp, peer_uid: int | None, bound: str | None = None
    ) -> None:
        self._lanes.check_holder(lane_id, token, op, peer_uid, bound)

    def refresh_token(self, lane_id: str, token: str) -> MintedToken:
        return self._lanes.refresh_token(lane_id, token, self.holds.tokens_changed)

    # -- drain (drain.py) ---------------------------------------------------------------
    def drain_reason(self) -> str | None:
        return self._drain.drain_reason()

    def set_node_drained(self, drained: bool) -> None:
        self._drain.set_node_drained(drained)

    def set_drained(self, lane_id: str, drained: bool) -> None:
        self._drain.set_drained(lane_id, drained)

    # -- reading (lookup.py) ------------------------------------------------------------
    def get(self, invocation_id: str) -> InvocationStatus:
        return self._lookup.get(invocation_id)

    def until_ended(self, invocation_id: str) -> trio.Event | None:
        return self._lookup.until_ended(invocation_id)

    def list_page(self, query: ListQuery) -> InvocationList:
        return self._lookup.list_page(query)

    def ended_totals(self) -> dict[InvocationState, int]:
        return self._lookup.ended_totals()

    def counts(self) -> dict[InvocationState, int]:
        return self._lookup.counts()

    def list(self) -> list[InvocationStatus]:  # last: its name would shadow the builtin
        return self._lookup.statuses()
