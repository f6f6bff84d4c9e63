"""Prometheus metrics: a registry per daemon, so several daemons can share a process.

Capacity, devices, host memory and invocation figures are read from the
current snapshot and the supervisor at scrape time (a collector), so they can
never drift from what the API serves; refusals and lane work latency are
counted as they happen. Each family has one unit. The list is in
docs/metrics.md. Counters and histograms have no `_created` series (as
dcgm-exporter has none): prometheus_client's are turned off for the process.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import platform
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.metrics_gpu import gpu_families
from machine.snapshot import Amounts, NodeSnapshot
from machine.vram_drift import vram_drift
from supervisor.wire import InvocationState

__all__ = ["CONTENT_TYPE", "NodeMetrics", "SandboxPoolFigures"]

# prometheus_client adds a `<name>_created` gauge to every counter and histogram
# child; the flag is the process's and is read at each scrape.
disable_created_metrics()  # type: ignore[no-untyped-call]  # (unannotated upstream)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Snapshot amount -> `kind` label (the ledger's capacity is the total it hands out from).
_KINDS = {
    "capacity": "total",
    "reserved": "reserved",
    "allocated": "allocated",
    "allocatable": "allocatable",
}
_ACTIVE = (InvocationState.queued, InvocationState.running)


@dataclasses.dataclass(frozen=True)
class SandboxPoolFigures:
    pooled: int
    direct: int
    fill_failures: int
    ready: int


def _version() -> str:
    try:
        return importlib.metadata.version("litegraph-node")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class _StateCollector(Collector):
    def __init__(self, metrics: NodeMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield _build_info()
        snapshot = self._metrics.snapshot() if self._metrics.snapshot else None
        if snapshot is not None:
            yield _node_info(snapshot)
            yield from _capacity(snapshot)
            yield from _host_memory(snapshot)
            yield from gpu_families(snapshot)
        if self._metrics.invocation_counts is not None:
            counts = self._metrics.invocation_counts()
            active = GaugeMetricFamily(
                "litegraph_invocations_active",
                "Invocations queued or running now, by state",
                labels=["state"],
            )
            for state in _ACTIVE:
                active.add_metric([state.value], counts.get(state, 0))
            yield active
        if self._metrics.ended_totals is not None:
            totals = self._metrics.ended_totals()
            ended = CounterMetricFamily(
                "litegraph_invocations_ended",
                "Invocations ended since the daemon started, by final state",
                labels=["state"],
            )
            for state in InvocationState:
                if state not in _ACTIVE and state is not InvocationState.rejected:
                    ended.add_metric([state.value], totals.get(state, 0))
            yield ended
        if self._metrics.sandbox_pool is not None:
            yield from _sandbox_pool(self._metrics.sandbox_pool())
        if self._metrics.claims_held is not None:
            yield GaugeMetricFamily(
                "litegraph_claims_held",
                "Kubernetes claims whose lanes the node holds now (standing holds)",
                value=self._metrics.claims_held(),
            )


def _sandbox_pool(figures: SandboxPoolFigures) -> Iterator[Metric]:
    starts = CounterMetricFamily(
        "litegraph_guest_starts",
        "Confined guests started since the daemon started: in a sandbox made ahead"
        " (ready) or made at the start (direct)",
        labels=["path"],
    )
    starts.add_metric(["ready"], figures.pooled)
    starts.add_metric(["direct"], figures.direct)
    yield starts
    yield CounterMetricFamily(
        "litegraph_sandbox_pool_fill_failures",
        "Ready sandboxes that could not be made (no uid, no cgroup, a failed start)",
        value=figures.fill_failures,
    )
    yield GaugeMetricFamily(
        "litegraph_sandbox_pool_ready",
        "Sandboxes made ahead and waiting for a guest now",
        value=figures.ready,
    )


def _build_info() -> Metric:
    family = GaugeMetricFamily(
        "litegraph_build_info",
        "Always 1; the labels say which build of litegraph-node runs",
        labels=["version", "python", "implementation"],
    )
    family.add_metric([_version(), platform.python_version(), platform.python_implementation()], 1)
    return family


def _node_info(snapshot: NodeSnapshot) -> Metric:
    family = GaugeMetricFamily(
        "litegraph_node_info",
        "Always 1; the labels name the node, its device backend and the GPU driver",
        labels=["node_id", "backend", "driver_version", "cuda_version"],
    )
    family.add_metric(
        [
            snapshot.node_id,
            snapshot.backend,
            snapshot.driver_version or "",
            snapshot.cuda_version or "",
        ],
        1,
    )
    return family


def _amount_family(name: str, text: str, amounts: Amounts) -> Metric:
    family = GaugeMetricFamily(name, text, labels=["kind"])
    for field, kind in _KINDS.items():
        family.add_metric([kind], getattr(amounts, field))
    return family


def _capacity(snapshot: NodeSnapshot) -> Iterator[Metric]:
    capacity = snapshot.capacity
    yield _amount_family(
        "litegraph_capacity_cpu_millis", "CPU for invocations, in millicores", capacity.cpu_millis
    )
    yield _amount_family(
        "litegraph_capacity_memory_bytes", "Memory for invocations, in bytes", capacity.memory_bytes
    )
    yield _amount_family(
        "litegraph_capacity_gpus", "GPU lanes (a whole GPU or a MIG instance each)", capacity.gpus
    )
    vram = GaugeMetricFamily(
        "litegraph_capacity_vram_bytes",
        "GPU memory for invocations per lane, in bytes",
        labels=["kind", "lane_id", "device_id"],
    )
    for lane in capacity.vram_bytes:
        for field, kind in _KINDS.items():
            vram.add_metric([kind, lane.lane_id, lane.device_id], getattr(lane, field))
    yield vram
    drift = GaugeMetricFamily(
        "litegraph_vram_drift_bytes",
        "GPU memory in use (NVML) beyond what the ledger grants on the GPU's lanes, in bytes"
        " (negative: granted and not in use); real GPUs only",
        labels=["device_id"],
    )
    for device in vram_drift(snapshot):
        drift.add_metric([device.device_id], device.drift)
    yield drift


def _host_memory(snapshot: NodeSnapshot) -> Iterator[Metric]:
    memory = snapshot.memory
    yield GaugeMetricFamily(
        "litegraph_host_memory_total_bytes", "Host memory, in bytes", value=memory.total_bytes
    )
    yield GaugeMetricFamily(
        "litegraph_host_memory_available_bytes",
        "Host memory available (MemAvailable, within the daemon's cgroup limit), in bytes",
        value=memory.available_bytes,
    )


class NodeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.snapshot: Callable[[], NodeSnapshot] | None = None
        self.invocation_counts: Callable[[], dict[InvocationState, int]] | None = None
        self.ended_totals: Callable[[], dict[InvocationState, int]] | None = None
        self.sandbox_pool: Callable[[], SandboxPoolFigures] | None = None
        self.claims_held: Callable[[], int] | None = None
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
        self.lane_host_seconds = Histogram(
            "litegraph_lane_host_seconds",
            "Lane owner to lane host round trips inside lane work, by host request",
            ["op"],
            registry=self.registry,
            buckets=(0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 1, 5, 30),
        )
        # CPU seconds, resident memory, open and maximum descriptors, start time.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.registry.register(_StateCollector(self))

    def observe_lane_host(self, op: str, seconds: float) -> None:
        self.lane_host_seconds.labels(op).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
