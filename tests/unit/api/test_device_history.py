"""The per-device history ring: one sample per probe, bounded, forgetting gone devices."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator

import msgspec
import pytest
import trio

from api.device_history import HISTORY_SAMPLES, DeviceHistory
from machine import NodeSnapshot
from tests.supervisor_fixtures import open_machine


@pytest.fixture
async def snapshot(tmp_path: pathlib.Path) -> AsyncIterator[NodeSnapshot]:
    machine = await open_machine(tmp_path)
    try:
        yield machine.snapshot(sequence=1)
    finally:
        with trio.CancelScope(shield=True):
            await machine.aclose()


def _at(snapshot: NodeSnapshot, n: int) -> NodeSnapshot:
    """The snapshot of probe `n`: its own time and temperature on every device."""
    devices = tuple(msgspec.structs.replace(d, temperature_c=float(n)) for d in snapshot.devices)
    return msgspec.structs.replace(snapshot, observed_at=f"t{n}", devices=devices)


async def test_keeps_the_newest_samples_of_each_device_oldest_first(snapshot: NodeSnapshot) -> None:
    history = DeviceHistory(interval_s=5)
    for n in range(HISTORY_SAMPLES + 30):
        history.record(_at(snapshot, n))
    reply = history.reply()
    assert reply.max_samples == HISTORY_SAMPLES and reply.interval_s == 5
    assert [s.device_id for s in reply.devices] == [d.device_id for d in snapshot.devices]
    for series in reply.devices:
        assert len(series.samples) == HISTORY_SAMPLES  # bounded, however long it runs
        assert [s.temperature_c for s in series.samples] == [
            float(n) for n in range(30, HISTORY_SAMPLES + 30)
        ]
        assert series.samples[-1].at == f"t{HISTORY_SAMPLES + 29}"
        assert series.samples[-1].health == "healthy"


async def test_a_device_gone_from_the_snapshot_is_forgotten(snapshot: NodeSnapshot) -> None:
    history = DeviceHistory(interval_s=5, max_samples=4)
    history.record(_at(snapshot, 1))
    first, *rest = snapshot.devices
    history.record(msgspec.structs.replace(_at(snapshot, 2), devices=tuple(rest)))
    reply = history.reply()
    assert first.device_id not in [s.device_id for s in reply.devices]
    assert [len(s.samples) for s in reply.devices] == [2] * len(rest)


async def test_an_unread_field_is_null_not_zero(snapshot: NodeSnapshot) -> None:
    history = DeviceHistory(interval_s=5)
    unread = tuple(
        msgspec.structs.replace(d, temperature_c=None, power_w=None) for d in snapshot.devices
    )
    history.record(msgspec.structs.replace(snapshot, devices=unread))
    sample = history.reply().devices[0].samples[0]
    assert sample.temperature_c is None and sample.power_w is None
