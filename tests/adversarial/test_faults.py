"""Faults: the daemon killed mid-run, a lane owner that crashes, NVML failing mid-run,
and a scheduler that cannot be reached. Each ends with nothing leaked and nothing
reported healthier than it is."""

from __future__ import annotations

import errno
import os
import pathlib
import shutil
import signal
import socket
import threading
import time
from typing import Any

import httpx
import psutil  # type: ignore[import-untyped]
import pynvml
import pytest
import trio

from machine.journal import JOURNAL_FILENAME, Journal
from machine.monitor import probe_once
from tests.adversarial.fixtures import (
    GiB,
    Node,
    bearer,
    descendants,
    error_code,
    gpu_request,
    running_node,
    sleep_request,
    subprocess_node,
    wait_for_state,
)
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml
from tests.helpers import stop
from tests.lane_doubles import InProcessHost, InProcessHosts

pytestmark = pytest.mark.hostile("faults")


# --- SIGKILL: the journal holds exactly what was acknowledged ---------------------------


def _process(invocation_id: str) -> dict[str, Any]:
    return {
        "id": invocation_id,
        "work": {"kind": "process", "argv": ["/bin/sh", "-c", "sleep 300 & sleep 300"]},
        "resources": {"cpu_millis": 100, "memory_bytes": 256 * 2**20},
    }


def _journal_copy(state: pathlib.Path, into: pathlib.Path) -> tuple[set[str], set[int]]:
    """Replay a copy of the journal (replay may truncate a torn tail: not the original)."""
    into.mkdir(mode=0o700)
    shutil.copy2(state / JOURNAL_FILENAME, into / JOURNAL_FILENAME)
    os.chmod(into / JOURNAL_FILENAME, 0o600)
    journal, replay = Journal.open(into, durable=False)
    journal.close()
    return set(replay.reservations), set(replay.processes)


def _sleeps(pid: int) -> int:
    """The daemon's descendants running `sleep` (what `_process`'s shells start)."""
    count = 0
    for child in descendants(pid):
        try:
            count += pathlib.Path(child.cmdline()[0]).name == "sleep"
        except (psutil.Error, IndexError):
            continue
    return count


def _guests(pid: int) -> list[psutil.Process]:
    """The daemon's descendants but its lane hosts, which are up before it is ready."""
    out = []
    for child in descendants(pid):
        try:
            if "lanehost" not in child.cmdline():
                out.append(child)
        except psutil.Error:
            continue
    return out


def test_faults_sigkill_journal_holds_every_acknowledged_grant_then_restart_releases_all(
    tmp_path: pathlib.Path,
) -> None:
    state = tmp_path / "state"
    ids = ["p-1", "p-2", "b-1", "b-2", "g-1"]
    with (
        subprocess_node(state) as (proc, url, op),
        httpx.Client(base_url=url, headers=op, timeout=10) as client,
    ):
        baseline = client.get("/v1/snapshot").json()["capacity"]
        for body in (
            _process("p-1"),
            _process("p-2"),
            sleep_request("b-1"),
            sleep_request("b-2"),
            gpu_request("g-1"),
        ):
            reply = client.post("/v1/invocations", json=body)
            assert reply.status_code == 202, reply.text
        # A guest's argv runs only once its start is journaled: once both shells have
        # started their two sleeps, both process-started records are in.
        deadline = time.monotonic() + 10
        while _sleeps(proc.pid) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        orphans = _guests(proc.pid)
        assert len(orphans) >= 4
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    reservations, pids = _journal_copy(state, tmp_path / "copy")
    assert reservations == set(ids), "every 202 was journaled before it was answered"
    assert len(pids) == 2 and pids <= {o.pid for o in orphans}  # the two shells

    with (
        subprocess_node(state) as (proc, url, op),
        httpx.Client(base_url=url, headers=op, timeout=10) as client,
    ):
        _gone, alive = psutil.wait_procs(orphans, timeout=10)
        assert not alive, f"orphans left running: {alive}"
        assert client.get("/v1/snapshot").json()["capacity"] == baseline
        listed = client.get("/v1/invocations").json()["invocations"]
        # Nothing half-alive: each one the crash cut off is listed as ended with it.
        assert sorted(s["id"] for s in listed) == sorted(ids)
        assert {(s["state"], s["reason"]) for s in listed} == {("failed", "node_restarted")}
        # An id the crash cut off answers how it ended, and does not run again.
        again = client.post("/v1/invocations", json=sleep_request("b-1"))
        assert again.status_code == 202, again.text
        assert again.json()["state"] == "failed"
        assert client.get("/v1/invocations/b-1").json()["reason"] == "node_restarted"
        # A new id runs: no duplicate_reservation or other state was left behind.
        fresh = client.post("/v1/invocations", json=sleep_request("b-3"))
        assert fresh.status_code == 202, fresh.text
        assert client.delete("/v1/invocations/b-3").json()["state"] == "cancelled"
        assert stop(proc, signal.SIGTERM) == 0
    reservations, pids = _journal_copy(state, tmp_path / "copy2")
    assert reservations == set() and pids == set()


