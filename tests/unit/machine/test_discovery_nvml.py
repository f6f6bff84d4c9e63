"""The NVML backend, driven through a fake pynvml module."""

from __future__ import annotations

import threading

import pynvml
import trio

from machine.discovery import discover
from machine.health import HealthState, HealthTracker, HealthTransition
from machine.inventory import Inventory, ProbeStatus
from machine.lanes import LaneKind, build_lanes, lane_id_for
from machine.monitor import probe_once
from tests.fakes.fake_pynvml import FakeGpu, FakeMig, FakeNvml, NVMLError_LibraryNotFound

GiB = 1 << 30


def two_gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu(uuid="GPU-aaaa", memory_total=80 * GiB, memory_used=GiB),
            FakeGpu(
                uuid="GPU-bbbb",
                pci_bus_id="00000000:02:00.0",
                mig_enabled=True,
                migs=[
                    FakeMig(
                        uuid="MIG-b1", profile="3g.40gb", memory_total=40 * GiB, gpu_instance_id=1
                    ),
                    FakeMig(
                        uuid="MIG-b2", profile="2g.20gb", memory_total=20 * GiB, gpu_instance_id=2
                    ),
                ],
            ),
        ]
    )


async def nvml_inventory(fake: FakeNvml) -> Inventory:
    return await discover("nvml", pynvml_module=fake, nvml_call_timeout=5.0)


async def test_healthy_gpu_and_mig_gpu() -> None:
    fake = two_gpus()
    inv = await nvml_inventory(fake)
    assert inv.backend == "nvml" and inv.readiness_reasons == ()
    assert inv.driver_version == "550.54.15" and inv.cuda_version == "12.4"
    a, b = inv.gpus
    assert (a.uuid, a.memory_total_bytes, a.memory_used_bytes) == ("GPU-aaaa", 80 * GiB, GiB)
    assert a.memory_free_bytes == 79 * GiB
    assert a.compute_capability == "8.0" and a.pci_bus_id == "00000000:01:00.0"
    assert not a.mig_enabled and b.mig_enabled
    assert [(m.uuid, m.memory_total_bytes, m.gpu_instance_id) for m in b.mig_instances] == [
        ("MIG-b1", 40 * GiB, 1),
        ("MIG-b2", 20 * GiB, 2),
    ]
    lanes = build_lanes(inv)
    assert [(lane.kind, lane.visible_uuid) for lane in lanes[1:]] == [
        (LaneKind.GPU, "GPU-aaaa"),
        (LaneKind.MIG, "MIG-b1"),
        (LaneKind.MIG, "MIG-b2"),
    ]
    # Real devices hold their own memory: never capped to the host's (140 GiB here).
    assert inv.vram_limit_bytes is None
    assert [(lane.vram_bytes, lane.declared_vram_bytes) for lane in lanes[1:]] == [
        (80 * GiB, None),
        (40 * GiB, None),
        (20 * GiB, None),
    ]
    first = {p.device_id: p for p in inv.probes}
    assert first["GPU-aaaa"].status is ProbeStatus.OK
    assert first["GPU-aaaa"].temperature_c == 40.0 and first["GPU-aaaa"].power_w == 70.0
    assert first["GPU-aaaa"].ecc_volatile_uncorrected == 0
    # Ampere and later do not retire pages (they remap rows): NotSupported, absent.
    assert first["GPU-aaaa"].retired_pages_pending is None
    assert first["GPU-aaaa"].remapped_rows_pending is False
    # Every NVML call ran off the trio thread.
    assert threading.main_thread().name not in fake.threads
    assert inv.source is not None
    await inv.source.aclose()
    assert fake.shutdowns == 1


async def test_not_supported_fields_are_absent() -> None:
    fake = FakeNvml(
        [
            FakeGpu(
                uuid="GPU-cccc",
                unsupported={
                    "nvmlDeviceGetPowerUsage",
                    "nvmlDeviceGetTotalEccErrors",
                    "nvmlDeviceGetRetiredPagesPendingStatus",
                    "nvmlDeviceGetRemappedRows",
                    "nvmlDeviceGetCudaComputeCapability",
                    "nvmlDeviceGetMigMode",
                    "nvmlDeviceGetPciInfo",
                },
            )
        ]
    )
    inv = await nvml_inventory(fake)
    gpu = inv.gpus[0]
    assert gpu.compute_capability is None and gpu.pci_bus_id is None and not gpu.mig_enabled
    probe = inv.probes[0]
    assert probe.status is ProbeStatus.OK
    assert probe.power_w is None and probe.ecc_volatile_uncorrected is None
    assert probe.retired_pages_pending is None and probe.remapped_rows_pending is None
    tracker = HealthTracker()
    tracker.register(gpu.uuid)
    tracker.observe(probe, at=0)
    assert tracker.state(gpu.uuid) is HealthState.HEALTHY
    assert inv.source is not None
    await inv.source.aclose()


async def test_energy_pcie_replays_and_remapped_row_counts_are_read() -> None:
    fake = two_gpus()
    a, b = fake.gpus
    a.energy_mj, a.pcie_replays, a.remapped_rows = 42_000_000, 3, (5, 1, 0, 0)
    b.unsupported.add("nvmlDeviceGetTotalEnergyConsumption")
    b.errors["nvmlDeviceGetPcieReplayCounter"] = pynvml.NVML_ERROR_NO_PERMISSION
    inv = await nvml_inventory(fake)
    first = {p.device_id: p for p in inv.probes}
    pa, pb = first["GPU-aaaa"], first["GPU-bbbb"]
    assert (pa.total_energy_mj, pa.pcie_replay_count) == (42_000_000, 3)
    assert (pa.remapped_rows_correctable, pa.remapped_rows_uncorrectable) == (5, 1)
    assert pa.remapped_rows_failed is False and pa.remapped_rows_pending is False
    # Not supported: absent; refused: absent with the reason; the rest is read.
    assert pb.status is ProbeStatus.OK and pb.total_energy_mj is None
    assert pb.pcie_replay_count is None
    assert pb.unread == ("pcie_replay_count: Insufficient Permissions",)
    assert pb.remapped_rows_correctable == 0 and pb.temperature_c == 40.0
    assert inv.source is not None
    await inv.source.aclose()


