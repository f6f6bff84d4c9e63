"""Capacity ledger: arithmetic, all-or-nothing, isolation rules, refusals."""

from __future__ import annotations

import msgspec
import pytest

from machine.health import HealthState
from machine.inventory import CpuInfo, GpuDevice, Inventory, MemoryInfo, MigInstance
from machine.lanes import (
    CPU_POOL_UUID,
    Isolation,
    LaneKind,
    Requirement,
    build_lanes,
    lane_id_for,
)
from machine.ledger import (
    Ledger,
    RefusalReason,
    ReservationRefused,
    ReservationRequest,
)

GiB = 1 << 30
G1, G2 = "GPU-1111", "GPU-2222"
MIGS = ("MIG-a", "MIG-b", "MIG-c")


def inventory() -> Inventory:
    return Inventory(
        backend="sim",
        cpu=CpuInfo(
            logical_cores=16, physical_cores=8, model="m", numa_nodes=1, capacity_millis=16000
        ),
        memory=MemoryInfo(total_bytes=64 * GiB, available_bytes=60 * GiB, capacity_bytes=64 * GiB),
        gpus=(
            GpuDevice(uuid=G1, name="g", pci_bus_id=None, memory_total_bytes=24 * GiB),
            GpuDevice(
                uuid=G2,
                name="g",
                pci_bus_id=None,
                memory_total_bytes=24 * GiB,
                mig_enabled=True,
                mig_instances=tuple(
                    MigInstance(uuid=u, name="1g", memory_total_bytes=m * GiB)
                    for u, m in zip(MIGS, (6, 6, 12), strict=True)
                ),
            ),
        ),
    )


