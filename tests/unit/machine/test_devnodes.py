"""MIG capability nodes, against temporary folders standing in for /dev and /proc.

With the driver's capabilities in /dev (`nvidia-caps` in /proc/devices), a MIG
lane needs /dev/nvidia-caps/nvidia-capN for its GPU instance and its compute
instance, N read from the driver's access file as nvidia-modprobe reads it: a
missing node is made (major from /proc/devices, mode from the access file),
and where it cannot be made the lane is refused with a typed reason. With the
capabilities only in /proc, guests could open every instance's: MIG lanes are
refused.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from machine.devnodes import check_mig_caps, lane_device_nodes, mig_caps_mode
from machine.inventory import CpuInfo, GpuDevice, Inventory, MemoryInfo, MigInstance
from machine.lanes import Lane, LaneKind, build_lanes

CAPS_MAJOR = 237


def inventory() -> Inventory:
    return Inventory(
        backend="nvml",
        cpu=CpuInfo(
            logical_cores=2, physical_cores=2, model="m", numa_nodes=1, capacity_millis=2000
        ),
        memory=MemoryInfo(total_bytes=2**32, available_bytes=2**32, capacity_bytes=2**32),
        gpus=(
            GpuDevice(
                uuid="GPU-a", name="a", pci_bus_id=None, memory_total_bytes=2**30, minor_number=0
            ),
            GpuDevice(
                uuid="GPU-b",
                name="b",
                pci_bus_id=None,
                memory_total_bytes=2**30,
                minor_number=1,
                mig_enabled=True,
                mig_instances=(
                    MigInstance(
                        uuid="MIG-b1",
                        name="1g.5gb",
                        memory_total_bytes=2**29,
                        gpu_instance_id=2,
                        compute_instance_id=0,
                    ),
                ),
            ),
        ),
    )


def driver(proc: Path, *, devfs: bool, minors: dict[str, int]) -> None:
    """The driver's files under `proc`: /proc/devices, the capabilities' access files
    and the mig-minors list."""
    caps = f"{CAPS_MAJOR} nvidia-caps\n" if devfs else ""
    (proc / "devices").parent.mkdir(parents=True, exist_ok=True)
    (proc / "devices").write_text(
        f"Character devices:\n  1 mem\n195 nvidia\n{caps}\nBlock devices:\n  8 sd\n"
    )
    listing = []
    for key, minor in minors.items():  # "gpu1/gi2" or "gpu1/gi2/ci0"
        gpu, *rest = key.split("/")
        access = proc / "driver/nvidia/capabilities" / gpu / "mig" / "/".join(rest) / "access"
        access.parent.mkdir(parents=True, exist_ok=True)
        access.write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
        listing.append(f"{key}/access {minor}")
    (proc / "driver/nvidia-caps").mkdir(parents=True, exist_ok=True)
    (proc / "driver/nvidia-caps/mig-minors").write_text("\n".join(listing) + "\n")


def mig_lane(inv: Inventory) -> Lane:
    return next(lane for lane in build_lanes(inv) if lane.kind is LaneKind.MIG)


MINORS = {"gpu1/gi2": 21, "gpu1/gi2/ci0": 22}


def test_the_mode_is_read_from_the_driver(tmp_path: Path) -> None:
    assert mig_caps_mode(tmp_path / "none").value == "none"
    driver(tmp_path / "devfs", devfs=True, minors=MINORS)
    assert mig_caps_mode(tmp_path / "devfs").value == "devfs"
    driver(tmp_path / "procfs", devfs=False, minors=MINORS)
    assert mig_caps_mode(tmp_path / "procfs").value == "procfs"


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs CAP_MKNOD")
def test_missing_caps_nodes_are_made_as_nvidia_modprobe_makes_them(tmp_path: Path) -> None:
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    driver(proc, devfs=True, minors=MINORS)
    dev.mkdir()
    inv = inventory()
    assert check_mig_caps(inv, build_lanes(inv), dev, proc) == {}
    for minor in (21, 22):
        node = os.stat(dev / f"nvidia-caps/nvidia-cap{minor}")
        assert stat.S_ISCHR(node.st_mode) and stat.S_IMODE(node.st_mode) == 0o444
        assert (os.major(node.st_rdev), os.minor(node.st_rdev)) == (CAPS_MAJOR, minor)
    nodes = lane_device_nodes(inv, mig_lane(inv), dev, proc_root=proc)
    assert {p.name for p in nodes} >= {"nvidia-cap21", "nvidia-cap22"}
    # Made once: a second check finds them right and makes nothing.
    assert check_mig_caps(inv, build_lanes(inv), dev, proc) == {}


def test_caps_nodes_that_cannot_be_made_refuse_the_lane_with_a_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    driver(proc, devfs=True, minors=MINORS)
    dev.mkdir()
    made: list[tuple[Path, int, int]] = []

    def refuse(path: Path, mode: int, device: int) -> None:
        made.append((path, mode, device))
        raise PermissionError(1, "Operation not permitted")

    inv = inventory()
    lane = mig_lane(inv)
    with caplog.at_level(logging.WARNING, logger="machine.devnodes"):
        refused = check_mig_caps(inv, build_lanes(inv), dev, proc, make_node=refuse)
    assert list(refused) == [lane.lane_id]
    assert refused[lane.lane_id].startswith("mig_caps_missing: ")
    assert str(dev / "nvidia-caps/nvidia-cap21") in refused[lane.lane_id]
    assert made == [
        (dev / "nvidia-caps/nvidia-cap21", stat.S_IFCHR | 0o444, os.makedev(CAPS_MAJOR, 21))
    ]
    assert any(lane.lane_id in r.getMessage() for r in caplog.records)


def test_a_caps_path_that_is_not_the_device_refuses_the_lane(tmp_path: Path) -> None:
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    driver(proc, devfs=True, minors=MINORS)
    (dev / "nvidia-caps").mkdir(parents=True)
    for minor in (21, 22):
        (dev / f"nvidia-caps/nvidia-cap{minor}").write_text("")  # a plain file
    inv = inventory()
    (reason,) = check_mig_caps(inv, build_lanes(inv), dev, proc).values()
    assert reason.startswith("mig_caps_mismatch: ")


def test_caps_only_in_proc_refuse_mig_lanes(tmp_path: Path) -> None:
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    driver(proc, devfs=False, minors=MINORS)
    inv = inventory()
    (reason,) = check_mig_caps(inv, build_lanes(inv), dev, proc).values()
    assert reason.startswith("mig_caps_procfs: ")


def test_an_instance_the_driver_lists_no_capability_for_is_refused(tmp_path: Path) -> None:
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    driver(proc, devfs=True, minors={"gpu1/gi7": 30})
    inv = inventory()
    (reason,) = check_mig_caps(inv, build_lanes(inv), dev, proc).values()
    assert reason.startswith("mig_caps_unknown: ") and "gpu1/gi2" in reason


def test_without_capabilities_at_all_mig_lanes_are_refused_and_gpus_are_not(
    tmp_path: Path,
) -> None:
    inv = inventory()
    refused = check_mig_caps(inv, build_lanes(inv), tmp_path / "dev", tmp_path / "proc")
    assert list(refused) == [mig_lane(inv).lane_id]
    assert refused[mig_lane(inv).lane_id].startswith("mig_caps_unavailable: ")
