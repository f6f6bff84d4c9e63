"""The node's lanes as ResourceSlices: what the API server of Kubernetes 1.34 to 1.37
takes (kubernetes-validate, strict), split and tainted as its limits and the devices'
health say."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest

from kubeplugin.slices import (
    HEALTH_TAINT,
    OfferedDevice,
    SliceError,
    Version,
    resource_slices,
    slice_name,
)
from kubeplugin.sockets import DRIVER_NAME

GIB = 1 << 30
WHEN = "2026-12-02T12:00:00Z"
GPU = OfferedDevice(
    name="gpu-0",
    memory_bytes=80 * GIB,
    attributes={
        "type": "gpu",
        "uuid": "GPU-5f1c",
        "productName": "NVIDIA H200",
        "cudaComputeCapability": Version("9.0.0"),
        "driverVersion": Version("570.86.15"),
        "resource.kubernetes.io/pciBusID": "0000:3b:00.0",
    },
)
MIG = OfferedDevice(
    name="gpu-1-mig-1g-18gb-0",
    memory_bytes=18 * GIB,
    attributes={"type": "mig", "profile": "1g.18gb", "parentUUID": "GPU-77aa", "uuid": "MIG-1"},
)
# A shared GPU's VRAM, not a whole number of GiB: offered in whole steps.
SHARED = OfferedDevice(name="gpu-2-shared", memory_bytes=141 * GIB + 12345, shared=True)


def _valid(slices: list[dict[str, Any]], versions: tuple[str, ...]) -> None:
    for version in versions:
        for found in slices:
            kubernetes_validate.validate(found, version, strict=True)


def test_whole_gpus_and_mig_instances_are_devices_every_supported_version_takes() -> None:
    slices = resource_slices("node-a", [GPU, MIG], generation=3, added_at=WHEN)
    _valid(slices, ("1.34", "1.35", "1.36", "1.37"))
    (only,) = slices
    spec = only["spec"]
    assert spec["pool"] == {"name": "node-a", "generation": 3, "resourceSliceCount": 1}
    assert (spec["driver"], spec["nodeName"]) == ("lanes.litegraph.dev", "node-a")
    gpu = spec["devices"][0]
    assert gpu["attributes"]["driverVersion"] == {"version": "570.86.15"}
    assert gpu["capacity"] == {"memory": {"value": str(80 * GIB)}}
    assert "taints" not in gpu and "allowMultipleAllocations" not in gpu


def test_a_shared_gpus_vram_is_one_device_many_claims_take_part_of() -> None:
    slices = resource_slices("node-a", [SHARED], generation=1, added_at=WHEN)
    _valid(slices, ("1.36", "1.37"))  # consumable capacity: 1.36 and later
    device = slices[0]["spec"]["devices"][0]
    assert device["allowMultipleAllocations"] is True
    memory = device["capacity"]["memory"]
    assert memory["value"] == str(141 * GIB)  # whole steps only
    assert memory["requestPolicy"]["validRange"] == {
        "min": str(GIB), "max": str(141 * GIB), "step": str(GIB),
    }  # fmt: skip
    with pytest.raises(SliceError, match="less than 1 GiB"):
        resource_slices(
            "n", [OfferedDevice("tiny", GIB - 1, shared=True)], generation=1, added_at=WHEN
        )


def test_unhealthy_and_lost_devices_are_tainted_and_slices_hold_at_most_64_then() -> None:
    sick = OfferedDevice(name="gpu-0", memory_bytes=GIB, health="unhealthy")
    lost = OfferedDevice(name="gpu-1", memory_bytes=GIB, health="lost")
    many = [OfferedDevice(name=f"gpu-{i}", memory_bytes=GIB) for i in range(2, 100)]
    slices = resource_slices("node-a", [sick, lost, *many], generation=7, added_at=WHEN)
    _valid(slices, ("1.34", "1.37"))
    assert [len(s["spec"]["devices"]) for s in slices] == [64, 36]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {2}
    first, second = slices[0]["spec"]["devices"][:2]
    assert first["taints"] == [
        {"key": HEALTH_TAINT, "value": "unhealthy", "effect": "NoSchedule", "timeAdded": WHEN}
    ]
    assert second["taints"][0]["effect"] == "NoExecute"
    healthy = [OfferedDevice(name=f"gpu-{i}", memory_bytes=GIB) for i in range(100)]
    assert len(resource_slices("n", healthy, generation=1, added_at=WHEN)) == 1  # 128 a slice


def test_devices_the_api_server_would_refuse_are_refused_here() -> None:
    for bad in ("GPU_0", "-gpu", "g" * 64):
        with pytest.raises(SliceError, match="DNS label"):
            resource_slices("n", [OfferedDevice(bad, GIB)], generation=1, added_at=WHEN)
    with pytest.raises(SliceError, match="repeat"):
        resource_slices("n", [GPU, GPU], generation=1, added_at=WHEN)
    crowded = OfferedDevice("gpu-0", GIB, attributes={f"a{i}": i for i in range(32)})
    with pytest.raises(SliceError, match="attributes"):
        resource_slices("n", [crowded], generation=1, added_at=WHEN)


def test_a_long_node_name_still_names_its_slices_apart_within_253_characters() -> None:
    long_a = ".".join(["a" * 60] * 4)  # 243 characters, a valid node name
    long_b = long_a[:-1] + "b"
    names = {slice_name(node, DRIVER_NAME, 0) for node in (long_a, long_b)}
    assert len(names) == 2
    for name in names:
        assert len(name) <= 253
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name), name
    (built,) = resource_slices(long_a, [], generation=1, added_at="")
    _valid([built], ("1.34", "1.35", "1.36", "1.37"))
    assert slice_name("node-a", DRIVER_NAME, 1) == "node-a-lanes.litegraph.dev-1"
