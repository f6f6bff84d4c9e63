"""How an admitted invocation runs and ends: its actor, cancelling it, the cleanup.

Each invocation runs in the supervisor's nursery under its own cancel scope
with its deadline, in a run slot. Whatever ends it, cleanup runs shielded with its own
deadline (when only the journal is awaited, the journal's commit is that
shield and deadline), in this order: the process group is already gone (the executor
ends it), lane state it held is freed, its tokens are revoked, its
reservation is released and journaled -- and only then is the terminal
state recorded and announced.
"""

from __future__ import annotations

import logging

import trio

from machine.lanes import LaneKind
from supervisor.health_coupling import HealthCoupling
from supervisor.invocation import Invocation, utc_now
from supervisor.lifecycle import TERMINAL, Ending, next_state
from supervisor.lookup import UnknownInvocation
from supervisor.process import ConfinementFailed, ProcessStuck
from supervisor.remembered import ended_record, restart_ended_record
from supervisor.runner import RunEnv, run_work
from supervisor.state import SupervisorState
from supervisor.wire import EventKind, InvocationState, InvocationStatus, NodeEvent

__all__ = ["Endings"]

# The name these lines have always been logged under: operators' filters keep matching.
log = logging.getLogger("supervisor.core")


class Endings:
    def __init__(self, state: SupervisorState, health: HealthCoupling) -> None:
        self._state = state
        self._health = health
        self._env = self._new_env()

    def _new_env(self) -> RunEnv:
        state = self._state
        return RunEnv(
            machine=state.machine,
            node_url=state.node_url,
            kill_grace=state.kill_grace,
            guests=state.guests,
            charges=state.charges,
            pool=state.pool,
            hurry=state.hurry,
        )

    def _run_env(self) -> RunEnv:
        env, state = self._env, self._state
        if (env.node_url, env.kill_grace, env.guests) != (
            state.node_url,
            state.kill_grace,
            state.guests,
        ):  # changed since the last invocation: built again (rarely: settings are fixed)
            env = self._env = self._new_env()
        return env

    # -- the actor ----------------------------------------------------------------------
    async def actor(self, inv: Invocation) -> None:
        state = self._state
        ending: Ending | None = None
        try:
            with inv.scope:
                if inv.logs is not None:
                    await inv.logs.create()
                await self._take_slot()
                try:
                    state.waiting -= 1
                    inv.advance(Ending.start)
                    self.announce(inv, inv.started_at)
                    inv.exit_code = await run_work(self._run_env(), inv)
                finally:
                    state.slots.release()
                ending = Ending.succeed if inv.exit_code == 0 else Ending.fail
                inv.reason = None if inv.exit_code == 0 else inv.failure_reason()
        except ProcessStuck as exc:
            ending, inv.reason, inv.stuck = Ending.fail, f"process_stuck: {exc}", True
        except ConfinementFailed as exc:
            ending, inv.reason = Ending.fail, f"confinement_failed: {exc}"[:500]
        except Exception as exc:
            ending, inv.reason = Ending.fail, f"{type(exc).__name__}: {exc}"[:500]
        except BaseException:
            ending, inv.reason = Ending.cancel, inv.cancel_reason or "shutdown"
            raise
        finally:
            if ending is None:  # the scope caught a cancel: a request, a fault or the deadline
                ending = Ending.cancel if inv.cancel_reason else Ending.timeout
                inv.reason = inv.cancel_reason or "deadline_exceeded"
            ended_at = utc_now()
            final = await self._clean_up(inv, next_state(inv.state, ending), ended_at)
            if inv.state is InvocationState.queued:  # ended before it ran
                state.waiting -= 1
            inv.advance(ending, at=ended_at)
            self._retire(inv)
            self.announce(inv, ended_at, final)
            inv.finished.set()

    async def _take_slot(self) -> None:
        """A run slot: at once when one is free (the actor has just been scheduled, it
        needs no further turn), else wait in line; a cancel before it counts either way."""
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self._state.slots.acquire_nowait()
        except trio.WouldBlock:
            await self._state.slots.acquire()

    # -- cancelling ---------------------------------------------------------------------
    async def cancel(self, inv: Invocation) -> InvocationStatus:
        """Cancel a live invocation and answer only once everything it held is released."""
        state = self._state
        inv.cancel("cancel_requested")
        with trio.fail_after(state.cleanup_deadline + state.kill_grace + 5):
            await inv.finished.wait()
        if inv.state not in TERMINAL:  # its admission failed: it never existed
            raise UnknownInvocation(inv.id)
        return inv.status()

    # -- cleanup ------------------------------------------------------------------------
    async def _clean_up(
        self, inv: Invocation, state: InvocationState, ended_at: str
    ) -> InvocationStatus | None:
        """Free what `inv` holds and journal its ending, shielded and bounded; returns
        its final status (None when the cleanup overran its deadline)."""
        charges = self._state.charges
        self.revoke(inv)  # first: none of its queued lane work runs any more
        owners = charges.owners_holding(inv)
        if inv.logs is None and not owners and not charges.holds(inv.id):
            charges.forget(inv.id)  # a guest's cgroup, or none: nothing to await
            # Only the journal is awaited, and its commit is shielded and bounded by the
            # journal's own deadline: no cancel scope of ours is needed around it.
            return await self._release(inv, state, ended_at)
        final = None
        with trio.move_on_after(self._state.cleanup_deadline, shield=True) as cleanup:
            if inv.logs is not None:
                await inv.logs.close()  # complete: its followers end, its cut is final
            await charges.end_sessions(inv)
            await charges.release(inv.id)  # after its sessions: its usage is whole
            final = await self._release(inv, state, ended_at)
        if cleanup.cancelled_caught:
            log.error("cleanup of %s overran %ss", inv.id, self._state.cleanup_deadline)
        return final

    async def _release(
        self, inv: Invocation, state: InvocationState, ended_at: str
    ) -> InvocationStatus:
        """Give back its reservation and journal its ending (Machine.end: shielded, under
        the journal's deadline); returns its final status."""
        grants = inv.reservation.lanes if inv.reservation else ()
        if inv.stuck:
            # A process that survived SIGKILL still holds its devices: keep the
            # reservation (a restart's reconcile keeps it too) and fault its GPU lanes.
            log.error("%s: process %s survived SIGKILL; its resources stay held", inv.id, inv.pid)
            for grant in grants:
                if grant.kind is not LaneKind.CPU:
                    self._health.lane_faulted(grant.lane_id)
        # The release, the process's end and how it ended (so its id does not run
        # again after a restart) are journaled in one write: one fsync before the
        # terminal state is recorded (and before DELETE answers).
        final = inv.status(state=state, ended_at=ended_at)
        record, remembered = ended_record(inv, final)
        if await self._state.machine.end(inv.id, pid=inv.pid, outcome=record, keep=inv.stuck):
            self._state.history.add(record, remembered)
        return final

    async def remember_restart_endings(self) -> None:
        """What the previous daemon left running ended with it: remember each, so a
        resubmission answers `failed: node_restarted` instead of running it again."""
        machine = self._state.machine
        recovery, replay = machine.recovery, machine.replay
        for reservation_id in recovery.released if recovery is not None else ():
            reservation = replay.reservations.get(reservation_id)
            if reservation is None or not reservation.request_digest:
                continue  # journaled before digests were: nothing to compare a retry with
            if machine.ended_invocation(reservation_id) is not None:
                continue
            record = restart_ended_record(reservation)
            try:
                await machine.invocation_ended(record)
            except Exception as exc:  # the node still starts; the id may run again
                log.error("journal of the restart ending of %s failed: %s", reservation_id, exc)
            else:
                self._state.history.add(record)

    def revoke(self, inv: Invocation) -> None:
        # Forgets the invocation's tokens: it frees room and can never fail for lack of it.
        self._state.tokens.revoke_invocation(inv.id)

    def _retire(self, inv: Invocation) -> None:
        state = self._state
        state.live.pop(inv.id, None)
        state.ended[inv.id] = inv
        state.ended_totals[inv.state] = state.ended_totals.get(inv.state, 0) + 1
        while len(state.ended) > state.retain_ended:
            state.ended.popitem(last=False)

    def announce(
        self, inv: Invocation, at: str | None, status: InvocationStatus | None = None
    ) -> None:
        """Publish its state, stamped when it changed (`at`, the time in its status);
        `status` when it is already built."""
        self._state.events.publish(
            NodeEvent(
                kind=EventKind.invocation, at=at or utc_now(), invocation=status or inv.status()
            )
        )
        self._state.on_change()