def test_faults_sigkill_during_64_concurrent_submissions_loses_no_acknowledged_grant(
    tmp_path: pathlib.Path,
) -> None:
    """Group commit: 64 submissions race, their reservations share fsyncs; the daemon is
    killed while some are still in flight. Every 202 it sent is in the journal."""
    state = tmp_path / "state"
    acked: list[str] = []
    lock = threading.Lock()
    with subprocess_node(state) as (proc, url, op):

        def submit(i: int) -> None:
            try:
                with httpx.Client(base_url=url, headers=op, timeout=10) as client:
                    reply = client.post("/v1/invocations", json=sleep_request(f"c-{i}"))
            except httpx.HTTPError:
                return  # cut off by the kill: never acknowledged
            if reply.status_code == 202:
                with lock:
                    acked.append(f"c-{i}")

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(64)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while len(acked) < 16 and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        for thread in threads:
            thread.join(timeout=15)
    with lock:
        answered = set(acked)
    assert len(answered) >= 16
    reservations, _pids = _journal_copy(state, tmp_path / "copy")
    assert answered <= reservations, f"acknowledged, not journaled: {answered - reservations}"


# --- a full disk: refused with Retry-After, not ready, nothing left half-written ----------


class _FullDisk:
    """os.write for the journal's descriptor: half the bytes land, then ENOSPC."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fd: int) -> None:
        self.fd, self.full, self._real = fd, True, os.write
        monkeypatch.setattr(os, "write", self.write)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        if fd != self.fd or not self.full:
            return self._real(fd, data)
        self._real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


async def test_faults_full_disk_refuses_with_retry_after_and_is_not_ready_until_it_writes(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running_node(tmp_path) as node:
        op = bearer(node.scheduler)
        assert (await node.client.get("/readyz")).status_code == 200
        machine = node.daemon.machine
        assert machine is not None
        disk = _FullDisk(monkeypatch, machine.journal._fd)
        for attempt in range(3):
            refused = await node.client.post(
                "/v1/invocations", json=sleep_request(f"full-{attempt}"), headers=op
            )
            assert refused.status_code == 503, refused.text
            assert error_code(refused) == "journal_unavailable"
            assert refused.headers["Retry-After"] == "5"
        ready = await node.client.get("/readyz")
        assert ready.status_code == 503
        assert "No space left" in ready.json()["error"]["details"]["reasons"]["journal"]
        disk.full = False  # space returns: the node takes its journal's reserve back
        with trio.fail_after(10):
            while (await node.client.get("/readyz")).status_code != 200:  # noqa: ASYNC110
                await trio.sleep(0.1)
        accepted = await node.client.post(
            "/v1/invocations", json=sleep_request("after", seconds=0.01), headers=op
        )
        assert accepted.status_code == 202, accepted.text
        assert (await node.client.get("/readyz")).status_code == 200
        await wait_for_state(node, "after")
    # Nothing half-written is left between the records: a restart replays all of them.
    journal, replay = Journal.open(tmp_path / "state", durable=False)
    journal.close()
    assert replay.problem is None and replay.reservations == {}


# --- lane owner crashes --------------------------------------------------------------------


def _faulted(owner: Any) -> bool:
    return bool(owner.faulted)


def _vram(capacity: dict[str, Any], lane: str) -> dict[str, Any]:
    return next(v for v in capacity["vram_bytes"] if v["lane_id"] == lane)


async def test_faults_tenants_crashing_their_sessions_end_alone_and_never_fault_the_lane(
    tmp_path: pathlib.Path, in_process_lane_hosts: None
) -> None:
    """The report: six crashes a minute by one tenant took the lane from everyone. Each
    crash now ends the crashing invocation's own lane session, and only it."""
    async with running_node(tmp_path) as running:
        holder = await running.submit(gpu_request("holder"))
        lane, kept = next(iter(holder["tokens"].items()))
        work = f"/v1/lanes/{lane}/work"
        reserve = {"op": "memory_reserve", "dtype": "uint8", "shape": [64]}
        assert (await running.client.post(work, json=reserve, headers=bearer(kept))).is_success
        sup = running.daemon.supervisor
        assert sup is not None
        owner = sup.owners[lane]
        for n in range(owner._max_restarts + 1):
            accepted = await running.submit(gpu_request(f"hostile-{n}"))
            token = accepted["tokens"][lane]
            boom = {"op": "execute", "kernel": "boom"}
            reply = await running.client.post(work, json=boom, headers=bearer(token))
            assert reply.status_code == 503 and error_code(reply) == "lane_session_failed"
            status = await wait_for_state(running, f"hostile-{n}")
            assert (status["state"], status["reason"]) == ("cancelled", "lane_session_failed")
        assert not _faulted(owner) and owner.held_by("holder") == 64
        noop = {"op": "execute", "kernel": "noop"}
        assert (await running.client.post(work, json=noop, headers=bearer(kept))).is_success
        snapshot = await running.snapshot()
        lane_view = next(item for item in snapshot["lanes"] if item["lane_id"] == lane)
        assert lane_view["health"] == "healthy"


