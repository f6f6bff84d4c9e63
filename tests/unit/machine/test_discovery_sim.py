"""The simulated backend: the built-in workstation and a fault timeline under MockClock."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing

from machine.discovery import DiscoveryError, discover
from machine.discovery_sim import SimError, discover_sim, load_sim_spec, parse_size
from machine.health import HealthState, HealthTracker, HealthTransition
from machine.inventory import CpuInfo, Inventory, MemoryInfo
from machine.lanes import LaneKind, Requirement, build_lanes
from machine.ledger import Ledger, RefusalReason, ReservationRefused, ReservationRequest
from machine.monitor import monitor_devices

GiB = 1 << 30
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "sim-workstation.toml"
G1 = "GPU-5e1d0a3c-0000-4000-8000-5157a0000001"
G2 = "GPU-5e1d0a3c-0000-4000-8000-5157a0000002"


async def test_builtin_workstation() -> None:
    inv = await discover("sim", sim_file=None)
    assert inv.backend == "sim"
    assert inv.cpu.logical_cores == 16 and inv.cpu.capacity_millis == 16000
    assert inv.memory.total_bytes == 64 * GiB
    assert [g.memory_total_bytes for g in inv.gpus] == [24 * GiB, 24 * GiB]
    assert [g.mig_enabled for g in inv.gpus] == [False, True]
    assert len(inv.gpus[1].mig_instances) == 3
    kinds = [lane.kind for lane in build_lanes(inv)]
    assert kinds == [LaneKind.CPU, LaneKind.GPU, LaneKind.MIG, LaneKind.MIG, LaneKind.MIG]
    assert inv.source is not None
    await inv.source.aclose()


def test_example_file_loads() -> None:
    spec = load_sim_spec(EXAMPLE)
    assert len(spec.faults) >= 5
    assert {f.kind.value for f in spec.faults} >= {"xid", "lost", "recovered", "reset"}


def test_bad_sim_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[gpus]]\nuuid = "GPU-x"\nname = "n"\nmemory = "1GiB"\ncolour = "red"\n')
    with pytest.raises(SimError, match="invalid sim file"):
        load_sim_spec(bad)
    bad.write_text('[[faults]]\nat = 1.0\ngpu = "GPU-nope"\nkind = "lost"\n')
    with pytest.raises(SimError, match="unknown gpu"):
        load_sim_spec(bad)
    with pytest.raises(SimError, match="cannot read"):
        load_sim_spec(tmp_path / "missing.toml")
    assert parse_size("24GiB") == 24 * GiB and parse_size(5) == 5
    with pytest.raises(SimError):
        parse_size("lots")


async def test_discover_rejects_unknown_mode_and_bad_file(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryError, match="unknown devices mode"):
        await discover("cuda")
    with pytest.raises(DiscoveryError):
        await discover("sim", sim_file=tmp_path / "missing.toml")


async def test_timeline_drives_health_with_hysteresis(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events: list[HealthTransition] = []
    tracker = HealthTracker(recovery_probes=3, on_transition=events.append)
    inv = await discover("sim", sim_file=EXAMPLE)
    start = trio.current_time()
    assert inv.source is not None
    for gpu in inv.gpus:
        tracker.register(gpu.uuid, at=0)
    seen: dict[float, dict[str, HealthState]] = {}

    async def probe_at(t: float) -> None:
        await trio.sleep_until(start + t)
        for probe in await inv.source.probe():  # type: ignore[union-attr]
            tracker.observe(probe, at=t)
        seen[t] = {g: tracker.state(g) for g in (G1, G2)}

    await probe_at(31)
    assert seen[31][G1] is HealthState.SUSPECT  # xid 13: application, not fatal
    await probe_at(61)
    assert seen[61][G1] is HealthState.UNHEALTHY  # xid 48
    for t in range(62, 90):  # good readings do not heal a fatal XID
        await probe_at(t)
    assert seen[89][G1] is HealthState.UNHEALTHY
    await probe_at(91)  # reset at 90: unknown, and the first good probe
    assert seen[91][G1] is HealthState.UNKNOWN
    await probe_at(95)
    assert seen[95][G1] is HealthState.UNKNOWN
    await probe_at(100)
    assert seen[100][G1] is HealthState.HEALTHY
    await probe_at(121)
    assert seen[121][G2] is HealthState.UNHEALTHY  # over temperature
    await probe_at(151)
    assert seen[151][G2] is HealthState.LOST
    for t in (181, 182, 183, 184):
        await probe_at(t)
    assert seen[184][G2] is HealthState.LOST  # recovered, but not yet rediscovered
    assert G2 in await inv.source.rediscover()
    tracker.rediscovered(G2, at=185)
    assert tracker.state(G2) is HealthState.UNKNOWN
    for t in (186, 187, 188):
        await probe_at(t)
    assert seen[188][G2] is HealthState.HEALTHY
    await probe_at(241)
    assert seen[241][G1] is HealthState.UNHEALTHY  # 2 uncorrected ECC errors
    assert [(e.device_id, e.to_state) for e in events] == [
        (G1, HealthState.SUSPECT),
        (G1, HealthState.UNHEALTHY),
        (G1, HealthState.UNKNOWN),
        (G1, HealthState.HEALTHY),
        (G2, HealthState.UNHEALTHY),
        (G2, HealthState.LOST),
        (G2, HealthState.UNKNOWN),
        (G2, HealthState.HEALTHY),
        (G1, HealthState.UNHEALTHY),
    ]
    await inv.source.aclose()


async def test_monitor_loop_rediscovers(autojump_clock: trio.testing.MockClock) -> None:
    events: list[HealthTransition] = []
    tracker = HealthTracker(recovery_probes=2, on_transition=events.append)
    inv = await discover("sim", sim_file=EXAMPLE)
    assert inv.source is not None
    for gpu in inv.gpus:
        tracker.register(gpu.uuid)
    with trio.move_on_after(200):
        await monitor_devices(inv.source, tracker, interval=1.0)
    assert (G2, HealthState.LOST) in [(e.device_id, e.to_state) for e in events]
    assert tracker.state(G2) is HealthState.HEALTHY
    await inv.source.aclose()


def host(available: int, capacity: int = 20 * GiB) -> tuple[CpuInfo, MemoryInfo]:
    """A fake host (never the real machine's memory)."""
    cpu = CpuInfo(
        logical_cores=2, physical_cores=1, model="test", numa_nodes=1, capacity_millis=2000
    )
    return cpu, MemoryInfo(total_bytes=capacity, available_bytes=available, capacity_bytes=capacity)


async def sim_on(available: int, capacity: int = 20 * GiB) -> Inventory:
    inv = await discover_sim(load_sim_spec(), host=host(available, capacity))
    assert inv.source is not None
    await inv.source.aclose()
    return inv


async def test_simulated_vram_capped_to_host_memory() -> None:
    # The built-in workstation declares 48 GiB of VRAM; this host has 20 GiB of memory.
    inv = await sim_on(18 * GiB)
    roomy = build_lanes(await sim_on(1 << 50, capacity=1 << 50))
    lanes = build_lanes(inv)
    assert inv.vram_limit_bytes == 10 * GiB
    assert sum(lane.vram_bytes for lane in lanes) <= 10 * GiB
    assert [lane.declared_vram_bytes for lane in lanes] == [
        None,
        24 * GiB,
        6 * GiB,
        6 * GiB,
        12 * GiB,
    ]
    assert [lane.vram_bytes for lane in lanes[1:]] == [
        5120 << 20,
        1280 << 20,
        1280 << 20,
        2560 << 20,
    ]
    # Only the sizes change: ids, kinds, devices and isolation are as on a roomy host.
    same = [
        msgspec.structs.replace(a, vram_bytes=b.vram_bytes)
        for a, b in zip(lanes, roomy, strict=True)
    ]
    assert tuple(same) == roomy
    assert build_lanes(await sim_on(19 * GiB)) == lanes  # deterministic, and a restart agrees
    assert len(inv.notes) == 1 and inv.notes[0].startswith(
        "simulated VRAM capped to host memory available: 10,737,418,240 of 51,539,607,552 bytes"
    )
    assert inv.memory.total_bytes == 64 * GiB  # the sim file's RAM section is not the host


async def test_simulated_vram_within_host_memory_unchanged() -> None:
    inv = await sim_on(100 * GiB, capacity=128 * GiB)
    lanes = build_lanes(inv)
    assert [lane.vram_bytes for lane in lanes] == [0, 24 * GiB, 6 * GiB, 6 * GiB, 12 * GiB]
    assert [lane.declared_vram_bytes for lane in lanes[1:]] == [
        24 * GiB,
        6 * GiB,
        6 * GiB,
        12 * GiB,
    ]
    assert inv.notes == ()


async def test_simulated_vram_never_more_than_available() -> None:
    inv = await sim_on(3 * GiB)  # half of 20 GiB would be 10; only 3 are available
    assert sum(lane.vram_bytes for lane in build_lanes(inv)) == 3 * GiB
    assert "never more than the 3,072 MiB available at start" in inv.notes[0]


async def test_no_host_memory_available_promises_no_vram() -> None:
    # Fail closed: a host (or cgroup) with nothing available backs no simulated VRAM.
    inv = await sim_on(0)
    lanes = build_lanes(inv)
    assert [lane.vram_bytes for lane in lanes] == [0, 0, 0, 0, 0]
    assert inv.notes[0].startswith("simulated VRAM capped to host memory available: 0 of")
    healthy = {gpu.uuid: HealthState.HEALTHY for gpu in inv.gpus}
    ledger = Ledger(
        lanes=lanes, cpu_capacity_millis=2000, memory_capacity_bytes=GiB, device_health=healthy
    )
    gpu = ReservationRequest(reservation_id="r", requirement=Requirement.GPU, gpus=1, vram_bytes=1)
    with pytest.raises(ReservationRefused) as refused:
        ledger.reserve(gpu)
    assert refused.value.reason is RefusalReason.INSUFFICIENT_VRAM
