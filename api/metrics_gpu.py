"""GPU metrics in dcgm-exporter's names, units and labels, read from a snapshot.

A dashboard built for NVIDIA's dcgm-exporter works on these series: each GPU
carries `gpu`, `UUID`, `device`, `modelName`, `Hostname` and `pci_bus_id`; a
MIG instance adds `GPU_I_PROFILE` and `GPU_I_ID` to its GPU's labels. A
reading the device does not support is left out, never reported as 0.
dcgm-exporter declares the ECC, energy, PCIe replay and remapped-row counts
counters; they are gauges here because the text format would rename a counter
`..._TOTAL_total` (and the volatile counts return to 0 when the GPU is reset).

The node's own GPU series (`litegraph_*`) keep to promtool's naming rules
(no camelCase label): they carry `device_id` and, to join with the DCGM
series, `UUID` (a MIG instance: its GPU's uuid and `GPU_I_ID`, as DCGM labels
the instance).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from machine.health import HealthState
from machine.snapshot import DeviceSection, MigSection, NodeSnapshot

__all__ = ["gpu_families"]

MiB = 1 << 20

# (dcgm field, help, DeviceSection attribute, scale); the help texts are dcgm-exporter's.
_DEVICE_FIELDS: tuple[tuple[str, str, str, float], ...] = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "utilization_gpu_percent", 1),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", "utilization_memory_percent", 1),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "memory_used_bytes", 1 / MiB),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", "memory_free_bytes", 1 / MiB),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_w", 1),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temperature_c", 1),
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "sm_clock_mhz", 1),
    ("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", "memory_clock_mhz", 1),
    ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", "last_xid", 1),
    (
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "Total number of single-bit volatile ECC errors.",
        "ecc_volatile_corrected",
        1,
    ),
    (
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "Total number of double-bit volatile ECC errors.",
        "ecc_volatile_uncorrected",
        1,
    ),
    (
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        "Total number of single-bit persistent ECC errors.",
        "ecc_aggregate_corrected",
        1,
    ),
    (
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        "Total number of double-bit persistent ECC errors.",
        "ecc_aggregate_uncorrected",
        1,
    ),
    (
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "Total energy consumption since boot (in mJ).",
        "total_energy_mj",
        1,
    ),
    (
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "Total number of PCIe retries.",
        "pcie_replay_count",
        1,
    ),
    (
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "Number of remapped rows for uncorrectable errors",
        "remapped_rows_uncorrectable",
        1,
    ),
    (
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "Number of remapped rows for correctable errors",
        "remapped_rows_correctable",
        1,
    ),
    (
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "Whether remapping of rows has failed",
        "remapped_rows_failed",
        1,
    ),
)
_SCALE = {attribute: scale for _, _, attribute, scale in _DEVICE_FIELDS}
# The fields a MIG instance reports on its own (NVML reads the rest per GPU only).
_MIG_FIELDS = {
    "DCGM_FI_DEV_GPU_UTIL": "utilization_gpu_percent",
    "DCGM_FI_DEV_MEM_COPY_UTIL": "utilization_memory_percent",
    "DCGM_FI_DEV_FB_USED": "memory_used_bytes",
    "DCGM_FI_DEV_FB_FREE": "memory_free_bytes",
}


def _labels(index: int, device: DeviceSection, hostname: str) -> dict[str, str]:
    return {
        "gpu": str(index),
        "UUID": device.device_id,
        "device": f"nvidia{device.minor_number}" if device.minor_number is not None else "",
        "modelName": device.model,
        "Hostname": hostname,
        "pci_bus_id": device.pci_bus_id or "",
    }


def _mig_labels(base: dict[str, str], mig: MigSection) -> dict[str, str]:
    return {**base, "GPU_I_PROFILE": mig.profile, "GPU_I_ID": _gpu_instance(mig)}


def _gpu_instance(mig: MigSection) -> str:
    # Without a GPU instance id (not reported), the instance's uuid keeps its series apart.
    return str(mig.gpu_instance_id) if mig.gpu_instance_id is not None else mig.mig_uuid


def _health(family: GaugeMetricFamily, labels: dict[str, str], state: HealthState | None) -> None:
    for each in HealthState:
        value = 1.0 if state is each else 0.0
        family.add_sample(family.name, {**labels, "state": each.value}, value)


def gpu_families(snapshot: NodeSnapshot) -> Iterator[Metric]:
    """The dcgm-style families, XID totals and the health of every GPU and MIG instance."""
    families = {name: GaugeMetricFamily(name, text) for name, text, _, _ in _DEVICE_FIELDS}
    xids = CounterMetricFamily(
        "litegraph_gpu_xid_errors", "XID events seen since the daemon started", labels=None
    )
    health = GaugeMetricFamily(
        "litegraph_device_health",
        "1 for the device's current health state (a GPU, or a MIG instance on its own)",
        labels=None,
    )
    for index, device in enumerate(snapshot.devices):
        labels = _labels(index, device, snapshot.node_id)
        own = {"device_id": device.device_id, "UUID": device.device_id}
        for name, _, attribute, scale in _DEVICE_FIELDS:
            value = getattr(device, attribute)
            if value is not None:
                families[name].add_sample(name, labels, float(value) * scale)
        _health(health, own, device.health)
        for mig in device.mig_instances:
            mig_labels = _mig_labels(labels, mig)
            for name, attribute in _MIG_FIELDS.items():
                value = getattr(mig, attribute)
                if value is not None:
                    families[name].add_sample(name, mig_labels, value * _SCALE[attribute])
            if mig.health is not None:  # absent in documents from before the field
                mig_own = {"device_id": mig.mig_uuid, "UUID": device.device_id}
                _health(health, {**mig_own, "GPU_I_ID": _gpu_instance(mig)}, mig.health)
        if device.xid_errors is not None:
            xids.add_sample("litegraph_gpu_xid_errors_total", own, device.xid_errors)
    yield from families.values()
    yield xids
    yield health