async def test_faults_lane_host_failures_past_intensity_fault_the_lane(
    tmp_path: pathlib.Path, in_process_lane_hosts: None
) -> None:
    async with running_node(tmp_path) as running:
        baseline = await running.capacity()
        accepted = await running.submit(gpu_request("victim"))
        lane, token = next(iter(accepted["tokens"].items()))
        sup = running.daemon.supervisor
        assert sup is not None
        owner = sup.owners[lane]
        # A faulted lane is probed after 1 s: keep it out while this test looks at it.
        assert isinstance(owner._host_factory, InProcessHosts)
        owner._host_factory.refuse_starts = True
        sentinel = owner.sentinel
        assert isinstance(sentinel, InProcessHost)
        sentinel.die()  # its replacements then fail to start, past the limit
        status = await wait_for_state(running, "victim")
        assert (status["state"], status["reason"]) == ("cancelled", "lane_unhealthy")
        assert _faulted(owner)
        noop = {"op": "execute", "kernel": "noop"}
        after = await running.client.post(
            f"/v1/lanes/{lane}/work", json=noop, headers=bearer(token)
        )
        assert after.status_code in (401, 503), after.text  # revoked or lane_unhealthy
        snapshot = await running.snapshot()
        lane_view = next(item for item in snapshot["lanes"] if item["lane_id"] == lane)
        assert lane_view["health"] != "healthy"
        capacity = snapshot["capacity"]
        assert _vram(capacity, lane)["allocatable"] == 0
        assert _vram(capacity, lane)["allocated"] == 0
        assert capacity["gpus"]["allocatable"] == baseline["gpus"]["allocatable"] - 1
        assert capacity["cpu_millis"] == baseline["cpu_millis"]
        assert running.live_tokens() == 0 and running.ledger_reservations() == set()
        # New GPU work never lands on the faulted lane.
        for index in range(3):
            placed = await running.client.post(
                "/v1/invocations", json=gpu_request(f"after-{index}"), headers=running.op
            )
            if placed.status_code == 202:
                assert lane not in placed.json()["tokens"]
            else:
                assert placed.status_code == 409, placed.text


