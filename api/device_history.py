"""A bounded ring of recent telemetry samples per device, for the status page.

The health monitor probes every `--health-interval` seconds; after each probe
the daemon calls `record` with the fresh snapshot, which appends one sample
per device. Each device keeps its newest `HISTORY_SAMPLES`; a device that is
no longer in the snapshot is forgotten, so memory is bounded by the devices
the node has, times `HISTORY_SAMPLES`. The ring lives in memory only: a
restarted daemon starts with no history, a reloaded page gets it at once.
"""

from __future__ import annotations

import collections

import msgspec

from machine.snapshot import DeviceSection, NodeSnapshot

__all__ = ["HISTORY_SAMPLES", "DeviceHistory", "DeviceHistoryReply", "DeviceSample", "DeviceSeries"]

HISTORY_SAMPLES = 120


class DeviceSample(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One probe's readings of one device; a field is None when it was not read."""

    at: str  # RFC 3339, UTC: the snapshot's observed_at
    health: str
    memory_used_bytes: int | None = None
    utilization_gpu_percent: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None


class DeviceSeries(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    device_id: str
    memory_total_bytes: int
    samples: tuple[DeviceSample, ...]  # oldest first


class DeviceHistoryReply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_samples: int
    interval_s: float
    devices: tuple[DeviceSeries, ...]


def _sample(at: str, device: DeviceSection) -> DeviceSample:
    return DeviceSample(
        at=at,
        health=str(device.health),
        memory_used_bytes=device.memory_used_bytes,
        utilization_gpu_percent=device.utilization_gpu_percent,
        temperature_c=device.temperature_c,
        power_w=device.power_w,
    )


class DeviceHistory:
    def __init__(self, interval_s: float, max_samples: int = HISTORY_SAMPLES) -> None:
        self._interval_s = interval_s
        self._max = max_samples
        self._rings: dict[str, collections.deque[DeviceSample]] = {}
        self._totals: dict[str, int] = {}

    def record(self, snapshot: NodeSnapshot) -> None:
        """Append one sample per device of `snapshot`; forget devices it no longer has."""
        rings: dict[str, collections.deque[DeviceSample]] = {}
        for device in snapshot.devices:
            ring = self._rings.get(device.device_id) or collections.deque(maxlen=self._max)
            ring.append(_sample(snapshot.observed_at, device))
            rings[device.device_id] = ring
            self._totals[device.device_id] = device.memory_total_bytes
        self._rings = rings
        self._totals = {d: self._totals[d] for d in rings}

    def reply(self) -> DeviceHistoryReply:
        return DeviceHistoryReply(
            max_samples=self._max,
            interval_s=self._interval_s,
            devices=tuple(
                DeviceSeries(
                    device_id=device_id,
                    memory_total_bytes=self._totals[device_id],
                    samples=tuple(ring),
                )
                for device_id, ring in self._rings.items()
            ),
        )
