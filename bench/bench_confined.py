"""Confined `true` against bare process starts, side by side in one run:

- the start chain, step by step: bare `true`; bwrap with a guest's namespaces and
  mounts (with and without its network namespace); the same behind litegraph-gate
  (the gate and the uid drop in one exec) and behind the gate shell and setpriv it
  replaced; each run sequentially from this process, with the wall time and the
  CPU the children used;
- through the HTTP API (a `serve` subprocess on sim devices, this process the
  client): confined `true`, one at a time (submit, then wait until ended) and 16 at
  a time (batches of 16 + wait), with sandboxes made ahead (`--sandbox-pool`) and
  without; the CPU the daemon and its guests used per start;
- against bare `trio.run_process(["true"])` and a bare bwrap start with the same
  namespaces, one at a time and 16 at once;
- cancel to reuse: DELETE of a `sleep` process holding every CPU until the next
  such process runs, median and worst.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence

import httpx
import psutil
import trio

from bench.bench_api import serve
from bench.harness import Finding, median
from supervisor.gate import find_gate
from supervisor.launch import GATE_SHELL, find_setpriv, uid_drop
from supervisor.sandbox import SandboxSpec, bwrap_argv, find_bwrap

CHAIN_N = 200
SEQUENTIAL_N = 100
CONCURRENT_N = 256
CONCURRENCY = 16
CANCELS = 12
GUEST_UID = 300999
TRUE = shutil.which("true", path="/usr/bin:/bin") or "/bin/true"


def _children_cpu() -> float:
    times = os.times()
    return times.children_user + times.children_system


def _chain(argv: Sequence[str], gate: bool, n: int = CHAIN_N) -> tuple[float, float]:
    """(wall ms, CPU ms) per start of `argv`, one at a time; `gate` feeds its line."""
    subprocess.run(argv, input=b"\n" if gate else None, check=True, cwd="/")
    cpu, start = _children_cpu(), time.perf_counter()
    for _ in range(n):
        subprocess.run(argv, input=b"\n" if gate else None, check=True, cwd="/")
    return (time.perf_counter() - start) / n * 1e3, (_children_cpu() - cpu) / n * 1e3


def _bwrap(network: bool = True) -> list[str]:
    spec = SandboxSpec(bwrap=find_bwrap("bwrap"), isolate_network=network, tmp_bytes=16 * 2**20)
    return bwrap_argv(spec, [TRUE])


def chain_steps() -> dict[str, tuple[float, float]]:
    steps = {
        "true": _chain([TRUE], False),
        "bwrap, no network namespace": _chain(_bwrap(network=False), False),
        "bwrap": _chain(_bwrap(), False),
    }
    gate = find_gate()
    if gate is not None:
        steps["litegraph-gate + uid drop + bwrap"] = _chain(
            [str(gate), "gate", "-u", str(GUEST_UID), "--", *_bwrap()], True
        )
    setpriv = find_setpriv()
    if setpriv is not None:
        steps["gate shell + setpriv + bwrap"] = _chain(
            [*GATE_SHELL, *uid_drop(setpriv, GUEST_UID), *_bwrap()], True
        )
    return steps


async def _bare(argv: list[str], total: int, concurrency: int) -> tuple[float, float]:
    """(starts/s, CPU ms per start) of `argv` through trio.run_process."""
    jobs = iter(range(total))

    async def worker() -> None:
        for _ in jobs:
            await trio.run_process(argv, cwd="/")

    cpu, start = _children_cpu(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    took = time.perf_counter() - start
    return total / took, (_children_cpu() - cpu) / total * 1e3


def _true(invocation_id: str) -> dict[str, object]:
    return {
        "id": invocation_id,
        "work": {"kind": "process", "argv": ["true"]},
        "resources": {"cpu_millis": 20, "memory_bytes": 16 * 2**20},
    }


def _daemon_cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system + times.children_user + times.children_system)


async def _api(
    url: str, secret: str, pid: int, prefix: str, total: int, batch: int
) -> tuple[float, float]:
    """(starts/s, daemon and guest CPU ms per start): batches of `batch` + wait."""
    headers = {"Authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=70) as client:

        async def one_batch(first: int) -> None:
            ids = [f"{prefix}-{i}" for i in range(first, min(total, first + batch))]
            if batch == 1:
                assert (await client.post("/v1/invocations", json=_true(ids[0]))).status_code == 202
            else:
                reply = await client.post(
                    "/v1/invocations:batch", json={"invocations": [_true(i) for i in ids]}
                )
                assert all(r["status"] == 202 for r in reply.json()["results"])
            pending = ids
            while pending:
                waited = await client.post(
                    "/v1/invocations:wait", json={"ids": pending, "timeout_s": 60}
                )
                pending = waited.json()["pending"]

        await one_batch(-batch)  # warm-up: the first start of its shape fills the pool
        await trio.sleep(0.5)
        cpu, start = _daemon_cpu(pid), time.perf_counter()
        for first in range(0, total, batch):
            await one_batch(first)
        took = time.perf_counter() - start
    return total / took, (_daemon_cpu(pid) - cpu) / total * 1e3


def _sleeper(invocation_id: str, cpu_millis: int) -> dict[str, object]:
    return {
        "id": invocation_id,
        "work": {"kind": "process", "argv": ["sleep", "60"]},
        "resources": {"cpu_millis": cpu_millis, "memory_bytes": 16 * 2**20},
    }


async def _cancel_to_reuse(url: str, secret: str) -> list[float]:
    headers = {"Authorization": f"Bearer {secret}"}
    took: list[float] = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
        snapshot = (await client.get("/v1/snapshot")).json()
        cpu = snapshot["capacity"]["cpu_millis"]["allocatable"]

        async def running(invocation_id: str) -> None:
            with trio.fail_after(30):
                while (await client.get(f"/v1/invocations/{invocation_id}")).json()[  # noqa: ASYNC110
                    "state"
                ] != "running":
                    await trio.sleep(0.0005)

        for n in range(CANCELS + 2):
            body = _sleeper(f"w{n}", cpu)
            if n == 0:
                assert (await client.post("/v1/invocations", json=body)).status_code == 202
                await running("w0")
                await trio.sleep(0.3)  # the pool makes the shape's next sandbox
                continue
            start = time.perf_counter()
            await client.delete(f"/v1/invocations/w{n - 1}")
            assert (await client.post("/v1/invocations", json=body)).status_code == 202
            await running(f"w{n}")
            if n > 1:  # the first reuse warms the path
                took.append(time.perf_counter() - start)
            await trio.sleep(0.3)
        await client.delete(f"/v1/invocations/w{CANCELS + 1}")
    return took


def _with_daemon(extra: Sequence[str], measure: Callable[[str, str, int], object]) -> object:
    with tempfile.TemporaryDirectory() as tmp, serve(pathlib.Path(tmp), *extra) as served:
        proc, url, secret = served
        return measure(url, secret, proc.pid)


def _api_figures(pool: int) -> dict[str, tuple[float, float] | list[float]]:
    def measure(url: str, secret: str, pid: int) -> dict[str, tuple[float, float] | list[float]]:
        return {
            "sequential": trio.run(_api, url, secret, pid, "s", SEQUENTIAL_N, 1),
            "concurrent": trio.run(_api, url, secret, pid, "c", CONCURRENT_N, CONCURRENCY),
            "cancel": trio.run(_cancel_to_reuse, url, secret),
        }

    found = _with_daemon(("--sandbox-pool", str(pool), "--max-running", "64"), measure)
    assert isinstance(found, dict)
    return found


def _ms(value: float) -> str:
    return f"{value:.2f} ms"


# What run() measured, for notes().
_MEASURED: dict[str, object] = {}


def run() -> list[Finding]:
    steps = chain_steps()
    bare_seq = trio.run(_bare, [TRUE], SEQUENTIAL_N, 1)
    bare_par = trio.run(_bare, [TRUE], CONCURRENT_N, CONCURRENCY)
    bwrap_seq = trio.run(_bare, _bwrap(), SEQUENTIAL_N, 1)
    bwrap_par = trio.run(_bare, _bwrap(), CONCURRENT_N, CONCURRENCY)
    pooled = _api_figures(4)
    direct = _api_figures(0)
    _MEASURED.update(steps=steps, pooled=pooled, direct=direct, bare=bare_par, bwrap=bwrap_par)
    chain = "; ".join(
        f"{name}: {_ms(wall)} wall, {_ms(cpu)} CPU" for name, (wall, cpu) in steps.items()
    )
    findings = [
        Finding(
            name="the start chain, one step at a time (sequential, from this process)",
            target="reference: what each exec of a confined start costs",
            figures={"steps": chain},
            ratio=steps["bwrap"][1] / max(steps["true"][1], 1e-9),
            met=True,
        )
    ]
    for label, key, bare, bw in (
        ("one at a time", "sequential", bare_seq, bwrap_seq),
        (f"{CONCURRENCY} at a time", "concurrent", bare_par, bwrap_par),
    ):
        ready, made = pooled[key], direct[key]
        assert isinstance(ready, tuple) and isinstance(made, tuple)
        findings.append(
            Finding(
                name=f"confined `true` through the API, {label}, vs bare trio.run_process",
                target=">= 0.5x bare run_process's starts/s",
                figures={
                    "ready sandboxes": f"{ready[0]:,.0f}/s, {_ms(ready[1])} CPU each",
                    "made at the start": f"{made[0]:,.0f}/s, {_ms(made[1])} CPU each",
                    "bare run_process": f"{bare[0]:,.0f}/s, {_ms(bare[1])} CPU each",
                    "bare bwrap": f"{bw[0]:,.0f}/s, {_ms(bw[1])} CPU each",
                },
                ratio=ready[0] / bare[0],
                met=ready[0] >= 0.5 * bare[0],
            )
        )
        findings.append(
            Finding(
                name=f"CPU per confined start, {label}, vs a bare bwrap start",
                target="<= 1.5x a bare bwrap start's CPU",
                figures={
                    "confined (ready sandboxes)": _ms(ready[1]),
                    "confined (made at the start)": _ms(made[1]),
                    "bare bwrap": _ms(bw[1]),
                },
                ratio=ready[1] / bw[1],
                met=ready[1] <= 1.5 * bw[1],
            )
        )
    ready_cancel, made_cancel = pooled["cancel"], direct["cancel"]
    assert isinstance(ready_cancel, list) and isinstance(made_cancel, list)
    findings.append(
        Finding(
            name="cancel to reuse: DELETE of a process holding every CPU until the next runs",
            target="median <= 10 ms",
            figures={
                "ready sandboxes": f"median {_ms(median(ready_cancel) * 1e3)}, worst "
                f"{_ms(max(ready_cancel) * 1e3)} of {len(ready_cancel)}",
                "made at the start": f"median {_ms(median(made_cancel) * 1e3)}, worst "
                f"{_ms(max(made_cancel) * 1e3)} of {len(made_cancel)}",
            },
            ratio=median(ready_cancel) * 1e3 / 10,
            met=median(ready_cancel) <= 0.010,
        )
    )
    return findings


def notes(findings: list[Finding]) -> list[str]:
    """What bounds each missed target, from the figures measured."""
    steps = _MEASURED["steps"]
    pooled = _MEASURED["pooled"]
    bare = _MEASURED["bare"]
    assert isinstance(steps, dict) and isinstance(pooled, dict) and isinstance(bare, tuple)
    true_cpu = steps["true"][1]
    bwrap_cpu = steps["bwrap"][1]
    no_net = steps["bwrap, no network namespace"][1]
    out = [
        f"The start chain, per start: `true` alone {_ms(true_cpu)} of CPU; bwrap with a guest's"
        f" namespaces and mounts {_ms(bwrap_cpu)}, of which its network namespace"
        f" {_ms(bwrap_cpu - no_net)} (a pre-made loopback-only namespace handed to each guest"
        " would save about that, but bubblewrap cannot join one, so the guest would have to"
        " enter it through another exec before bwrap)."
    ]
    gated = steps.get("litegraph-gate + uid drop + bwrap")
    shelled = steps.get("gate shell + setpriv + bwrap")
    if gated is not None and shelled is not None:
        out.append(
            f"litegraph-gate adds {_ms(gated[1] - bwrap_cpu)} of CPU to bwrap's where the gate"
            f" shell and setpriv added {_ms(shelled[1] - bwrap_cpu)}."
        )
    for finding in findings:
        if finding.met or finding.name.startswith("the start chain"):
            continue
        if finding.name.startswith("confined `true`"):
            key = "sequential" if "one at a time" in finding.name else "concurrent"
            _rate, cpu = pooled[key]
            out.append(
                f"Missed: {finding.name} at {finding.ratio:.2f}x. Each confined start costs"
                f" {_ms(cpu)} of CPU in all (the daemon's HTTP, admission, journal, token,"
                f" cgroups in each hierarchy and its guest's chain), against {_ms(bare[1])}"
                f" for a bare start; bwrap alone is {_ms(bwrap_cpu)}, so two cores allow at"
                f" most {2000 / bwrap_cpu:,.0f} sandboxed starts/s before the daemon does any"
                " work: the sandbox's namespaces and mounts bound this target."
            )
        elif finding.name.startswith("CPU per confined start"):
            out.append(
                f"Missed: {finding.name} at {finding.ratio:.2f}x. Beyond bwrap's own, the daemon"
                " spends its share on the request (HTTP, admission, three journal records, the"
                " token's signature), the cgroups (made, limited and removed in each v1"
                " hierarchy) and the guest's ending (its cgroup read, its usage, the release)."
                " Ready sandboxes move the cgroups and the sandbox off the request's path, not"
                " off the CPU."
            )
        elif finding.name.startswith("cancel to reuse"):
            out.append(
                f"Missed: {finding.name} at {finding.ratio * 10:.1f} ms median: the cancel"
                " waits for the guest to end (SIGTERM, the sandbox's exit) and its cgroup to"
                " be emptied, read and removed before the reservation is released and the"
                " next unit admitted."
            )
    return out