async def test_faults_lane_owner_crash_answers_a_documented_status(
    tmp_path: pathlib.Path, in_process_lane_hosts: None
) -> None:
    async with running_node(tmp_path) as running:
        accepted = await running.submit(gpu_request("victim"))
        lane, token = next(iter(accepted["tokens"].items()))
        reply = await running.client.post(
            f"/v1/lanes/{lane}/work",
            json={"op": "execute", "kernel": "crash"},
            headers=bearer(token),
        )
        assert reply.status_code == 503 and error_code(reply) == "lane_session_failed"


# --- NVML failing mid-run --------------------------------------------------------------------
# The fake NVML's GPUs get in-process lane hosts: a real host on a GPU the fake makes up
# cannot run CUDA, and would leave its lane faulted (cuda_unavailable) from the start,
# its lane work refused whatever NVML says.


def _fake_nvml() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu(uuid="GPU-aaaa", memory_total=40 * GiB),
            FakeGpu(uuid="GPU-bbbb", memory_total=40 * GiB, pci_bus_id="00000000:02:00.0"),
        ]
    )


async def _probe(running: Node) -> dict[str, str]:
    machine = running.daemon.machine
    assert machine is not None and machine.inventory.source is not None
    await probe_once(machine.inventory.source, machine.health, ledger=machine.ledger)
    snapshot = await running.snapshot()
    return {d["device_id"]: d["health"] for d in snapshot["devices"]}


def _device_lane(snapshot: dict[str, Any], device: str) -> str:
    return str(next(lane["lane_id"] for lane in snapshot["lanes"] if lane["device_id"] == device))


async def test_faults_gpu_lost_mid_run_leaves_allocatable_and_never_reads_healthy(
    tmp_path: pathlib.Path, in_process_lane_hosts: None
) -> None:
    fake = _fake_nvml()
    async with running_node(tmp_path, devices="nvml", pynvml_module=fake) as running:
        assert (await _probe(running)) == {"GPU-aaaa": "healthy", "GPU-bbbb": "healthy"}
        snapshot = await running.snapshot()
        lane_a = _device_lane(snapshot, "GPU-aaaa")
        accepted = await running.submit(gpu_request("on-a"))
        victim_lane = next(iter(accepted["tokens"]))
        victim_device = "GPU-aaaa" if victim_lane == lane_a else "GPU-bbbb"
        gpu = next(g for g in fake.gpus if g.uuid == victim_device)
        gpu.lost = True
        seen = [(await _probe(running))[victim_device]]
        assert seen[0] == "lost"
        status = await wait_for_state(running, "on-a")
        assert (status["state"], status["reason"]) == ("cancelled", "lane_unhealthy")
        token = accepted["tokens"][victim_lane]
        refused = await running.client.post(
            f"/v1/lanes/{victim_lane}/work",
            json={"op": "execute", "kernel": "noop"},
            headers=bearer(token),
        )
        assert refused.status_code in (401, 503)
        capacity = await running.capacity()
        assert _vram(capacity, victim_lane)["allocatable"] == 0
        assert capacity["gpus"]["allocatable"] == 1
        # Still gone: stays lost. Back, but its readings fail: unknown. Never healthy early.
        seen.append((await _probe(running))[victim_device])
        gpu.lost = False
        gpu.errors["*"] = pynvml.NVML_ERROR_UNKNOWN  # back, but it answers nothing
        seen.append((await _probe(running))[victim_device])
        seen.append((await _probe(running))[victim_device])
        gpu.errors.clear()
        for _ in range(2):
            seen.append((await _probe(running))[victim_device])
        assert "healthy" not in seen, seen
        assert seen[1] == "lost" and set(seen[2:]) <= {"unknown", "suspect", "lost"}
        assert _vram(await running.capacity(), victim_lane)["allocatable"] == 0
        placed = await running.client.post(
            "/v1/invocations", json=gpu_request("after"), headers=running.op
        )
        assert placed.status_code == 202 and victim_lane not in placed.json()["tokens"]


