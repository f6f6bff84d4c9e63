"""Every health probe refreshes the readings the snapshot shows: host memory and,
per GPU and MIG instance, memory, utilization, power, temperature, clocks, XID
and ECC counts. From NVML (a fake module) and from the simulator's timeline."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing

from machine import Machine
from machine.discovery_sim import SimError, load_sim_spec
from machine.health import HealthState
from machine.inventory import MemoryInfo
from machine.snapshot import DeviceSection
from tests.fakes.fake_pynvml import FakeNvml, gpu_and_mig

GiB = 1 << 30
MiB = 1 << 20

SIM = """
[memory]
total = "64GiB"
available = "60GiB"
timeline = [{ at = 10.0, available = "20GiB" }, { at = 30.0, available = "50GiB" }]

[[gpus]]
uuid = "GPU-s1"
name = "Sim 24GB"
memory = "24GiB"
temperature_c = 40.0
power_w = 70.0
sm_clock_mhz = 1410
memory_clock_mhz = 1215

[[gpus]]
uuid = "GPU-s2"
name = "Sim 24GB"
memory = "24GiB"
mig_enabled = true

[[gpus.mig]]
uuid = "MIG-s2a"
name = "1g.6gb"
memory = "6GiB"
gpu_instance_id = 9

[[faults]]
at = 10.0
gpu = "GPU-s1"
kind = "load"
utilization_gpu = 90.0
utilization_memory = 45.0
memory_used = "10GiB"
power_w = 250.0

[[faults]]
at = 10.0
gpu = "MIG-s2a"
kind = "load"
memory_used = "2GiB"
utilization_gpu = 60.0

[[faults]]
at = 20.0
gpu = "GPU-s1"
kind = "xid"
xid = 13

[[faults]]
at = 20.0
gpu = "GPU-s1"
kind = "ecc"
ecc_errors = 2

