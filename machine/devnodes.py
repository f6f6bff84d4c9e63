"""Which device nodes a lane needs: what a guest's /dev may hold for its grant.

A GPU lane needs /dev/nvidiaN of its GPU plus the driver's control nodes; a MIG
lane needs its parent GPU's node, the control nodes and the MIG capability
nodes of its GPU and compute instance (/dev/nvidia-caps/nvidia-capM, with M read
from the driver's /proc/driver/nvidia-caps/mig-minors). The CPU pool needs none.
Nodes are looked up under a configurable root (`--dev-root`) so a simulated
machine can give each simulated GPU a node of its own.
"""

from __future__ import annotations

from pathlib import Path

from machine.inventory import GpuDevice, Inventory, MigInstance
from machine.lanes import Lane, LaneKind

__all__ = ["CONTROL_NODES", "MIG_MINORS", "lane_device_nodes", "read_mig_minors"]

# Opened by the CUDA driver in every process that uses a GPU.
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
MIG_MINORS = Path("/proc/driver/nvidia-caps/mig-minors")


def read_mig_minors(path: Path = MIG_MINORS) -> dict[str, int]:
    """`gpu0/gi1/ci0/access 67` lines -> {"gpu0/gi1/ci0": 67}; {} without MIG support."""
    try:
        lines = path.read_text(encoding="ascii").splitlines()
    except OSError:
        return {}
    minors = {}
    for line in lines:
        name, _, minor = line.partition(" ")
        if name.endswith("/access") and minor.strip().isdigit():
            minors[name.removesuffix("/access")] = int(minor)
    return minors


def _mig_caps(gpu: GpuDevice, mig: MigInstance, minors: dict[str, int]) -> list[str]:
    if gpu.minor_number is None or mig.gpu_instance_id is None:
        return []
    gi = f"gpu{gpu.minor_number}/gi{mig.gpu_instance_id}"
    keys = [gi] + (
        [f"{gi}/ci{mig.compute_instance_id}"] if mig.compute_instance_id is not None else []
    )
    return [f"nvidia-caps/nvidia-cap{minors[k]}" for k in keys if k in minors]


def lane_device_nodes(
    inventory: Inventory, lane: Lane, dev_root: Path, mig_minors: dict[str, int] | None = None
) -> tuple[Path, ...]:
    """The existing device nodes a guest holding `lane` needs, under `dev_root`."""
    if lane.kind is LaneKind.CPU:
        return ()
    gpu = next((g for g in inventory.gpus if g.uuid == lane.device_id), None)
    if gpu is None or gpu.minor_number is None:
        return ()
    names = [f"nvidia{gpu.minor_number}", *CONTROL_NODES]
    if lane.kind is LaneKind.MIG:
        mig = next((m for m in gpu.mig_instances if m.uuid == lane.visible_uuid), None)
        if mig is not None:
            names += _mig_caps(gpu, mig, read_mig_minors() if mig_minors is None else mig_minors)
    return tuple(path for name in names if (path := dev_root / name).exists())
