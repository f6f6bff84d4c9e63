"""NVML faults a real driver shows, through the fake: a field the driver refuses,
a hung call on one GPU, an event wait failing mid-drain, an event whose device
cannot be named, a GPU lost and back (its XID registration made again), and
row remapping that failed for good."""

from __future__ import annotations

import pynvml
import pytest
import trio

from machine.discovery import discover
from machine.health import HealthState, HealthTracker
from machine.inventory import Inventory, Probe, ProbeStatus
from machine.monitor import probe_once
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml, gpu_and_mig, nvml_error


async def nvml_inventory(fake: FakeNvml, call_timeout: float = 5.0) -> Inventory:
    inv = await discover("nvml", pynvml_module=fake, nvml_call_timeout=call_timeout)
    assert inv.backend == "nvml" and inv.source is not None
    return inv


def tracker_for(inv: Inventory, recovery_probes: int = 2) -> HealthTracker:
    tracker = HealthTracker(recovery_probes=recovery_probes)
    for gpu in inv.gpus:
        tracker.register(gpu.uuid)
    for probe in inv.probes:
        tracker.observe(probe, at=0)
    return tracker


async def probes_of(inv: Inventory) -> dict[str, Probe]:
    assert inv.source is not None
    return {p.device_id: p for p in await inv.source.probe()}


@pytest.mark.parametrize(
    "code",
    [
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_INVALID_ARGUMENT,
        pynvml.NVML_ERROR_UNKNOWN,
    ],
)
async def test_a_field_nvml_refuses_is_absent_with_a_reason_and_the_rest_is_read(
    code: int,
) -> None:
    fake = gpu_and_mig()
    fake.gpus[0].errors["nvmlDeviceGetPowerUsage"] = code
    inv = await nvml_inventory(fake)
    a = next(p for p in inv.probes if p.device_id == "GPU-a")
    assert a.status is ProbeStatus.OK, a.error
    assert a.power_w is None and a.temperature_c == 40.0 and a.memory_used_bytes == 1 << 30
    assert a.unread == (f"power_w: {nvml_error(code)}",)
    tracker = tracker_for(inv)
    assert tracker.state("GPU-a") is HealthState.HEALTHY
    assert inv.source is not None
    await inv.source.aclose()


async def test_a_gpu_that_answers_nothing_is_a_failed_reading() -> None:
    fake = gpu_and_mig()
    inv = await nvml_inventory(fake)
    fake.gpus[0].errors["*"] = pynvml.NVML_ERROR_UNKNOWN
    probes = await probes_of(inv)
    assert probes["GPU-a"].status is ProbeStatus.FAILED
    assert probes["GPU-a"].error is not None and "Unknown Error" in probes["GPU-a"].error
    assert probes["GPU-b"].status is ProbeStatus.OK
    assert inv.source is not None
    await inv.source.aclose()


async def test_a_device_level_error_on_one_field_fails_the_reading() -> None:
    fake = gpu_and_mig()
    inv = await nvml_inventory(fake)
    fake.gpus[0].errors["nvmlDeviceGetTemperature"] = pynvml.NVML_ERROR_RESET_REQUIRED
    probes = await probes_of(inv)
    assert probes["GPU-a"].status is ProbeStatus.FAILED
    assert probes["GPU-a"].error == str(nvml_error(pynvml.NVML_ERROR_RESET_REQUIRED))
    assert inv.source is not None
    await inv.source.aclose()


async def test_one_hung_gpu_makes_only_itself_unknown() -> None:
    fake = gpu_and_mig()
    inv = await nvml_inventory(fake, call_timeout=0.3)
    fake.gpus[0].hangs.add("nvmlDeviceGetTemperature")
    try:
        for _ in range(2):  # and again while its thread is still stuck
            probes = await probes_of(inv)
            assert (probes["GPU-a"].status, probes["GPU-a"].error) == (
                ProbeStatus.FAILED,
                "nvml_timeout",
            )
            assert probes["GPU-b"].status is ProbeStatus.OK
    finally:
        fake.release()
        await trio.sleep(0.05)
        assert inv.source is not None
        await inv.source.aclose()