[[faults]]
at = 25.0
gpu = "GPU-s1"
kind = "reset"
"""


async def open_machine(
    state: Path, *, devices: str = "sim", sim_file: Path | None = None, nvml: FakeNvml | None = None
) -> Machine:
    return await Machine.open(
        node_id="node-t",
        devices=devices,
        sim_file=sim_file,
        state_dir=state,
        reserved_cpu_millis=0,
        reserved_memory_bytes=0,
        vram_headroom_bytes=0,
        pynvml_module=nvml,
    )


def device(machine: Machine, uuid: str) -> DeviceSection:
    return next(d for d in machine.snapshot().devices if d.device_id == uuid)


async def test_nvml_probe_refreshes_every_reading(tmp_path: Path) -> None:
    fake = gpu_and_mig(ecc_corrected=3, ecc_aggregate_corrected=7, ecc_aggregate_uncorrected=1)
    machine = await open_machine(tmp_path, devices="nvml", nvml=fake)
    try:
        a = device(machine, "GPU-a")
        assert (a.memory_used_bytes, a.memory_free_bytes) == (GiB, 79 * GiB)
        assert (a.utilization_gpu_percent, a.utilization_memory_percent) == (35.0, 20.0)
        assert (a.sm_clock_mhz, a.memory_clock_mhz) == (1410, 1215)
        assert (a.power_w, a.temperature_c) == (70.0, 40.0)
        assert (a.ecc_volatile_corrected, a.ecc_volatile_uncorrected) == (3, 0)
        assert (a.ecc_aggregate_corrected, a.ecc_aggregate_uncorrected) == (7, 1)
        assert (a.xid_errors, a.last_xid, a.minor_number) == (0, 0, 0)
        gpu_a = fake.gpus[0]
        gpu_a.memory_used, gpu_a.utilization_gpu, gpu_a.power_mw = 30 * GiB, 97, 300_000
        gpu_a.temperature, gpu_a.sm_clock = 71, 1980
        fake.push_xid("GPU-a", 13)
        fake.push_xid("GPU-a", 31)
        fake.gpus[1].migs[0].memory_used = 5 * GiB
        await machine.probe()
        a = device(machine, "GPU-a")
        assert (a.memory_used_bytes, a.memory_free_bytes) == (30 * GiB, 50 * GiB)
        assert (a.utilization_gpu_percent, a.power_w, a.temperature_c) == (97.0, 300.0, 71.0)
        assert a.sm_clock_mhz == 1980 and (a.xid_errors, a.last_xid) == (2, 31)
        mig, _ = device(machine, "GPU-b").mig_instances
        assert (mig.mig_uuid, mig.gpu_instance_id) == ("MIG-b1", 2)
        assert (mig.memory_used_bytes, mig.memory_free_bytes) == (5 * GiB, 15 * GiB)
        # NVML gives no utilization for a MIG instance: absent, and the rest is read.
        assert mig.utilization_gpu_percent is None and mig.utilization_memory_percent is None
    finally:
        await machine.aclose()


@pytest.mark.parametrize(
    ("call", "fields"),
    [
        (
            "nvmlDeviceGetUtilizationRates",
            ("utilization_gpu_percent", "utilization_memory_percent"),
        ),
        ("nvmlDeviceGetClockInfo", ("sm_clock_mhz", "memory_clock_mhz")),
        ("nvmlDeviceGetPowerUsage", ("power_w",)),
        ("nvmlDeviceGetTemperature", ("temperature_c",)),
        (
            "nvmlDeviceGetTotalEccErrors",
            (
                "ecc_volatile_corrected",
                "ecc_volatile_uncorrected",
                "ecc_aggregate_corrected",
                "ecc_aggregate_uncorrected",
            ),
        ),
    ],
)
async def test_nvml_unsupported_field_is_absent_not_zero(
    tmp_path: Path, call: str, fields: tuple[str, ...]
) -> None:
    fake = gpu_and_mig()
    fake.gpus[0].unsupported.add(call)
    machine = await open_machine(tmp_path, devices="nvml", nvml=fake)
    try:
        await machine.probe()
        a = device(machine, "GPU-a")
        assert a.health is HealthState.HEALTHY  # not a failed reading
        for field in fields:
            assert getattr(a, field) is None, field
        assert a.memory_used_bytes == GiB and a.memory_free_bytes == 79 * GiB
        assert (a.utilization_gpu_percent is None) is (call == "nvmlDeviceGetUtilizationRates")
        assert (a.sm_clock_mhz is None) is (call == "nvmlDeviceGetClockInfo")
        # The other GPU reads its own (in MIG mode NVML gives it no utilization).
        b = device(machine, "GPU-b")
        assert (b.temperature_c, b.sm_clock_mhz, b.utilization_gpu_percent) == (40.0, 1410, None)
    finally:
        await machine.aclose()


async def test_nvml_without_xid_events_has_no_xid_count(tmp_path: Path) -> None:
    fake = gpu_and_mig()
    fake.events_supported = False
    machine = await open_machine(tmp_path, devices="nvml", nvml=fake)
    try:
        a = device(machine, "GPU-a")
        assert a.xid_errors is None and a.last_xid is None
        assert a.utilization_gpu_percent == 35.0
    finally:
        await machine.aclose()


async def test_nvml_vanished_mig_instance_reads_empty_and_the_gpu_stays_healthy(
    tmp_path: Path,
) -> None:
    fake = gpu_and_mig()
    machine = await open_machine(tmp_path, devices="nvml", nvml=fake)
    try:
        fake.gpus[1].migs[0].gone = True
        await machine.probe()
        b = device(machine, "GPU-b")
        assert b.health is HealthState.HEALTHY and b.temperature_c == 40.0
        mig, other = b.mig_instances
        assert mig.memory_used_bytes is None and mig.memory_free_bytes is None
        assert other.memory_free_bytes == 5 * GiB
    finally:
        await machine.aclose()


async def test_sim_timeline_moves_readings_and_host_memory(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    sim = tmp_path / "sim.toml"
    sim.write_text(SIM)
    machine = await open_machine(tmp_path / "state", sim_file=sim)
    mock_clock.autojump_threshold = 0  # after the journal's worker thread is done
    start = trio.current_time()
    try:
        snap = machine.snapshot()
        assert snap.memory.available_bytes == 60 * GiB
        s1 = device(machine, "GPU-s1")
        assert (s1.memory_used_bytes, s1.memory_free_bytes) == (0, 24 * GiB)
        assert (s1.utilization_gpu_percent, s1.sm_clock_mhz, s1.power_w) == (0.0, 1410, 70.0)
        (mig,) = device(machine, "GPU-s2").mig_instances
        assert (mig.gpu_instance_id, mig.memory_used_bytes, mig.utilization_gpu_percent) == (
            9,
            0,
            None,
        )
        await trio.sleep_until(start + 11)
        await machine.probe()
        snap = machine.snapshot()
        assert snap.memory.available_bytes == 20 * GiB
        s1 = device(machine, "GPU-s1")
        assert (s1.memory_used_bytes, s1.memory_free_bytes) == (10 * GiB, 14 * GiB)
        assert (s1.utilization_gpu_percent, s1.utilization_memory_percent) == (90.0, 45.0)
        assert s1.power_w == 250.0
        (mig,) = device(machine, "GPU-s2").mig_instances
        assert (mig.memory_used_bytes, mig.memory_free_bytes) == (2 * GiB, 4 * GiB)
        assert mig.utilization_gpu_percent == 60.0
        await trio.sleep_until(start + 21)
        await machine.probe()
        s1 = device(machine, "GPU-s1")
        assert (s1.xid_errors, s1.last_xid) == (1, 13)
        assert (s1.ecc_volatile_uncorrected, s1.ecc_aggregate_uncorrected) == (2, 2)
        await trio.sleep_until(start + 31)
        await machine.probe()
        assert machine.snapshot().memory.available_bytes == 50 * GiB
        s1 = device(machine, "GPU-s1")
        # A reset clears the volatile count; the aggregate and the XID count stay.
        assert (s1.ecc_volatile_uncorrected, s1.ecc_aggregate_uncorrected) == (0, 2)
        assert s1.xid_errors == 1
    finally:
        await machine.aclose()


async def test_probe_refreshes_host_memory_read_from_the_host(tmp_path: Path) -> None:
    machine = await open_machine(tmp_path, devices="none")
    readings = [5 * GiB, 7 * GiB]

    def host_memory() -> MemoryInfo:
        if not readings:
            raise OSError("/proc/meminfo: unreadable")
        available = readings.pop(0)
        return MemoryInfo(total_bytes=8 * GiB, available_bytes=available, capacity_bytes=8 * GiB)

    machine.inventory = msgspec.structs.replace(machine.inventory, host_memory=host_memory)
    try:
        first = machine.snapshot().memory.available_bytes
        await machine.probe()
        assert machine.snapshot().memory.available_bytes == 5 * GiB != first
        await machine.probe()
        assert machine.snapshot().memory.available_bytes == 7 * GiB
        # A read that fails keeps the last good figures.
        await machine.probe()
        assert machine.snapshot().memory.available_bytes == 7 * GiB
    finally:
        await machine.aclose()


async def test_monitor_without_devices_still_refreshes_host_memory(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    machine = await open_machine(tmp_path, devices="none")
    mock_clock.autojump_threshold = 0
    calls: list[int] = []

    def host_memory() -> MemoryInfo:
        calls.append(1)
        return MemoryInfo(total_bytes=8 * GiB, available_bytes=len(calls), capacity_bytes=8 * GiB)

    machine.inventory = msgspec.structs.replace(machine.inventory, host_memory=host_memory)
    probes: list[int] = []
    try:
        with trio.move_on_after(10.5):
            await machine.monitor(interval=1.0, on_probe=lambda: probes.append(1))
        assert len(calls) == len(probes) == 11
        assert machine.snapshot().memory.available_bytes == 11
    finally:
        await machine.aclose()


def test_sim_file_checks_the_new_readings(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    gpu = '[[gpus]]\nuuid = "GPU-x"\nname = "n"\nmemory = "1GiB"\n'
    bad.write_text(gpu + 'memory_used = "2GiB"\n')
    with pytest.raises(SimError, match="memory_used"):
        load_sim_spec(bad)
    load = '[[faults]]\nat = 1.0\ngpu = "GPU-x"\nkind = "load"\n'
    bad.write_text(gpu + load + "utilization_gpu = 140.0\n")
    with pytest.raises(SimError, match="0-100"):
        load_sim_spec(bad)
    mig = 'mig_enabled = true\n[[gpus.mig]]\nuuid = "MIG-x"\nname = "1g"\nmemory = "1GiB"\n'
    bad.write_text(gpu + mig + '[[faults]]\nat = 1.0\ngpu = "MIG-x"\nkind = "lost"\n')
    with pytest.raises(SimError, match="only `load`"):
        load_sim_spec(bad)
    bad.write_text(gpu + '[memory]\ntotal = "8GiB"\ntimeline = [{ at = 1.0, available = "x" }]\n')
    with pytest.raises(SimError, match="not a size"):
        load_sim_spec(bad)