async def test_init_failure_leaves_no_lanes_and_a_reason() -> None:
    fake = FakeNvml([FakeGpu(uuid="GPU-dddd")], init_error=NVMLError_LibraryNotFound())
    for mode in ("auto", "nvml"):
        inv = await discover(mode, pynvml_module=fake)
        assert inv.gpus == () and inv.source is None
        assert inv.readiness_reasons[0].startswith("nvml_unavailable: ")
        assert [lane.kind for lane in build_lanes(inv)] == [LaneKind.CPU]


async def test_real_pynvml_without_a_driver_does_not_crash() -> None:
    inv = await discover("auto")
    if inv.backend == "nvml":  # a machine with a GPU: nothing to assert here
        assert inv.source is not None
        await inv.source.aclose()
        return
    assert inv.gpus == ()
    assert inv.readiness_reasons and inv.readiness_reasons[0].startswith(("nvml_", "no_gpus"))


async def test_no_gpus_is_a_reason() -> None:
    inv = await discover("auto", pynvml_module=FakeNvml([]))
    assert inv.gpus == () and inv.readiness_reasons[0].startswith("no_gpus")


async def test_gpu_lost_mid_run_and_xids() -> None:
    fake = two_gpus()
    inv = await nvml_inventory(fake)
    events: list[HealthTransition] = []
    tracker = HealthTracker(recovery_probes=2, on_transition=events.append)
    for gpu in inv.gpus:
        tracker.register(gpu.uuid)
    source = inv.source
    assert source is not None
    fake.push_xid("GPU-aaaa", 13)  # application: suspect at most
    await probe_once(source, tracker)
    assert tracker.state("GPU-aaaa") is HealthState.SUSPECT
    fake.gpus[1].ecc_uncorrected = 3
    fake.push_xid("GPU-bbbb", 79)  # fallen off the bus: fatal
    await probe_once(source, tracker)
    assert tracker.state("GPU-bbbb") is HealthState.UNHEALTHY
    fake.gpus[0].lost = True
    await probe_once(source, tracker)
    assert tracker.state("GPU-aaaa") is HealthState.LOST
    assert "device_lost" in tracker.health("GPU-aaaa").reasons[0]
    fake.gpus[0].errors["*"] = pynvml.NVML_ERROR_UNKNOWN
    fake.gpus[0].lost = False  # it comes back, but its readings fail: unknown
    await probe_once(source, tracker)
    assert tracker.state("GPU-aaaa") is HealthState.UNKNOWN
    fake.gpus[0].errors.clear()
    await probe_once(source, tracker)
    await probe_once(source, tracker)
    assert tracker.state("GPU-aaaa") is HealthState.HEALTHY
    # Good readings do not heal a fatal XID; a reset (NVML clears the volatile
    # ECC counters) does, followed by the good probes.
    assert tracker.state("GPU-bbbb") is HealthState.UNHEALTHY
    fake.gpus[1].ecc_uncorrected = 0
    await probe_once(source, tracker)
    assert tracker.state("GPU-bbbb") is HealthState.UNKNOWN
    await probe_once(source, tracker)
    assert tracker.state("GPU-bbbb") is HealthState.HEALTHY
    await source.aclose()


async def test_hung_nvml_call_times_out_as_unknown() -> None:
    fake = two_gpus()
    inv = await discover("nvml", pynvml_module=fake, nvml_call_timeout=0.2)
    assert inv.source is not None
    release = threading.Event()
    original = fake.nvmlDeviceGetTemperature

    def hang(handle: FakeGpu, sensor: int) -> int:
        release.wait(5)
        return original(handle, sensor)

    fake.nvmlDeviceGetTemperature = hang  # type: ignore[method-assign]
    probes = await inv.source.probe()
    release.set()
    assert {p.status for p in probes} == {ProbeStatus.FAILED}
    assert {p.error for p in probes} == {"nvml_timeout"}
    await trio.sleep(0.05)
    await inv.source.aclose()


async def test_pending_remap_and_over_temperature() -> None:
    fake = FakeNvml(
        [
            FakeGpu(uuid="GPU-eeee", remapped_rows=(0, 1, 1, 0)),
            FakeGpu(uuid="GPU-ffff", temperature=95, slowdown_temperature=90),
        ]
    )
    inv = await nvml_inventory(fake)
    tracker = HealthTracker()
    for probe in inv.probes:
        tracker.register(probe.device_id)
        tracker.observe(probe, at=0)
    assert tracker.state("GPU-eeee") is HealthState.UNHEALTHY
    assert tracker.state("GPU-ffff") is HealthState.UNHEALTHY
    assert inv.source is not None
    await inv.source.aclose()


async def test_lane_ids_stable_across_discoveries() -> None:
    first = build_lanes(await nvml_inventory(two_gpus()))
    second = build_lanes(await nvml_inventory(two_gpus()))
    assert [lane.lane_id for lane in first] == [lane.lane_id for lane in second]
    assert first[1].lane_id == lane_id_for("GPU-aaaa")
    sim_a = build_lanes(await discover("sim"))
    sim_b = build_lanes(await discover("sim"))
    assert [lane.lane_id for lane in sim_a] == [lane.lane_id for lane in sim_b]