async def test_xids_drained_before_a_wait_error_still_reach_health() -> None:
    fake = gpu_and_mig()
    inv = await nvml_inventory(fake)
    tracker = tracker_for(inv)
    assert fake.push_xid("GPU-a", 79) == 1
    fake.push_xid("GPU-a", 13)
    fake.fail_wait(pynvml.NVML_ERROR_UNKNOWN, after=1, uuid="GPU-a")
    probes = await probes_of(inv)
    a = probes["GPU-a"]
    # The event read before the error is kept; events may have been missed, so the
    # reading cannot vouch for the GPU: failed (unknown), and the fatal XID counts.
    assert a.xids == (79,)
    assert (a.status, a.error) == (ProbeStatus.FAILED, "xid_events_failed: Unknown Error")
    assert probes["GPU-b"].status is ProbeStatus.OK
    tracker.observe(a, at=1)
    assert tracker.state("GPU-a") is HealthState.UNHEALTHY
    assert tracker.health("GPU-a").needs_reset
    # The next probe waits on the same set again: what was queued arrives.
    a = (await probes_of(inv))["GPU-a"]
    assert (a.status, a.xids, a.xid_count, a.last_xid) == (ProbeStatus.OK, (13,), 2, 13)
    assert inv.source is not None
    await inv.source.aclose()


async def test_a_lost_gpu_from_the_event_wait_is_the_gpus_own_reading() -> None:
    fake = gpu_and_mig()
    inv = await nvml_inventory(fake)
    fake.fail_wait(pynvml.NVML_ERROR_GPU_IS_LOST, uuid="GPU-a")
    probes = await probes_of(inv)
    assert (probes["GPU-a"].status, probes["GPU-a"].error) == (
        ProbeStatus.FAILED,
        "xid_events_failed: GPU is lost",
    )
    assert probes["GPU-b"].status is ProbeStatus.OK  # other GPUs' events are their own
    fake.gpus[0].lost = True
    fake.fail_wait(pynvml.NVML_ERROR_GPU_IS_LOST, uuid="GPU-a")
    assert (await probes_of(inv))["GPU-a"].status is ProbeStatus.LOST
    assert inv.source is not None
    await inv.source.aclose()


async def test_an_event_is_charged_to_its_gpu_even_when_its_uuid_cannot_be_read() -> None:
    fake = gpu_and_mig()
    inv = await nvml_inventory(fake)
    fake.gpus[0].errors["nvmlDeviceGetUUID"] = pynvml.NVML_ERROR_UNKNOWN
    fake.push_xid("GPU-a", 79)
    probes = await probes_of(inv)
    assert probes["GPU-a"].xids == (79,)
    assert probes["GPU-b"].xids == ()
    assert inv.source is not None
    await inv.source.aclose()


async def test_xid_registration_is_made_again_when_a_lost_gpu_comes_back() -> None:
    fake = gpu_and_mig()
    inv = await nvml_inventory(fake)
    source = inv.source
    assert source is not None
    tracker = tracker_for(inv)
    fake.gpus[0].lost = True
    await probe_once(source, tracker)
    assert tracker.state("GPU-a") is HealthState.LOST
    fake.reset_gpu("GPU-a")  # back; the reset dropped its event registration
    await probe_once(source, tracker)
    assert tracker.state("GPU-a") is HealthState.UNKNOWN
    assert fake.push_xid("GPU-a", 79) == 1  # registered again
    await probe_once(source, tracker)
    assert tracker.state("GPU-a") is HealthState.UNHEALTHY
    assert tracker.last_reading("GPU-a") is not None
    await source.aclose()


async def test_failed_row_remapping_is_permanent_not_a_reset() -> None:
    fake = FakeNvml([FakeGpu(uuid="GPU-r", remapped_rows=(0, 2, 0, 1))])
    inv = await nvml_inventory(fake)
    tracker = tracker_for(inv)
    health = tracker.health("GPU-r")
    assert health.state is HealthState.UNHEALTHY
    assert any(r.startswith("remapped_rows_failed:") for r in health.reasons), health.reasons
    assert not any("reset" in r for r in health.reasons), health.reasons
    assert inv.source is not None
    await inv.source.aclose()
