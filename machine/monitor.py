"""The I/O glue between a DeviceSource and the health tracker (and the ledger).

Probes every `interval` seconds, feeds each reading through the tracker,
asks the source to rediscover lost devices, and pushes device health into
the ledger so unhealthy lanes leave allocatable at once. Each probe is
bounded by `probe_timeout`; a probe that overruns marks every device as
unreadable (unknown), never healthy.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from machine.health import HealthState, HealthTracker
from machine.inventory import DeviceSource, Probe, ProbeStatus
from machine.ledger import Ledger

__all__ = ["monitor_devices", "probe_once", "sync_ledger"]


def sync_ledger(tracker: HealthTracker, ledger: Ledger) -> None:
    for device_id, state in tracker.states().items():
        ledger.set_device_health(device_id, state, tracker.health(device_id).reasons)


async def probe_once(
    source: DeviceSource,
    tracker: HealthTracker,
    *,
    probe_timeout: float = 10.0,
    ledger: Ledger | None = None,
) -> None:
    """One probe cycle: read, classify, rediscover lost devices, sync the ledger."""
    now = trio.current_time()
    probes: list[Probe]
    with trio.move_on_after(probe_timeout) as scope:
        probes = await source.probe()
    if scope.cancelled_caught:
        probes = [
            Probe(device_id=d, status=ProbeStatus.FAILED, error="probe_timeout")
            for d in tracker.devices()
        ]
    for probe in probes:
        tracker.observe(probe, at=now)
    lost = [d for d, s in tracker.states().items() if s is HealthState.LOST]
    if lost:
        with trio.move_on_after(probe_timeout):
            visible = await source.rediscover()
            for device_id in lost:
                if device_id in visible:
                    tracker.rediscovered(device_id, at=trio.current_time())
    if ledger is not None:
        sync_ledger(tracker, ledger)


async def monitor_devices(
    source: DeviceSource,
    tracker: HealthTracker,
    *,
    interval: float = 5.0,
    probe_timeout: float = 10.0,
    ledger: Ledger | None = None,
    on_probe: Callable[[], None] = lambda: None,
) -> None:
    """Probe forever (until cancelled); `on_probe` hears of every finished probe."""
    while True:
        await probe_once(source, tracker, probe_timeout=probe_timeout, ledger=ledger)
        on_probe()
        await trio.sleep(interval)
