"""The supervisor beside bare trio, measured side by side in one run:

- end-to-end no-op builtin invocations per second (admit: reserve + journal + mint;
  run; release: revoke + free + journal) against a bare nursery running the same
  number of tasks; once with the state dir on the benchmark's temp dir (the journal
  fsyncs for real) and once on tmpfs (/dev/shm, where fsync costs ~nothing: the
  supervisor's own overhead). `Machine` has no non-durable journal mode, so the
  durable journal is what is measured in both;
- cancel-to-released latency (median, p99): `Supervisor.cancel` of a sleeping
  builtin against cancelling a bare sleeping task, and of a `sleep 60` process
  invocation (whole process group ended, journaled) against cancelling a bare
  `trio.run_process` of the same command;
- 1,000 concurrent sleeping builtin invocations: traced Python memory per
  invocation (tracemalloc) against 1,000 bare sleeping tasks.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable

import trio
import trio.testing

from bench.harness import Finding, median, percentile
from capabilities import KeyRing, TokenService
from machine import Machine
from machine.cgroups import InvocationCgroup
from machine.lanes import Lane, Requirement
from supervisor.core import Supervisor
from supervisor.events import EventHub
from supervisor.lane_host import lane_host_factory
from supervisor.lane_work import LaneDevice
from supervisor.wire import (
    BuiltinWork,
    InvocationRequest,
    InvocationState,
    NodeEvent,
    ProcessWork,
    Resources,
)

THROUGHPUT_N = 300
BUILTIN_CANCELS = 100
PROCESS_CANCELS = 20
CONCURRENT = 1000
# tmpfs: fsync costs ~nothing there (a private temp dir is made inside it).
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None  # noqa: S108
TERMINAL = {
    InvocationState.succeeded,
    InvocationState.failed,
    InvocationState.cancelled,
    InvocationState.timed_out,
}


def _counting_starts(
    factory: Callable[[Lane], LaneDevice], started: list[str]
) -> Callable[[Lane], LaneDevice]:
    """`factory`, noting each lane whose host has greeted (started)."""

    def make(lane: Lane) -> LaneDevice:
        host = factory(lane)
        start = host.start

        async def start_and_note(*, cgroup: InvocationCgroup | None = None) -> object:
            reply = await start(cgroup=cgroup)
            started.append(lane.lane_id)
            return reply

        host.start = start_and_note  # type: ignore[method-assign]
        return host

    return make


@contextlib.asynccontextmanager
async def supervisor(state_dir: pathlib.Path, *, limit: int) -> AsyncIterator[Supervisor]:
    """A running supervisor whose lane hosts have all started: their start-up (a
    Python process each, importing NumPy) would otherwise share the CPU with the
    first figures measured."""
    machine = await Machine.open(
        node_id="bench",
        devices="sim",
        sim_file=None,
        state_dir=state_dir,
        reserved_cpu_millis=0,
        reserved_memory_bytes=0,
        vram_headroom_bytes=0,
    )
    try:
        tokens = TokenService("bench", KeyRing.open(state_dir), ttl=900)
        started: list[str] = []
        sup = Supervisor(
            machine,
            tokens,
            EventHub[NodeEvent](max_subscribers=2, buffer=64),
            _counting_starts(lane_host_factory(backend="numpy"), started),
            max_queued=limit,
            max_running=limit,
            kill_grace=2.0,
            retain_ended=limit + 8,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            await wait_until(lambda: len(started) >= len(sup.owners))
            yield sup
            await sup.shutdown(0)
            nursery.cancel_scope.cancel()
    finally:
        await machine.aclose()


def request(invocation_id: str, name: str = "echo", **args: object) -> InvocationRequest:
    return InvocationRequest(
        id=invocation_id,
        work=BuiltinWork(name=name, args=dict(args)),
        requirement=Requirement.CPU,
        resources=Resources(cpu_millis=1, memory_bytes=1),
    )


async def wait_until(ready: Callable[[], bool]) -> None:
    with trio.fail_after(120):
        while not ready():  # noqa: ASYNC110
            await trio.sleep(0.0005)


# -- throughput ---------------------------------------------------------------------------


async def _throughput(state_dir: pathlib.Path) -> float:
    async with supervisor(state_dir, limit=THROUGHPUT_N) as sup:
        await sup.submit(request("warm"))
        await wait_until(lambda: sup.get("warm").state in TERMINAL)
        start = time.perf_counter()
        for n in range(THROUGHPUT_N):
            await sup.submit(request(f"n{n}"))
        await wait_until(
            lambda: all((sup.get(f"n{n}").state in TERMINAL) for n in range(THROUGHPUT_N))
        )
        elapsed = time.perf_counter() - start
        assert sup.counts()[InvocationState.succeeded] == THROUGHPUT_N + 1
        assert len(sup.machine.ledger) == 0
    return THROUGHPUT_N / elapsed


async def _bare_throughput() -> float:
    done = 0

    async def task() -> None:
        nonlocal done
        await trio.lowlevel.checkpoint()
        done += 1

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(THROUGHPUT_N):
            nursery.start_soon(task)
    elapsed = time.perf_counter() - start
    assert done == THROUGHPUT_N
    return THROUGHPUT_N / elapsed


# -- cancel latency -----------------------------------------------------------------------


async def _cancel_builtin(state_dir: pathlib.Path) -> list[float]:
    samples = []
    async with supervisor(state_dir, limit=8) as sup:
        for n in range(BUILTIN_CANCELS):
            invocation_id = f"c{n}"
            await sup.submit(request(invocation_id, "sleep", seconds=60))
            await wait_until(
                lambda i=invocation_id: sup.get(i).state is InvocationState.running  # type: ignore[misc]
            )
            start = time.perf_counter()
            status = await sup.cancel(invocation_id)
            samples.append(time.perf_counter() - start)
            assert status.state is InvocationState.cancelled
    return samples


async def _cancel_bare_task() -> list[float]:
    samples = []
    for _ in range(BUILTIN_CANCELS):
        ended = trio.Event()

        async def sleeper(scope_box: list[trio.CancelScope], ended: trio.Event = ended) -> None:
            try:
                with trio.CancelScope() as scope:
                    scope_box.append(scope)
                    await trio.sleep(60)
            finally:
                ended.set()

        box: list[trio.CancelScope] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sleeper, box)
            await trio.testing.wait_all_tasks_blocked()
            start = time.perf_counter()
            box[0].cancel()
            await ended.wait()
            samples.append(time.perf_counter() - start)
    return samples


async def _cancel_process(state_dir: pathlib.Path) -> list[float]:
    samples = []
    async with supervisor(state_dir, limit=8) as sup:
        for n in range(PROCESS_CANCELS):
            invocation_id = f"p{n}"
            await sup.submit(
                InvocationRequest(
                    id=invocation_id,
                    work=ProcessWork(argv=["sleep", "60"]),
                    requirement=Requirement.CPU,
                    resources=Resources(cpu_millis=1, memory_bytes=64 * 2**20),
                )
            )
            await wait_until(lambda i=invocation_id: _process_recorded(sup, i))  # type: ignore[misc]
            start = time.perf_counter()
            status = await sup.cancel(invocation_id)
            samples.append(time.perf_counter() - start)
            assert status.state is InvocationState.cancelled
    return samples


def _process_recorded(sup: Supervisor, invocation_id: str) -> bool:
    processes = sup.machine.journal.processes().values()
    return any(p.reservation_id == invocation_id for p in processes)


async def _cancel_bare_process() -> list[float]:
    samples = []
    for _ in range(PROCESS_CANCELS):
        async with trio.open_nursery() as nursery:
            proc = await nursery.start(trio.run_process, ["sleep", "60"])
            await trio.sleep(0.01)  # like the supervisor's wait for the start record
            start = time.perf_counter()
            nursery.cancel_scope.cancel()
        samples.append(time.perf_counter() - start)
        assert proc.returncode is not None
    return samples


# -- memory -------------------------------------------------------------------------------


async def _memory(state_dir: pathlib.Path) -> float:
    async with supervisor(state_dir, limit=CONCURRENT) as sup:
        await sup.submit(request("warm"))
        await wait_until(lambda: sup.get("warm").state in TERMINAL)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for n in range(CONCURRENT):
                await sup.submit(request(f"m{n}", "sleep", seconds=3600))
            counts = sup.counts
            await wait_until(lambda: counts()[InvocationState.running] == CONCURRENT)
            after = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
    return (after - before) / CONCURRENT


async def _bare_memory() -> float:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        async with trio.open_nursery() as nursery:
            for _ in range(CONCURRENT):
                nursery.start_soon(trio.sleep, 3600)
            await trio.testing.wait_all_tasks_blocked()
            after = tracemalloc.get_traced_memory()[0]
            nursery.cancel_scope.cancel()
    finally:
        tracemalloc.stop()
    return (after - before) / CONCURRENT


# -- findings -----------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _latency(samples: list[float]) -> str:
    return f"median {_ms(median(samples))}, p99 {_ms(percentile(samples, 99))}"


def _in(base: str | None, fn: Callable[[pathlib.Path], Awaitable[object]]) -> object:
    with tempfile.TemporaryDirectory(dir=base) as state:
        return trio.run(fn, pathlib.Path(state))


def run() -> list[Finding]:
    bare_rate = trio.run(_bare_throughput)
    disk_rate = _in(None, _throughput)
    tmpfs_rate = _in(SHM, _throughput)
    assert isinstance(disk_rate, float) and isinstance(tmpfs_rate, float)
    findings = [
        Finding(
            name="no-op builtin invocations/s, journal on disk (fsync)",
            target=">= 100/s end to end (two fsyncs each: reserve and release)",
            figures={
                "supervisor": f"{disk_rate:,.0f}/s ({1e3 / disk_rate:.2f} ms each)",
                "bare nursery": f"{bare_rate:,.0f}/s",
                "overhead": f"{bare_rate / disk_rate:,.0f}x slower than bare tasks",
            },
            ratio=bare_rate / disk_rate,
            met=disk_rate >= 100,
        ),
        Finding(
            name="no-op builtin invocations/s, journal on tmpfs",
            target=">= 1,000/s (supervisor overhead <= 1 ms per invocation)",
            figures={
                "supervisor": f"{tmpfs_rate:,.0f}/s ({1e3 / tmpfs_rate:.2f} ms each)",
                "bare nursery": f"{bare_rate:,.0f}/s",
                "overhead": f"{bare_rate / tmpfs_rate:,.0f}x slower than bare tasks",
            },
            ratio=bare_rate / tmpfs_rate,
            met=tmpfs_rate >= 1000,
        ),
    ]

    sup_cancel = _in(None, _cancel_builtin)
    bare_cancel = trio.run(_cancel_bare_task)
    assert isinstance(sup_cancel, list)
    findings.append(
        Finding(
            name="cancel to released, builtin sleep",
            target="p99 <= 20 ms (includes the journaled release)",
            figures={"supervisor": _latency(sup_cancel), "bare task": _latency(bare_cancel)},
            ratio=median(sup_cancel) / median(bare_cancel),
            met=percentile(sup_cancel, 99) <= 0.020,
        )
    )
    sup_proc = _in(None, _cancel_process)
    bare_proc = trio.run(_cancel_bare_process)
    assert isinstance(sup_proc, list)
    findings.append(
        Finding(
            name="cancel to released, process `sleep 60`",
            target="median <= 2x bare trio.run_process kill + 20 ms; p99 <= 200 ms",
            figures={
                "supervisor": _latency(sup_proc),
                "bare run_process": _latency(bare_proc),
            },
            ratio=median(sup_proc) / median(bare_proc),
            met=median(sup_proc) <= 2 * median(bare_proc) + 0.020
            and percentile(sup_proc, 99) <= 0.200,
        )
    )
    per_invocation = _in(SHM, _memory)
    bare_per_task = trio.run(_bare_memory)
    assert isinstance(per_invocation, float)
    findings.append(
        Finding(
            name=f"memory per sleeping builtin invocation ({CONCURRENT} concurrent)",
            target="<= 16 KiB of traced Python memory per invocation",
            figures={
                "supervisor": f"{per_invocation / 1024:.1f} KiB",
                "bare task": f"{bare_per_task / 1024:.1f} KiB",
            },
            ratio=per_invocation / bare_per_task,
            met=per_invocation <= 16 * 1024,
        )
    )
    return findings
