"""Prometheus metrics: a registry per daemon, so several daemons can share a process.

Capacity, health and invocation counts are read from the current snapshot and
the supervisor at scrape time (a collector), so they can never drift from
what the API serves; refusals and lane work latency are counted as they happen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from node.machine.health import HealthState
from node.machine.snapshot import Amounts, NodeSnapshot
from supervisor.wire import InvocationState

__all__ = ["CONTENT_TYPE", "NodeMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_AMOUNTS = ("capacity", "reserved", "allocated", "allocatable")


class _StateCollector(Collector):
    def __init__(self, metrics: NodeMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        snapshot = self._metrics.snapshot() if self._metrics.snapshot else None
        if snapshot is not None:
            yield from _capacity(snapshot)
            yield from _devices(snapshot)
        counts = self._metrics.invocation_counts() if self._metrics.invocation_counts else None
        if counts is not None:
            family = GaugeMetricFamily(
                "litegraph_invocations", "Invocations known to the node by state", labels=["state"]
            )
            for state, count in counts.items():
                family.add_metric([state.value], count)
            yield family


def _capacity(snapshot: NodeSnapshot) -> Iterator[Metric]:
    for kind in _AMOUNTS:
        family = GaugeMetricFamily(
            f"litegraph_resource_{kind}",
            f"Resource {kind} (cpu in millis, memory and vram in bytes, gpus in lanes)",
            labels=["resource", "lane_id"],
        )
        sections: list[tuple[str, str, Amounts]] = [
            ("cpu_millis", "", snapshot.capacity.cpu_millis),
            ("memory_bytes", "", snapshot.capacity.memory_bytes),
            ("gpus", "", snapshot.capacity.gpus),
        ]
        for resource, device, amounts in sections:
            family.add_metric([resource, device], getattr(amounts, kind))
        for vram in snapshot.capacity.vram_bytes:
            family.add_metric(["vram_bytes", vram.lane_id], getattr(vram, kind))
        yield family


def _devices(snapshot: NodeSnapshot) -> Iterator[Metric]:
    health = GaugeMetricFamily(
        "litegraph_device_health",
        "1 for the device's current health state",
        labels=["device_id", "state"],
    )
    temperature = GaugeMetricFamily(
        "litegraph_device_temperature_celsius", "GPU temperature", labels=["device_id"]
    )
    for device in snapshot.devices:
        for state in HealthState:
            health.add_metric(
                [device.device_id, state.value], 1.0 if device.health is state else 0.0
            )
        if device.temperature_c is not None:
            temperature.add_metric([device.device_id], device.temperature_c)
    yield health
    yield temperature


class NodeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.snapshot: Callable[[], NodeSnapshot] | None = None
        self.invocation_counts: Callable[[], dict[InvocationState, int]] | None = None
        self.admission_refusals = Counter(
            "litegraph_admission_refusals",
            "Submissions refused at admission, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.token_refusals = Counter(
            "litegraph_token_refusals",
            "Capability tokens refused by lane owners, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.lane_work_seconds = Histogram(
            "litegraph_lane_work_seconds",
            "Lane work latency from request to reply",
            ["op"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
        )
        self.registry.register(_StateCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)
