"""Runs an admitted invocation's work: a registered builtin or a process."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable

import trio

from node.machine import Machine
from node.machine.journal import JournalError
from node.machine.lanes import LaneKind
from supervisor.builtins import BUILTINS
from supervisor.invocation import Invocation
from supervisor.process import ProcessSpec, run_process
from supervisor.wire import BuiltinWork, ProcessWork

__all__ = ["RunEnv", "process_spec", "run_work"]


@dataclasses.dataclass(frozen=True)
class RunEnv:
    """What running work needs of the node (the supervisor passes it down)."""

    machine: Machine
    node_url: str
    kill_grace: float
    # Starts a task in the supervisor's nursery.
    background: Callable[[Callable[[], Awaitable[None]]], None]


log = logging.getLogger(__name__)


def process_spec(sup: RunEnv, inv: Invocation, work: ProcessWork) -> ProcessSpec:
    reservation = inv.reservation
    assert reservation is not None
    lane_ids = [g.lane_id for g in reservation.lanes]
    gpu = any(g.kind is not LaneKind.CPU for g in reservation.lanes)
    return ProcessSpec(
        argv=tuple(work.argv),
        env=work.env,
        cwd=work.cwd,
        extra_env={
            # One token per lane, in the order of LITEGRAPH_LANE_IDS.
            "LITEGRAPH_CAPABILITY_TOKEN": ",".join(inv.tokens[lane] for lane in lane_ids),
            "LITEGRAPH_LANE_IDS": ",".join(lane_ids),
            "LITEGRAPH_NODE_URL": sup.node_url,
        },
        visible_devices=reservation.visible_devices,
        memory_limit_bytes=inv.request.resources.memory_bytes or None,
        cpu_only=not gpu,
        cgroup_name=inv.id,
    )


async def run_work(sup: RunEnv, inv: Invocation) -> int:
    work = inv.request.work
    if isinstance(work, BuiltinWork):
        return await BUILTINS[work.name](work.args, inv.stdout)
    assert isinstance(work, ProcessWork)

    def started(pid: int, start_ticks: int | None) -> None:
        inv.pid = pid

        async def record() -> None:
            try:
                await sup.machine.process_started(inv.id, pid, start_ticks)
            except (OSError, JournalError, trio.TooSlowError) as exc:
                # Runs in the supervisor's nursery: raising here would end every invocation.
                log.error("journal of the start of %s (pid %d) failed: %s", inv.id, pid, exc)
            finally:
                inv.pid_recorded.set()

        # Journaled beside the run; cleanup waits for it before journaling the end.
        sup.background(record)

    return await run_process(
        process_spec(sup, inv, work),
        stdout=inv.stdout,
        stderr=inv.stderr,
        on_started=started,
        kill_grace=sup.kill_grace,
    )
