"""GPU metrics in dcgm-exporter's names, units and labels, read from a snapshot.

A dashboard built for NVIDIA's dcgm-exporter works on these series: each GPU
carries `gpu`, `UUID`, `device`, `modelName`, `Hostname` and `pci_bus_id`; a
MIG instance adds `GPU_I_PROFILE` and `GPU_I_ID` to its GPU's labels. A
reading the device does not support is left out, never reported as 0.
dcgm-exporter declares the ECC counts counters; they are gauges here because
the text format would rename a counter `..._TOTAL_total` (and the volatile
counts return to 0 when the GPU is reset).
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
    # Without a GPU instance id (not reported), the instance's uuid keeps its series apart.
    gi = str(mig.gpu_instance_id) if mig.gpu_instance_id is not None else mig.mig_uuid
    return {**base, "GPU_I_PROFILE": mig.profile, "GPU_I_ID": gi}


def gpu_families(snapshot: NodeSnapshot) -> Iterator[Metric]:
    """The dcgm-style families, XID totals and device health of every GPU."""
    families = {name: GaugeMetricFamily(name, text) for name, text, _, _ in _DEVICE_FIELDS}
    xids = CounterMetricFamily(
        "litegraph_gpu_xid_errors", "XID events seen since the daemon started", labels=None
    )
    health = GaugeMetricFamily(
        "litegraph_device_health",
        "1 for the device's current health state",
        labels=["device_id", "state"],
    )
    for index, device in enumerate(snapshot.devices):
        labels = _labels(index, device, snapshot.node_id)
        for name, _, attribute, scale in _DEVICE_FIELDS:
            value = getattr(device, attribute)
            if value is not None:
                families[name].add_sample(name, labels, value * scale)
        for mig in device.mig_instances:
            mig_labels = _mig_labels(labels, mig)
            for name, attribute in _MIG_FIELDS.items():
                value = getattr(mig, attribute)
                if value is not None:
                    families[name].add_sample(name, mig_labels, value * _SCALE[attribute])
        if device.xid_errors is not None:
            xids.add_sample("litegraph_gpu_xid_errors_total", labels, device.xid_errors)
        for state in HealthState:
            health.add_metric(
                [device.device_id, state.value], 1.0 if device.health is state else 0.0
            )
    yield from families.values()
    yield xids
    yield health
