"""MIG through NVML as the driver answers (the fake): an unreadable instance, a
parent whose aggregate memory needs privileges, the profile name, and XIDs
attributed to the instance they name."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from machine import Machine
from machine.discovery import discover
from machine.health import HealthState
from machine.inventory import Inventory
from machine.lanes import LaneKind, build_lanes
from tests.fakes.fake_pynvml import FakeMig, FakeNvml, gpu_and_mig

GiB = 1 << 30


async def nvml_inventory(fake: FakeNvml) -> Inventory:
    return await discover("nvml", pynvml_module=fake, nvml_call_timeout=5.0)


async def close(inv: Inventory) -> None:
    assert inv.source is not None
    await inv.source.aclose()


def broken(mig: FakeMig, how: str) -> None:
    if how == "gone":
        mig.gone = True  # destroyed mid-scan: NotFound on every call
    elif how == "memory":
        mig.errors["nvmlDeviceGetMemoryInfo"] = pynvml.NVML_ERROR_NO_PERMISSION
    else:
        mig.errors["nvmlDeviceGetUUID"] = pynvml.NVML_ERROR_UNKNOWN


@pytest.mark.parametrize("how", ["gone", "memory", "uuid"])
async def test_one_unreadable_mig_instance_is_skipped_with_a_note(how: str) -> None:
    fake = gpu_and_mig()
    broken(fake.gpus[1].migs[0], how)
    inv = await nvml_inventory(fake)
    assert inv.backend == "nvml" and inv.readiness_reasons == ()
    assert [g.uuid for g in inv.gpus] == ["GPU-a", "GPU-b"]
    b = inv.gpus[1]
    assert b.mig_enabled and [m.uuid for m in b.mig_instances] == ["MIG-b2"]
    assert any(n.startswith("mig_unreadable: GPU-b: slot 0: ") for n in inv.notes), inv.notes
    lanes = build_lanes(inv)
    assert [(lane.kind, lane.visible_uuid) for lane in lanes[1:]] == [
        (LaneKind.GPU, "GPU-a"),
        (LaneKind.MIG, "MIG-b2"),
    ]
    await close(inv)


async def test_a_minor_number_error_stays_with_its_gpu() -> None:
    fake = gpu_and_mig()
    fake.gpus[0].errors["nvmlDeviceGetMinorNumber"] = pynvml.NVML_ERROR_UNKNOWN
    inv = await nvml_inventory(fake)
    assert inv.backend == "nvml"
    a, b = inv.gpus
    assert (a.minor_number, a.memory_total_bytes, b.minor_number) == (None, 80 * GiB, 1)
    assert "gpu_field_unreadable: GPU-a: minor_number: Unknown Error" in inv.notes
    await close(inv)


async def test_a_mig_parent_refusing_its_memory_keeps_mig_and_sums_its_instances() -> None:
    fake = gpu_and_mig()
    fake.gpus[1].mig_memory_refused = True  # an unprivileged caller, v1 and v2 alike
    inv = await nvml_inventory(fake)
    b = inv.gpus[1]
    assert b.mig_enabled and [m.uuid for m in b.mig_instances] == ["MIG-b1", "MIG-b2"]
    assert (b.memory_total_bytes, b.memory_used_bytes, b.memory_free_bytes) == (
        25 * GiB,
        3 * GiB,
        22 * GiB,
    )
    assert any(n.startswith("mig_parent_memory: GPU-b: ") for n in inv.notes), inv.notes
    assert [lane.visible_uuid for lane in build_lanes(inv)[2:]] == ["MIG-b1", "MIG-b2"]
    probe = next(p for p in inv.probes if p.device_id == "GPU-b")
    assert probe.status.value == "ok", probe.error
    assert (probe.memory_used_bytes, probe.memory_free_bytes) == (3 * GiB, 22 * GiB)
    await close(inv)


async def test_a_mig_parent_refusing_v1_memory_reads_v2() -> None:
    fake = gpu_and_mig()
    b = fake.gpus[1]
    b.errors["nvmlDeviceGetMemoryInfo"] = pynvml.NVML_ERROR_NO_PERMISSION
    b.memory_reserved = GiB // 2
    inv = await nvml_inventory(fake)
    found = inv.gpus[1]
    assert found.mig_enabled and len(found.mig_instances) == 2
    assert found.memory_total_bytes == b.memory_total
    await close(inv)


async def test_the_mig_profile_is_the_bare_profile_name() -> None:
    inv = await nvml_inventory(gpu_and_mig())
    # NVML names the instance "NVIDIA Fake A100 40GB MIG 3g.20gb"; dcgm's GPU_I_PROFILE
    # (and so the snapshot's profile) is the profile alone.
    assert [m.name for m in inv.gpus[1].mig_instances] == ["3g.20gb", "1g.5gb"]
    await close(inv)


async def open_machine(state: Path, fake: FakeNvml) -> Machine:
    return await Machine.open(
        node_id="node-m",
        devices="nvml",
        sim_file=None,
        state_dir=state,
        reserved_cpu_millis=0,
        reserved_memory_bytes=0,
        vram_headroom_bytes=0,
        pynvml_module=fake,
    )


async def test_a_mig_instances_fatal_xid_makes_only_its_lane_unhealthy(tmp_path: Path) -> None:
    fake = gpu_and_mig()
    fake.gpus[1].ecc_uncorrected = 1
    machine = await open_machine(tmp_path, fake)
    try:
        ledger = machine.ledger
        lane = {lane.visible_uuid: lane.lane_id for lane in ledger.lanes()}
        fake.push_xid("MIG-b1", 94)  # a contained ECC error in one instance
        await machine.probe()
        assert ledger.lane_health(lane["MIG-b1"]) is HealthState.UNHEALTHY
        assert ledger.lane_health(lane["MIG-b2"]) is HealthState.HEALTHY
        assert machine.health.state("GPU-b") is HealthState.HEALTHY
        shown = {s.mig_uuid: s for s in machine.snapshot().lanes if s.mig_uuid}
        assert shown["MIG-b1"].health is HealthState.UNHEALTHY
        assert "xid_94" in (shown["MIG-b1"].health_reason or "")
        assert shown["MIG-b2"].health is HealthState.HEALTHY
        # Good readings do not heal it; the GPU's reset does (the volatile count drops).
        await machine.probe()
        assert ledger.lane_health(lane["MIG-b1"]) is HealthState.UNHEALTHY
        fake.gpus[1].ecc_uncorrected = 0
        await machine.probe()
        assert ledger.lane_health(lane["MIG-b1"]) is HealthState.UNKNOWN
        for _ in range(3):
            await machine.probe()
        assert ledger.lane_health(lane["MIG-b1"]) is HealthState.HEALTHY
        # An event for the whole GPU (no instance named) takes every instance down.
        fake.push_xid("GPU-b", 79)
        await machine.probe()
        assert ledger.lane_health(lane["MIG-b1"]) is HealthState.UNHEALTHY
        assert ledger.lane_health(lane["MIG-b2"]) is HealthState.UNHEALTHY
        assert ledger.lane_health(lane["GPU-a"]) is HealthState.HEALTHY
    finally:
        await machine.aclose()


async def test_mig_lanes_without_their_capability_nodes_are_out_of_service(
    tmp_path: Path,
) -> None:
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    (proc / "driver/nvidia/capabilities").mkdir(parents=True)  # only in /proc
    dev.mkdir()
    machine = await Machine.open(
        node_id="node-m",
        devices="nvml",
        sim_file=None,
        state_dir=tmp_path / "state",
        reserved_cpu_millis=0,
        reserved_memory_bytes=0,
        vram_headroom_bytes=0,
        pynvml_module=gpu_and_mig(),
        dev_root=dev,
        proc_root=proc,
    )
    try:
        shown = {s.mig_uuid or s.device_id: s for s in machine.snapshot().lanes}
        for uuid in ("MIG-b1", "MIG-b2"):
            assert shown[uuid].health is HealthState.UNHEALTHY
            assert (shown[uuid].health_reason or "").startswith("mig_caps_procfs: ")
        assert shown["GPU-a"].health is HealthState.HEALTHY
        allocatable = {u.lane_id: u.available for u in machine.ledger.capacity().lanes}
        assert allocatable[shown["MIG-b1"].lane_id] is False
        assert allocatable[shown["GPU-a"].lane_id] is True
    finally:
        await machine.aclose()