def ledger(**kw: int) -> Ledger:
    return Ledger(
        lanes=build_lanes(inventory()),
        cpu_capacity_millis=16000,
        memory_capacity_bytes=64 * GiB,
        reserved_cpu_millis=kw.get("cpu", 1000),
        reserved_memory_bytes=kw.get("mem", GiB),
        vram_headroom_bytes=kw.get("headroom", GiB // 2),
        device_health={G1: HealthState.HEALTHY, G2: HealthState.HEALTHY},
    )


def req(rid: str, **kw: object) -> ReservationRequest:
    return ReservationRequest(reservation_id=rid, **kw)  # type: ignore[arg-type]


def refused(led: Ledger, request: ReservationRequest) -> RefusalReason:
    before = led.capacity()
    with pytest.raises(ReservationRefused) as info:
        led.reserve(request)
    assert led.capacity() == before  # all or nothing
    return info.value.reason


def test_lanes_mig_gpu_contributes_instances_only() -> None:
    lanes = build_lanes(inventory())
    kinds = [lane.kind for lane in lanes]
    assert kinds == [LaneKind.CPU, LaneKind.GPU, LaneKind.MIG, LaneKind.MIG, LaneKind.MIG]
    assert lane_id_for(G2) not in {lane.lane_id for lane in lanes}
    assert all(lane.lane_id.startswith("lane_") and len(lane.lane_id) == 21 for lane in lanes)
    assert lanes[2].accepts == frozenset({Isolation.PARTITIONED})
    assert lanes[1].accepts == {Isolation.DEDICATED, Isolation.SHARED, Isolation.SANDBOX}


def test_capacity_arithmetic() -> None:
    led = ledger()
    cap = led.capacity()
    assert cap.cpu_millis.allocatable == 15000
    assert cap.memory_bytes.allocatable == 63 * GiB
    assert cap.gpus.capacity == 4 and cap.gpus.allocatable == 4
    assert cap.lanes[0].vram.allocatable == 24 * GiB - GiB // 2
    r = led.reserve(req("a", cpu_millis=2000, memory_bytes=4 * GiB, requirement=Requirement.CPU))
    cap = led.capacity()
    assert cap.cpu_millis.allocated == 2000 and cap.cpu_millis.allocatable == 13000
    assert r.visible_devices == ()
    assert led.release("a") == r
    assert led.release("a") is None
    assert led.capacity().cpu_millis.allocated == 0


def test_refusals_are_typed_and_all_or_nothing() -> None:
    led = ledger()
    assert refused(led, req("x", cpu_millis=15001)) is RefusalReason.INSUFFICIENT_CPU
    assert refused(led, req("x", memory_bytes=64 * GiB)) is RefusalReason.INSUFFICIENT_MEMORY
    led.reserve(req("x", cpu_millis=1))
    assert refused(led, req("x")) is RefusalReason.DUPLICATE_RESERVATION
    big = req("y", cpu_millis=100, requirement=Requirement.GPU, vram_bytes=30 * GiB)
    assert refused(led, big) is RefusalReason.INSUFFICIENT_VRAM
    assert (
        refused(led, req("y", requirement=Requirement.CPU, isolation=Isolation.DEDICATED))
        is RefusalReason.ISOLATION_UNSUPPORTED
    )
    assert refused(led, req("y", cpu_millis=-1)) is RefusalReason.INVALID_REQUEST


def test_dedicated_takes_a_whole_gpu() -> None:
    led = ledger()
    r = led.reserve(req("d", requirement=Requirement.GPU, isolation=Isolation.DEDICATED))
    assert r.visible_devices == (G1,)
    assert r.lanes[0].vram_bytes == 24 * GiB - GiB // 2
    assert led.capacity().lanes[0].vram.allocatable == 0
    shared = req("s", requirement=Requirement.GPU, vram_bytes=1)
    assert refused(led, shared) is RefusalReason.INSUFFICIENT_GPUS
    again = req("d2", requirement=Requirement.GPU, isolation=Isolation.DEDICATED)
    assert refused(led, again) is RefusalReason.INSUFFICIENT_GPUS


def test_shared_packs_vram_and_blocks_dedicated() -> None:
    led = ledger()
    a = led.reserve(req("a", requirement=Requirement.GPU, vram_bytes=10 * GiB))
    b = led.reserve(req("b", requirement=Requirement.GPU, vram_bytes=10 * GiB))
    assert a.lanes[0].lane_id == b.lanes[0].lane_id
    assert led.capacity().lanes[0].vram.allocated == 20 * GiB
    assert refused(led, req("c", requirement=Requirement.GPU, vram_bytes=4 * GiB)) is (
        RefusalReason.INSUFFICIENT_VRAM
    )
    ded = req("d", requirement=Requirement.GPU, isolation=Isolation.DEDICATED)
    assert refused(led, ded) is RefusalReason.INSUFFICIENT_GPUS


def test_partitioned_only_on_mig_lanes() -> None:
    led = ledger()
    got = [
        led.reserve(req(f"p{i}", requirement=Requirement.GPU, isolation=Isolation.PARTITIONED))
        for i in range(3)
    ]
    assert sorted(g.visible_devices[0] for g in got) == sorted(MIGS)
    assert all(g.lanes[0].kind is LaneKind.MIG for g in got)
    last = req("p4", requirement=Requirement.GPU, isolation=Isolation.PARTITIONED)
    assert refused(led, last) is RefusalReason.INSUFFICIENT_GPUS
    # Best fit: a 10 GiB floor only fits the 12 GiB instance.
    led2 = ledger()
    r = led2.reserve(
        req("p", requirement=Requirement.GPU, isolation=Isolation.PARTITIONED, vram_bytes=10 * GiB)
    )
    assert r.visible_devices == ("MIG-c",)


def test_sandbox_gets_no_device_visibility() -> None:
    led = ledger()
    cpu = led.reserve(req("s1", isolation=Isolation.SANDBOX, requirement=Requirement.CPU))
    gpu = led.reserve(
        req("s2", isolation=Isolation.SANDBOX, requirement=Requirement.GPU, vram_bytes=GiB)
    )
    assert cpu.visible_devices == () and gpu.visible_devices == ()
    assert gpu.lanes[0].lane_id == lane_id_for(G1)


def test_auto_prefers_gpu_then_cpu() -> None:
    led = ledger()
    r = led.reserve(req("a1", vram_bytes=GiB))
    assert r.lanes[0].kind is LaneKind.GPU and r.requirement is Requirement.AUTO
    led.set_device_health(G1, HealthState.UNHEALTHY)
    r2 = led.reserve(req("a2", vram_bytes=2 * GiB))
    assert r2.lanes[0].kind is LaneKind.CPU and r2.visible_devices == ()
    assert refused(led, req("c", requirement=Requirement.CPU, vram_bytes=1)) is (
        RefusalReason.INVALID_REQUEST
    )
    ded = req("a3", isolation=Isolation.DEDICATED)
    assert refused(led, ded) is RefusalReason.LANE_UNHEALTHY


def test_unhealthy_and_drained_lanes_add_nothing() -> None:
    led = ledger()
    for state in (HealthState.UNHEALTHY, HealthState.UNKNOWN, HealthState.LOST):
        led.set_device_health(G2, state)
        cap = led.capacity()
        assert cap.gpus.allocatable == 1
        assert all(u.vram.allocatable == 0 for u in cap.lanes if u.device_id == G2)
    led.set_device_health(G2, HealthState.SUSPECT)
    assert led.capacity().gpus.allocatable == 4
    g1 = lane_id_for(G1)
    led.drain(g1)
    assert led.is_drained(g1)
    assert led.capacity().gpus.allocatable == 3
    assert refused(led, req("x", requirement=Requirement.GPU, lane_id=g1)) is (
        RefusalReason.LANE_DRAINED
    )
    led.resume(g1)
    assert led.reserve(req("x", requirement=Requirement.GPU, lane_id=g1)).lanes[0].lane_id == g1
    with pytest.raises(ReservationRefused) as info:
        led.drain("lane_nope")
    assert info.value.reason is RefusalReason.NO_LANE


def test_recovered_device_is_allocatable_again() -> None:
    led = ledger()
    led.set_device_health(G1, HealthState.UNHEALTHY)
    ded = req("d", requirement=Requirement.GPU, isolation=Isolation.DEDICATED)
    assert refused(led, ded) is RefusalReason.LANE_UNHEALTHY
    led.set_device_health(G1, HealthState.HEALTHY)
    assert led.reserve(ded).visible_devices == (G1,)


def test_a_lanes_own_faults_show_with_their_reasons_and_clear_by_cause() -> None:
    led = ledger()
    g1, cpu = lane_id_for(G1), lane_id_for(CPU_POOL_UUID)
    led.fault_lane(g1, "host: failed too often", cause="lane_host")
    led.fault_lane(g1, "process_stuck", cause="process")
    assert not led.available(g1) and led.lane_health(g1) is HealthState.UNHEALTHY
    assert led.lane_health_shown(g1) is HealthState.UNHEALTHY
    assert led.lane_fault(g1) == "host: failed too often; process_stuck"
    led.clear_lane_fault(g1, "lane_host")  # the host is back; the stuck process is not
    assert not led.available(g1) and led.lane_fault(g1) == "process_stuck"
    led.clear_lane_fault(g1, "process")
    assert led.available(g1) and led.lane_fault(g1) is None
    assert led.lane_health_shown(g1) is HealthState.HEALTHY
    # The CPU pool's lane host faulted: shown unhealthy, still allocatable for its processes.
    led.fault_lane(cpu, "host: failed too often", cause="lane_host", allocatable=True)
    assert led.available(cpu) and led.lane_health(cpu) is HealthState.HEALTHY
    assert led.lane_health_shown(cpu) is HealthState.UNHEALTHY
    assert led.reserve(req("p", requirement=Requirement.CPU)).lanes[0].lane_id == cpu
    led.clear_lane_fault(cpu)
    assert led.lane_health_shown(cpu) is HealthState.HEALTHY and led.lane_fault(cpu) is None


def test_no_lane_without_mig_or_gpus() -> None:
    inv = inventory()
    led = Ledger(
        lanes=build_lanes(Inventory(backend="none", cpu=inv.cpu, memory=inv.memory)),
        cpu_capacity_millis=1000,
        memory_capacity_bytes=GiB,
    )
    assert refused(led, req("g", requirement=Requirement.GPU)) is RefusalReason.NO_LANE
    assert led.reserve(req("a")).lanes[0].kind is LaneKind.CPU
    # GPU lanes with no health reading yet are unknown: fail closed.
    led2 = Ledger(lanes=build_lanes(inv), cpu_capacity_millis=1000, memory_capacity_bytes=GiB)
    assert led2.capacity().gpus.allocatable == 0


def test_adopt_may_exceed_capacity_but_allocatable_never_negative() -> None:
    led = ledger()
    r = led.reserve(req("a", cpu_millis=15000))
    led2 = Ledger(lanes=led.lanes(), cpu_capacity_millis=4000, memory_capacity_bytes=GiB)
    led2.adopt(r)
    assert led2.capacity().cpu_millis.allocatable == 0
    assert led2.capacity().cpu_millis.allocated == 15000


def test_a_lanes_host_context_is_kept_back_with_the_headroom() -> None:
    """The CUDA context of a lane's own host (its sentinel, measured at its start) is
    device memory a guest cannot have: a dedicated guest given the lane's
    allocatable VRAM must not find it held."""
    led = ledger(headroom=GiB // 2)
    lane = led.lanes()[1]
    context = 300 << 20
    led.set_host_reserved(lane.lane_id, context)
    usage = next(u for u in led.capacity().lanes if u.lane_id == lane.lane_id)
    assert usage.vram.reserved == GiB // 2 + context
    assert led.vram_free(lane.lane_id) == 24 * GiB - GiB // 2 - context
    whole = req("d", cpu_millis=1, requirement=Requirement.GPU, isolation=Isolation.DEDICATED)
    granted = led.reserve(whole)
    assert granted.lanes[0].vram_bytes == 24 * GiB - GiB // 2 - context
    led.release("d")
    led.set_host_reserved(lane.lane_id, 0)  # a host that holds nothing for itself (NumPy)
    assert led.host_reserved(lane.lane_id) == 0
    assert led.vram_free(lane.lane_id) == 24 * GiB - GiB // 2


def test_nvml_lanes_compute_with_cupy_and_the_cpu_pool_and_simulated_ones_with_numpy() -> None:
    """The node's one decision: a real GPU's or MIG instance's lane is CUDA, never
    host memory; simulated lanes are host memory, whatever is installed."""
    sim = build_lanes(inventory())
    assert [lane.array_backend for lane in sim] == ["numpy"] * 5
    real = build_lanes(msgspec.structs.replace(inventory(), backend="nvml"))
    assert [lane.array_backend for lane in real] == ["numpy", "cupy", "cupy", "cupy", "cupy"]
    # A lane made without saying (a test's, a future path's): by kind, CUDA for a device.
    bare = msgspec.structs.replace(real[2], backend=None)
    assert bare.array_backend == "cupy"
    assert msgspec.structs.replace(real[0], backend=None).array_backend == "numpy"
