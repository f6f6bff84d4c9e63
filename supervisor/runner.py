"""Runs an admitted invocation's work: a registered builtin or a process."""

from __future__ import annotations

import dataclasses
import functools
import logging

import trio

from machine import Machine
from machine.lanes import LaneKind
from supervisor.builtins import BUILTINS
from supervisor.guests import GuestPolicy, GuestSession, adopt_uid, guest_session
from supervisor.invocation import Invocation
from supervisor.lane_charges import LaneCharges
from supervisor.logstore import InvocationLogs
from supervisor.output import Sink
from supervisor.process import ProcessSpec, run_process
from supervisor.sandbox_pool import SandboxPool
from supervisor.wire import BuiltinWork, ProcessWork

__all__ = ["RunEnv", "process_spec", "run_work"]


@dataclasses.dataclass(frozen=True)
class RunEnv:
    """What running work needs of the node (the supervisor passes it down)."""

    machine: Machine
    node_url: str
    kill_grace: float
    guests: GuestPolicy
    charges: LaneCharges  # where its lane sessions run: its guest's cgroup
    # Sandboxes made ahead for cwd-less guests; None: each guest's is made at its start.
    pool: SandboxPool | None = None
    # Set when the daemon must stop at once (a second Ctrl-C): no more kill grace.
    hurry: trio.Event | None = None


log = logging.getLogger(__name__)


def process_spec(inv: Invocation, work: ProcessWork, guest: GuestSession) -> ProcessSpec:
    reservation = inv.reservation
    assert reservation is not None
    gpu = any(g.kind is not LaneKind.CPU for g in reservation.lanes)
    resources = inv.request.resources
    return ProcessSpec(
        argv=tuple(work.argv),
        env=work.env,
        cwd=work.cwd,
        extra_env=guest.env,
        visible_devices=reservation.visible_devices,
        memory_limit_bytes=resources.memory_bytes,
        cpu_only=not gpu,
        cgroup_name=inv.id,
        uid=guest.uid,
        sandbox=guest.sandbox,
        cpu_millis=resources.cpu_millis,
        pids_max=guest.pids_max,
    )


async def run_work(sup: RunEnv, inv: Invocation) -> int:
    work = inv.request.work
    logs = inv.logs
    if isinstance(work, BuiltinWork):
        try:
            return await BUILTINS[work.name](work.args, inv.stdout)
        finally:
            if logs is not None:  # a builtin's output is small: it fits in the ring
                with trio.CancelScope(shield=True):
                    await logs.write("stdout", inv.stdout.getvalue())
    assert isinstance(work, ProcessWork)
    reservation = inv.reservation
    assert reservation is not None
    ledger = sup.machine.ledger
    lanes = [lane for g in reservation.lanes if (lane := ledger.lane(g.lane_id)) is not None]

    async def started(pid: int, start_ticks: int | None) -> None:
        # Awaited before the guest's argv runs: a crash from here on finds the
        # record, and a failed write means the argv never runs.
        await sup.machine.process_started(inv.id, pid, start_ticks)
        inv.pid = pid

    with guest_session(
        sup.guests,
        isolation=reservation.isolation,
        lanes=lanes,
        tokens=[inv.tokens[g.lane_id] for g in reservation.lanes],
        inventory=sup.machine.inventory,
        cwd=work.cwd,
        node_url=sup.node_url,
        memory_bytes=inv.request.resources.memory_bytes,
        network=work.network,
    ) as guest:
        spec = process_spec(inv, work, guest)
        ready = None if sup.pool is None else sup.pool.take(spec)
        if ready is not None:
            adopt_uid(sup.guests, guest, ready.uid)
            spec = dataclasses.replace(spec, uid=ready.uid)
        if sup.pool is not None:
            sup.pool.count_start(pooled=ready is not None)
        inv.uid, inv.network = guest.uid, guest.network
        return await run_process(
            spec,
            stdout=inv.stdout,
            stderr=inv.stderr,
            on_started=started,
            kill_grace=sup.kill_grace,
            cgroups=sup.guests.cgroups,
            on_usage=inv.record_usage,
            sinks=None if logs is None else (_sink(logs, "stdout"), _sink(logs, "stderr")),
            on_cgroup=functools.partial(sup.charges.guest_confined, inv.id),
            before_cgroup_end=functools.partial(sup.charges.guest_ending, inv),
            ready=ready,
            on_stuck=functools.partial(_stuck, inv, guest),
            hurry=sup.hurry,
        )


def _stuck(inv: Invocation, guest: GuestSession) -> None:
    # A cancel or deadline may be what ends the run: its reservation and uid stay held.
    inv.stuck = guest.stuck = True


def _sink(logs: InvocationLogs, stream: str) -> Sink:
    async def write(data: bytes) -> None:
        await logs.write(stream, data)

    return write
