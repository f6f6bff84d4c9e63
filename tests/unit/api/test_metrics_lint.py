"""The /metrics page passes `promtool check metrics` on the node's own series
(tests/promlint.py: promlint's rules, ported), has no `_created` series, and
documents every family it serves in docs/metrics.md (and no family it lacks);
device health joins the DCGM series on `UUID` (and `GPU_I_ID` for a MIG
instance), and dcgm-exporter's default energy, PCIe replay and row-remapping
counters are there."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from prometheus_client.samples import Sample

from api.metrics import NodeMetrics, SandboxPoolFigures
from supervisor.wire import InvocationState
from tests.fakes.fake_pynvml import FakeNvml, gpu_and_mig
from tests.promlint import Problem, lint, parse
from tests.unit.api.test_metrics import metrics_of, only, open_machine, scrape, series

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "metrics.md"
DOCUMENTED = re.compile(r"`((?:litegraph|DCGM_FI|process|python)_[A-Za-z0-9_]+)")


def full(metrics: NodeMetrics) -> NodeMetrics:
    """Every family the daemon serves has samples: counters, histograms, invocations."""
    metrics.invocation_counts = lambda: {InvocationState.running: 1}
    metrics.ended_totals = lambda: {InvocationState.succeeded: 2}
    metrics.sandbox_pool = lambda: SandboxPoolFigures(pooled=3, direct=1, fill_failures=0, ready=2)
    metrics.claims_held = lambda: 1
    metrics.admission_refusals.labels("node_drained").inc()
    metrics.token_refusals.labels("expired").inc()
    metrics.lane_work_seconds.labels("execute").observe(0.02)
    metrics.observe_lane_host("run", 0.001)
    return metrics


@asynccontextmanager
async def node(tmp_path: Path, devices: str, nvml: FakeNvml | None = None) -> AsyncIterator[str]:
    """The whole page of a node with these devices (nvml: the fake's GPU and MIG GPU)."""
    if devices == "nvml" and nvml is None:
        nvml = gpu_and_mig()
    machine = await open_machine(tmp_path, devices=devices, nvml=nvml)
    try:
        yield full(metrics_of(machine)).render().decode()
    finally:
        await machine.aclose()


def test_the_port_finds_what_promlint_finds() -> None:
    page = "\n".join(
        [
            "# HELP litegraph_ok_bytes fine",
            "# TYPE litegraph_ok_bytes gauge",
            'litegraph_ok_bytes{UUID="GPU-a",GPU_I_ID="1",Hostname="h"} 1',
            "# TYPE litegraph_refusals counter",
            'litegraph_refusals{reason="x"} 1',
            "# HELP litegraph_used_total a gauge",
            "# TYPE litegraph_used_total gauge",
            "litegraph_used_total 1",
            "# HELP litegraph_wait_milliseconds a time",
            "# TYPE litegraph_wait_milliseconds gauge",
            "litegraph_wait_milliseconds 1",
            "# HELP litegraph_wait_ms a time",
            "# TYPE litegraph_wait_ms gauge",
            "litegraph_wait_ms 1",
            "# HELP litegraph_xids_total errors",
            "# TYPE litegraph_xids_total counter",
            'litegraph_xids_total{modelName="A100"} 1',
            'litegraph_xids_total{modelName="A100"} 2',
            "# HELP litegraph_jobs_count jobs",
            "# TYPE litegraph_jobs_count gauge",
            'litegraph_jobs_count{le="1"} 1',
            "# HELP litegraph_queue_gauge depth",
            "# TYPE litegraph_queue_gauge gauge",
            "litegraph_queue_gauge 1",
            "# HELP litegraph:ratio ratio",
            "# TYPE litegraph:ratio gauge",
            "litegraph:ratio 1",
        ]
    )
    assert lint(page) == sorted(
        [
            Problem("litegraph:ratio", "metric names should not contain ':'"),
            Problem("litegraph_jobs_count", 'non-histogram metrics should not have "le" label'),
            Problem(
                "litegraph_jobs_count",
                'non-histogram and non-summary metrics should not have "_count" suffix',
            ),
            Problem("litegraph_queue_gauge", "metric name should not include type 'gauge'"),
            Problem("litegraph_refusals", "no help text"),
            Problem("litegraph_refusals", 'counter metrics should have "_total" suffix'),
            Problem("litegraph_used_total", 'non-counter metrics should not have "_total" suffix'),
            Problem(
                "litegraph_wait_milliseconds", 'use base unit "seconds" instead of "milliseconds"'
            ),
            Problem("litegraph_wait_ms", "metric names should not contain abbreviated units"),
            Problem(
                "litegraph_xids_total",
                "label names should be written in 'snake_case' not 'camelCase': modelName",
            ),
            Problem(
                "litegraph_xids_total", "duplicate series litegraph_xids_total{'modelName': 'A100'}"
            ),
        ]
    )
    # As promtool reads the page: a counter's family is named with `_total`.
    (family,) = [f for f in parse(page) if f.name == "litegraph_xids_total"]
    assert family.type == "counter" and len(family.samples) == 2
    with pytest.raises(ValueError, match="second HELP"):
        parse("# HELP a x\n# HELP a y\n")


@pytest.mark.parametrize("devices", ["nvml", "sim", "none"])
async def test_the_nodes_own_series_pass_promtool_check_metrics(
    tmp_path: Path, devices: str
) -> None:
    async with node(tmp_path, devices) as page:
        own = [f for f in parse(page) if f.name.startswith("litegraph_")]
        assert {"litegraph_device_health", "litegraph_lane_work_seconds"} <= {f.name for f in own}
        problems = [p for p in lint(page) if p.metric.startswith("litegraph_")]
        assert problems == []


async def test_dcgm_series_keep_dcgm_exporters_labels(tmp_path: Path) -> None:
    async with node(tmp_path, "nvml") as page:
        dcgm = [f for f in parse(page) if f.name.startswith("DCGM_FI_")]
        assert dcgm
        for family in dcgm:
            for _, labels in family.samples:
                assert {"gpu", "UUID", "device", "modelName", "Hostname", "pci_bus_id"} <= set(
                    labels
                ), family.name


async def test_there_are_no_created_series(tmp_path: Path) -> None:
    async with node(tmp_path, "nvml") as page:
        created = [f.name for f in parse(page) if f.name.endswith("_created")]
        assert created == []
        assert "litegraph_admission_refusals_total" in {f.name for f in parse(page)}


def documented() -> set[str]:
    """Metric names in docs/metrics.md's tables, the renamed (gone) ones left out."""
    text = DOC.read_text().split("\n## Renamed", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return {name for row in rows for name in DOCUMENTED.findall(row)}


async def test_every_served_family_is_documented_and_every_documented_one_served(
    tmp_path: Path,
) -> None:
    served: set[str] = set()
    for devices in ("nvml", "sim"):
        async with node(tmp_path / devices, devices) as page:
            served |= {f.name for f in parse(page)}
    doc = documented()
    assert sorted(served - doc) == []  # every family on the page is in the doc
    assert sorted(doc - served) == []  # and the doc lists none the page lacks


def health_of(samples: list[Sample], **labels: str) -> str:
    (state,) = [s.labels["state"] for s in series(samples, **labels) if s.value == 1]
    return state


async def test_device_health_joins_the_dcgm_series_on_uuid_and_gpu_instance(
    tmp_path: Path,
) -> None:
    fake = gpu_and_mig()
    machine = await open_machine(tmp_path, devices="nvml", nvml=fake)
    try:
        fams = scrape(metrics_of(machine))
        health = fams["litegraph_device_health"]
        # One state per device: GPU-a, GPU-b and its two instances.
        assert {s.labels["device_id"] for s in health} == {"GPU-a", "GPU-b", "MIG-b1", "MIG-b2"}
        # `on(UUID, GPU_I_ID)`: each DCGM series finds exactly its device's health.
        for sample in fams["DCGM_FI_DEV_FB_USED"]:
            key = {"UUID": sample.labels["UUID"], "GPU_I_ID": sample.labels.get("GPU_I_ID", "")}
            assert health_of(health, **key) == "healthy", key
        assert series(health, UUID="GPU-b", GPU_I_ID="9", state="healthy")[0].labels == {
            "device_id": "MIG-b2",
            "UUID": "GPU-b",
            "GPU_I_ID": "9",
            "state": "healthy",
        }
        # A fatal XID the driver names MIG-b2 in takes out that instance alone.
        fake.push_xid("MIG-b2", 94)
        await machine.probe()
        health = scrape(metrics_of(machine))["litegraph_device_health"]
        assert health_of(health, UUID="GPU-b", GPU_I_ID="9") == "unhealthy"
        assert health_of(health, UUID="GPU-b", GPU_I_ID="2") == "healthy"
        assert health_of(health, UUID="GPU-b", GPU_I_ID="") == "healthy"
        (instance,) = [
            m for d in machine.snapshot().devices for m in d.mig_instances if m.mig_uuid == "MIG-b2"
        ]
        assert instance.health is not None and instance.health.value == "unhealthy"
        assert instance.health_reasons and instance.health_reasons[0].startswith("xid_94")
        # The node's XID count joins the same way (and has no camelCase label).
        xids = scrape(metrics_of(machine))["litegraph_gpu_xid_errors"]
        assert {frozenset(s.labels) for s in xids} == {frozenset({"device_id", "UUID"})}
        assert only(xids, UUID="GPU-b") == 1
    finally:
        await machine.aclose()


async def test_dcgm_default_energy_pcie_replay_and_row_remap_counters(tmp_path: Path) -> None:
    fake = gpu_and_mig()
    a, b = fake.gpus
    a.energy_mj, a.pcie_replays, a.remapped_rows = 123_456_789, 7, (3, 1, 0, 0)
    b.remapped_rows = (0, 2, 0, 1)  # a remapping failed
    b.unsupported.add("nvmlDeviceGetTotalEnergyConsumption")  # before Volta: none
    machine = await open_machine(tmp_path, devices="nvml", nvml=fake)
    try:
        fams = scrape(metrics_of(machine))
        assert only(fams["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"], UUID="GPU-a") == 123_456_789
        assert series(fams["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"], UUID="GPU-b") == []
        assert only(fams["DCGM_FI_DEV_PCIE_REPLAY_COUNTER"], UUID="GPU-a") == 7
        assert only(fams["DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"], UUID="GPU-a") == 3
        assert only(fams["DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"], UUID="GPU-a") == 1
        assert only(fams["DCGM_FI_DEV_ROW_REMAP_FAILURE"], UUID="GPU-a") == 0
        assert only(fams["DCGM_FI_DEV_ROW_REMAP_FAILURE"], UUID="GPU-b") == 1
        assert only(fams["DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"], UUID="GPU-b") == 2
        # They are the GPU's: no MIG instance has them.
        for name in (
            "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
            "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
            "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        ):
            assert all("GPU_I_ID" not in s.labels for s in fams[name]), name
            assert fams[name][0].labels["modelName"]  # dcgm-exporter's labels
        snap = {d.device_id: d for d in machine.snapshot().devices}
        assert (
            snap["GPU-a"].total_energy_mj == 123_456_789 and snap["GPU-b"].total_energy_mj is None
        )
        assert snap["GPU-b"].remapped_rows_failed is True
    finally:
        await machine.aclose()