@pytest.mark.parametrize(
    "failure",
    [
        "nvmlDeviceGetTemperature",  # GPU requires a reset: says nothing can be read
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetRemappedRows",
        "*",  # every call fails
        "uninitialised",
    ],
)
async def test_faults_nvml_errors_mid_run_make_gpu_unknown_not_healthy(
    tmp_path: pathlib.Path, failure: str, in_process_lane_hosts: None
) -> None:
    fake = _fake_nvml()
    async with running_node(tmp_path, devices="nvml", pynvml_module=fake) as running:
        assert set((await _probe(running)).values()) == {"healthy"}
        baseline = await running.capacity()
        if failure == "uninitialised":
            fake.initialised = False  # every call raises NVMLError_Uninitialized
        elif failure == "*":
            fake.gpus[0].errors["*"] = pynvml.NVML_ERROR_UNKNOWN
        else:  # a device-level error on one call fails the whole reading
            fake.gpus[0].errors[failure] = pynvml.NVML_ERROR_RESET_REQUIRED
        health = await _probe(running)
        if failure == "uninitialised":
            assert set(health.values()) <= {"unknown", "lost"}
        else:
            assert health["GPU-aaaa"] in ("unknown", "lost") and health["GPU-bbbb"] == "healthy"
        capacity = await running.capacity()
        broken = [d for d, h in health.items() if h != "healthy"]
        snapshot = await running.snapshot()
        for device in broken:
            assert _vram(capacity, _device_lane(snapshot, device))["allocatable"] == 0
        assert capacity["gpus"]["allocatable"] == baseline["gpus"]["allocatable"] - len(broken)
        assert capacity["cpu_millis"] == baseline["cpu_millis"]


async def test_faults_a_field_nvml_refuses_mid_run_leaves_the_gpu_healthy_and_allocatable(
    tmp_path: pathlib.Path, in_process_lane_hosts: None
) -> None:
    fake = _fake_nvml()
    async with running_node(tmp_path, devices="nvml", pynvml_module=fake) as running:
        assert set((await _probe(running)).values()) == {"healthy"}
        baseline = await running.capacity()
        fake.gpus[0].errors["nvmlDeviceGetPowerUsage"] = pynvml.NVML_ERROR_NO_PERMISSION
        assert set((await _probe(running)).values()) == {"healthy"}
        assert (await running.capacity())["gpus"] == baseline["gpus"]
        machine = running.daemon.machine
        assert machine is not None
        reading = machine.health.last_reading("GPU-aaaa")
        assert reading is not None and reading.power_w is None
        assert reading.temperature_c == 40.0 and reading.unread == (
            "power_w: Insufficient Permissions",
        )


# --- scheduler unreachable ------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def _snapshot_latencies(running: Node, reads: int) -> list[float]:
    took = []
    for _ in range(reads):
        started = trio.current_time()
        reply = await running.client.get("/v1/snapshot", headers=running.op)
        took.append(trio.current_time() - started)
        assert reply.status_code == 200
        await trio.sleep(0.01)
    return took


async def test_faults_scheduler_closed_port_snapshot_stays_fast(tmp_path: pathlib.Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}/telemetry"
    async with running_node(
        tmp_path, "--scheduler-url", url, "--telemetry-interval", "0.05"
    ) as running:
        assert (await running.client.get("/readyz")).status_code == 200
        took = await _snapshot_latencies(running, 50)
        assert max(took) < 0.5, max(took)
        telemetry = running.daemon.telemetry
        assert telemetry is not None and telemetry.failures >= 1 and telemetry.sent == 0


async def test_faults_scheduler_blackhole_snapshot_stays_fast(tmp_path: pathlib.Path) -> None:
    """A scheduler that accepts connections and never answers."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    try:
        async with running_node(
            tmp_path,
            "--scheduler-url",
            f"http://127.0.0.1:{port}/telemetry",
            "--telemetry-interval",
            "0.05",
        ) as running:
            took = await _snapshot_latencies(running, 50)
            assert max(took) < 0.5, max(took)
            assert (await running.client.get("/readyz")).status_code == 200
    finally:
        listener.close()
