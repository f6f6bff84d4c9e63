"""/metrics in dcgm-exporter's shape, one unit per family, counters that only grow,
build and process information; parsed with prometheus_client's own text parser."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from api.metrics import NodeMetrics
from machine import Machine
from machine.lanes import Isolation, Requirement
from machine.ledger import ReservationRequest
from supervisor.wire import InvocationState
from tests.fakes.fake_pynvml import FakeNvml, gpu_and_mig
from tests.supervisor_fixtures import builtin, open_rig

GiB = 1 << 30
MiB = 1 << 20
DCGM_LABELS = {"gpu", "UUID", "device", "modelName", "Hostname", "pci_bus_id"}
SIM_GPU = "GPU-5e1d0a3c-0000-4000-8000-5157a0000001"
SIM_MIG_GPU = "GPU-5e1d0a3c-0000-4000-8000-5157a0000002"


def scrape(metrics: NodeMetrics) -> dict[str, list[Sample]]:
    """Samples by family name (the parser rejects a malformed exposition)."""
    text = metrics.render().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def metrics_of(machine: Machine) -> NodeMetrics:
    metrics = NodeMetrics()
    metrics.snapshot = machine.snapshot
    return metrics


def series(samples: list[Sample], **labels: str) -> list[Sample]:
    """The samples with these labels (as in PromQL, a label left out equals "")."""
    return [s for s in samples if all(s.labels.get(k, "") == v for k, v in labels.items())]


def only(samples: list[Sample], **labels: str) -> float:
    (found,) = series(samples, **labels)
    return float(found.value)


async def open_machine(
    state: Path, *, devices: str = "sim", nvml: FakeNvml | None = None
) -> Machine:
    return await Machine.open(
        node_id="node-m",
        devices=devices,
        sim_file=None,
        state_dir=state,
        reserved_cpu_millis=1000,
        reserved_memory_bytes=GiB,
        vram_headroom_bytes=0,
        pynvml_module=nvml,
    )


async def test_nvml_gpus_and_mig_instances_in_dcgm_shape(tmp_path: Path) -> None:
    fake = gpu_and_mig()
    fake.gpus[0].unsupported.add("nvmlDeviceGetClockInfo")
    machine = await open_machine(tmp_path, devices="nvml", nvml=fake)
    try:
        fams = scrape(metrics_of(machine))
        a = {"UUID": "GPU-a", "gpu": "0", "device": "nvidia0", "modelName": "NVIDIA A100 80GB"}
        a |= {"Hostname": "node-m", "pci_bus_id": "00000000:01:00.0"}
        gpu_series = series(fams["DCGM_FI_DEV_FB_USED"], UUID="GPU-a")
        assert [s.labels for s in gpu_series] == [a]  # no GPU_I_* on a whole GPU
        assert only(fams["DCGM_FI_DEV_FB_USED"], UUID="GPU-a") == 1024  # MiB, as dcgm
        assert only(fams["DCGM_FI_DEV_FB_FREE"], UUID="GPU-a") == 79 * 1024
        assert only(fams["DCGM_FI_DEV_GPU_UTIL"], UUID="GPU-a") == 35
        assert only(fams["DCGM_FI_DEV_MEM_COPY_UTIL"], UUID="GPU-a") == 20
        assert only(fams["DCGM_FI_DEV_POWER_USAGE"], UUID="GPU-a") == 70
        assert only(fams["DCGM_FI_DEV_GPU_TEMP"], UUID="GPU-a") == 40
        assert only(fams["DCGM_FI_DEV_XID_ERRORS"], UUID="GPU-a") == 0
        for ecc in ("SBE_VOL", "DBE_VOL", "SBE_AGG", "DBE_AGG"):
            assert only(fams[f"DCGM_FI_DEV_ECC_{ecc}_TOTAL"], UUID="GPU-a") == 0
        # Clocks NVML does not support on GPU-a: absent, not 0; GPU-b has them.
        assert series(fams["DCGM_FI_DEV_SM_CLOCK"], UUID="GPU-a") == []
        assert only(fams["DCGM_FI_DEV_SM_CLOCK"], UUID="GPU-b", GPU_I_ID="") == 1410
        assert series(fams["DCGM_FI_DEV_MEM_CLOCK"], UUID="GPU-a") == []
        # MIG instances: their GPU's labels plus profile and instance id.
        mig = series(fams["DCGM_FI_DEV_FB_USED"], UUID="GPU-b", GPU_I_ID="2")
        assert len(mig) == 1 and mig[0].value == 3 * 1024
        assert mig[0].labels["GPU_I_PROFILE"] == "3g.20gb"
        assert mig[0].labels["device"] == "nvidia1" and set(mig[0].labels) >= DCGM_LABELS
        assert only(fams["DCGM_FI_DEV_FB_FREE"], UUID="GPU-b", GPU_I_ID="9") == 5 * 1024
        # NVML gives no utilization for a MIG instance, nor for a GPU in MIG mode: none.
        assert series(fams["DCGM_FI_DEV_GPU_UTIL"], UUID="GPU-b") == []
        for samples in fams.values():
            for sample in samples:
                if sample.name.startswith("DCGM_FI_"):
                    assert DCGM_LABELS <= set(sample.labels), sample
        fake.push_xid("GPU-a", 43)
        await machine.probe()
        fams = scrape(metrics_of(machine))
        assert only(fams["DCGM_FI_DEV_XID_ERRORS"], UUID="GPU-a") == 43
        assert only(fams["litegraph_gpu_xid_errors"], UUID="GPU-a") == 1
    finally:
        await machine.aclose()


async def test_unsupported_readings_are_absent_from_metrics(tmp_path: Path) -> None:
    fake = gpu_and_mig()
    fake.events_supported = False
    for call in ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetTotalEccErrors"):
        fake.gpus[0].unsupported.add(call)
    machine = await open_machine(tmp_path, devices="nvml", nvml=fake)
    try:
        fams = scrape(metrics_of(machine))
        for name in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"):
            assert series(fams[name], UUID="GPU-a") == [], name
        assert series(fams["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"], UUID="GPU-b", GPU_I_ID="") != []
        # XID events unavailable: no last XID and no XID count for any GPU.
        assert fams["DCGM_FI_DEV_XID_ERRORS"] == []
        assert fams["litegraph_gpu_xid_errors"] == []
        assert only(fams["litegraph_device_health"], device_id="GPU-a", state="healthy") == 1
    finally:
        await machine.aclose()


async def test_simulated_workstation_metrics(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    machine = await open_machine(tmp_path)
    try:
        fams = scrape(metrics_of(machine))
        gpu0 = {"UUID": SIM_GPU, "gpu": "0", "device": "nvidia0", "Hostname": "node-m"}
        assert only(fams["DCGM_FI_DEV_SM_CLOCK"], **gpu0) == 1695
        assert only(fams["DCGM_FI_DEV_FB_FREE"], **gpu0) == 24 * 1024
        assert only(fams["DCGM_FI_DEV_GPU_UTIL"], **gpu0) == 0
        migs = series(fams["DCGM_FI_DEV_FB_USED"], UUID=SIM_MIG_GPU, device="nvidia1")
        assert sorted(
            (s.labels.get("GPU_I_PROFILE", ""), s.labels.get("GPU_I_ID", "")) for s in migs
        ) == [
            ("", ""),
            ("1g.6gb", "10"),
            ("1g.6gb", "9"),
            ("2g.12gb", "5"),
        ]
        # One unit per family; `kind` says which amount.
        cpu = fams["litegraph_capacity_cpu_millis"]
        assert {s.labels["kind"] for s in cpu} == {"total", "reserved", "allocated", "allocatable"}
        assert only(cpu, kind="total") == 16000 and only(cpu, kind="allocatable") == 15000
        mem = fams["litegraph_capacity_memory_bytes"]
        assert only(mem, kind="total") == 64 * GiB and only(mem, kind="reserved") == GiB
        assert only(fams["litegraph_capacity_gpus"], kind="total") == 4  # GPU and MIG lanes
        vram = fams["litegraph_capacity_vram_bytes"]
        assert {s.labels["device_id"] for s in vram} == {SIM_GPU, SIM_MIG_GPU}
        assert "litegraph_resource_capacity" not in fams  # units are never mixed by a label
        assert only(fams["litegraph_host_memory_available_bytes"]) == 60 * GiB
        assert only(fams["litegraph_host_memory_total_bytes"]) == 64 * GiB
        (info,) = fams["litegraph_node_info"]
        assert info.labels == {
            "node_id": "node-m",
            "backend": "sim",
            "driver_version": "550.54.15-sim",
            "cuda_version": "12.4",
        }
    finally:
        await machine.aclose()


def test_build_info_and_process_metrics() -> None:
    fams = scrape(NodeMetrics())  # before the snapshot is wired: still a valid page
    (build,) = fams["litegraph_build_info"]
    assert build.value == 1 and set(build.labels) == {"version", "python", "implementation"}
    assert build.labels["version"] not in ("", "unknown")
    for name in (
        "process_cpu_seconds",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
    ):
        (sample, *_) = fams[name]
        assert sample.value > 0, name
    assert "python_info" in fams
    assert "DCGM_FI_DEV_GPU_UTIL" not in fams


async def test_ended_counter_only_grows_across_history_eviction(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_rig(tmp_path, retain_ended=2) as rig:
        metrics = NodeMetrics()
        metrics.snapshot = rig.machine.snapshot
        metrics.invocation_counts = rig.sup.counts
        metrics.ended_totals = rig.sup.ended_totals
        seen: list[float] = []
        for n in range(5):
            await rig.sup.submit(builtin(f"e{n}", "echo", text="x"))
            assert await rig.wait_terminal(f"e{n}") is InvocationState.succeeded
            fams = scrape(metrics)
            seen.append(only(fams["litegraph_invocations_ended"], state="succeeded"))
        assert seen == [1, 2, 3, 4, 5]  # the history keeps 2; the counter keeps counting
        assert len(rig.sup.list()) == 2
        await rig.sup.submit(builtin("f", "fail"))
        await rig.wait_terminal("f")
        fams = scrape(metrics)
        ended = fams["litegraph_invocations_ended"]
        assert only(ended, state="failed") == 1 and only(ended, state="succeeded") == 5
        assert {s.name for s in ended} == {"litegraph_invocations_ended_total"}
        assert {s.labels["state"] for s in ended} == {
            "succeeded",
            "failed",
            "cancelled",
            "timed_out",
        }
        await rig.sup.submit(builtin("s", "sleep", seconds=60))
        await rig.wait_state("s", InvocationState.running)
        active = scrape(metrics)["litegraph_invocations_active"]
        assert only(active, state="running") == 1 and only(active, state="queued") == 0
        assert "litegraph_invocations" not in scrape(metrics)  # the capped-history gauge


@pytest.mark.parametrize("devices", ["none"])
async def test_cpu_only_node_has_no_gpu_series(tmp_path: Path, devices: str) -> None:
    machine = await open_machine(tmp_path, devices=devices)
    try:
        fams = scrape(metrics_of(machine))
        assert fams["DCGM_FI_DEV_GPU_UTIL"] == [] and fams["litegraph_capacity_vram_bytes"] == []
        assert only(fams["litegraph_capacity_gpus"], kind="total") == 0
        assert only(fams["litegraph_host_memory_available_bytes"]) > 0
    finally:
        await machine.aclose()


async def test_vram_in_use_beyond_the_grants_is_a_metric_and_past_the_headroom_a_note(
    tmp_path: Path,
) -> None:
    fake = gpu_and_mig()
    machine = await open_machine(tmp_path, devices="nvml", nvml=fake)
    try:
        granted = machine.ledger.reserve(
            ReservationRequest(
                reservation_id="granted",
                requirement=Requirement.GPU,
                isolation=Isolation.SHARED,
                vram_bytes=4 * GiB,
            )
        )
        assert [g.device_id for g in granted.lanes] == ["GPU-a"]  # GPU-b is in MIG mode
        fams = scrape(metrics_of(machine))
        # GPU-a has 1 GiB in use and 4 GiB granted: 3 GiB granted and unused.
        assert only(fams["litegraph_vram_drift_bytes"], device_id="GPU-a") == -3 * GiB
        assert not [n for n in machine.snapshot().notes if n.startswith("vram_drift: GPU-a")]
        fake.gpus[0].memory_used = 6 * GiB  # a cache or a process the node never granted
        await machine.probe()
        fams = scrape(metrics_of(machine))
        assert only(fams["litegraph_vram_drift_bytes"], device_id="GPU-a") == 2 * GiB
        (note,) = [n for n in machine.snapshot().notes if n.startswith("vram_drift: GPU-a")]
        assert note.startswith("vram_drift: GPU-a has 2048 MiB in use beyond the 4096 MiB")
    finally:
        await machine.aclose()


async def test_simulated_gpus_have_no_vram_drift(tmp_path: Path) -> None:
    machine = await open_machine(tmp_path)
    try:
        assert series(scrape(metrics_of(machine))["litegraph_vram_drift_bytes"]) == []
    finally:
        await machine.aclose()
