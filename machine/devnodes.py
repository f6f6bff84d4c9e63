"""Which device nodes a lane needs: what a guest's /dev may hold for its grant.

A GPU lane needs /dev/nvidiaN of its GPU plus the driver's control nodes; a MIG
lane needs its parent GPU's node, the control nodes and the MIG capability
nodes of its GPU instance and its compute instance. The CPU pool needs none.
Nodes are looked up under a configurable root (`--dev-root`) so a simulated
machine can give each simulated GPU a node of its own.

The driver keeps MIG capabilities in one of two ways (its `nv_cap_enable_devfs`
parameter):

- in /dev (`nvidia-caps` is a character device in /proc/devices): each
  capability is /dev/nvidia-caps/nvidia-capM, M read from the capability's
  access file (/proc/driver/nvidia/capabilities/gpuN/mig/giX[/ciY]/access,
  `DeviceFileMinor`, as nvidia-modprobe reads it; else from
  /proc/driver/nvidia-caps/mig-minors). The driver does not make these nodes:
  nvidia-modprobe or the container toolkit does, on demand. `check_mig_caps`
  makes a missing one as nvidia-modprobe does (major from /proc/devices, mode
  and owner from the access file), which needs CAP_MKNOD; where it cannot,
  the lane is refused with a typed reason and a log line, since CUDA in a
  guest without the node sees no device;
- in /proc only: access is decided by opening the access files, which every
  guest's own /proc shows for every instance. A guest could not be confined to
  its instance, so MIG lanes are refused (`mig_caps_procfs`).

Without either (no MIG capabilities visible at all) MIG lanes are refused too.
"""

from __future__ import annotations

import enum
import logging
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from machine.inventory import GpuDevice, Inventory, MigInstance
from machine.lanes import Lane, LaneKind

__all__ = [
    "CONTROL_NODES",
    "MIG_MINORS",
    "PROC",
    "CapsMode",
    "check_mig_caps",
    "lane_device_nodes",
    "mig_caps_mode",
    "read_mig_minors",
]

log = logging.getLogger(__name__)

# Opened by the CUDA driver in every process that uses a GPU.
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
PROC = Path("/proc")
MIG_MINORS = PROC / "driver/nvidia-caps/mig-minors"
_CAPS = "driver/nvidia/capabilities"
_CAPS_DEVICE = "nvidia-caps"
# nvidia-modprobe's defaults when the access file does not say.
_DEFAULT_MODE, _DEFAULT_UID, _DEFAULT_GID = 0o666, 0, 0


class CapsMode(enum.StrEnum):
    DEVFS = "devfs"  # /dev/nvidia-caps/nvidia-capM
    PROCFS = "procfs"  # the access files in /proc alone
    NONE = "none"  # no MIG capabilities visible


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


def _chardev_major(proc_root: Path, name: str) -> int | None:
    """The major number of character device `name` in /proc/devices."""
    try:
        lines = (proc_root / "devices").read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    in_chars = False
    for line in lines:
        if line.strip() == "Character devices:":
            in_chars = True
        elif not line.strip():
            in_chars = False
        elif in_chars:
            number, _, device = line.strip().partition(" ")
            if device.strip() == name and number.isdigit():
                return int(number)
    return None


def mig_caps_mode(proc_root: Path = PROC) -> CapsMode:
    if _chardev_major(proc_root, _CAPS_DEVICE) is not None:
        return CapsMode.DEVFS
    if (proc_root / _CAPS).is_dir():
        return CapsMode.PROCFS
    return CapsMode.NONE


def _keys(gpu: GpuDevice, mig: MigInstance) -> list[str] | None:
    """The capabilities a MIG lane needs, as the driver names them ("gpu1/gi2", ...)."""
    if gpu.minor_number is None or mig.gpu_instance_id is None:
        return None
    gi = f"gpu{gpu.minor_number}/gi{mig.gpu_instance_id}"
    ci = [f"{gi}/ci{mig.compute_instance_id}"] if mig.compute_instance_id is not None else []
    return [gi, *ci]


def _access(proc_root: Path, key: str) -> dict[str, int]:
    """The fields of a capability's access file ({} where there is none)."""
    gpu, _, rest = key.partition("/")
    path = proc_root / _CAPS / gpu / "mig" / rest / "access"
    try:
        lines = path.read_text(encoding="ascii").splitlines()
    except OSError:
        return {}
    found = {}
    for line in lines:
        name, _, value = line.partition(":")
        if value.strip().isdigit():
            found[name.strip()] = int(value)
    return found


def _minor(proc_root: Path, key: str, minors: dict[str, int]) -> int | None:
    return _access(proc_root, key).get("DeviceFileMinor", minors.get(key))


def _lane_mig(inventory: Inventory, lane: Lane) -> tuple[GpuDevice, MigInstance] | None:
    gpu = inventory.gpu(lane.device_id)
    if gpu is None:
        return None
    mig = next((m for m in gpu.mig_instances if m.uuid == lane.visible_uuid), None)
    return (gpu, mig) if mig is not None else None


def lane_device_nodes(
    inventory: Inventory,
    lane: Lane,
    dev_root: Path,
    mig_minors: dict[str, int] | None = None,
    proc_root: Path = PROC,
) -> tuple[Path, ...]:
    """The existing device nodes a guest holding `lane` needs, under `dev_root`."""
    if lane.kind is LaneKind.CPU:
        return ()
    gpu = inventory.gpu(lane.device_id)
    if gpu is None or gpu.minor_number is None:
        return ()
    names = [f"nvidia{gpu.minor_number}", *CONTROL_NODES]
    found = _lane_mig(inventory, lane) if lane.kind is LaneKind.MIG else None
    if found is not None:
        minors = read_mig_minors(proc_root / MIG_MINORS.relative_to(PROC))
        minors = minors if mig_minors is None else mig_minors
        for key in _keys(*found) or []:
            minor = _minor(proc_root, key, minors)
            if minor is not None:
                names.append(f"{_CAPS_DEVICE}/nvidia-cap{minor}")
    return tuple(path for name in names if (path := dev_root / name).exists())


def _make_node(path: Path, mode: int, device: int) -> None:
    os.mknod(path, mode, device)


def check_mig_caps(
    inventory: Inventory,
    lanes: Iterable[Lane],
    dev_root: Path,
    proc_root: Path = PROC,
    *,
    make_node: Callable[[Path, int, int], None] = _make_node,
) -> dict[str, str]:
    """MIG lanes a guest could not use, by lane id, with why; missing capability
    nodes are made where they can be (see the module's docstring). Every refusal
    is logged."""
    mig_lanes = [lane for lane in lanes if lane.kind is LaneKind.MIG]
    if not mig_lanes:
        return {}
    mode = mig_caps_mode(proc_root)
    minors = read_mig_minors(proc_root / MIG_MINORS.relative_to(PROC))
    refused = {}
    for lane in mig_lanes:
        reason = _refusal(inventory, lane, mode, dev_root, proc_root, minors, make_node)
        if reason is not None:
            log.warning("MIG lane %s (%s) refused: %s", lane.lane_id, lane.visible_uuid, reason)
            refused[lane.lane_id] = reason
    return refused


def _refusal(
    inventory: Inventory,
    lane: Lane,
    mode: CapsMode,
    dev_root: Path,
    proc_root: Path,
    minors: dict[str, int],
    make_node: Callable[[Path, int, int], None],
) -> str | None:
    if mode is CapsMode.NONE:
        return "mig_caps_unavailable: the driver shows no MIG capabilities (/proc/driver/nvidia)"
    if mode is CapsMode.PROCFS:
        return (
            "mig_caps_procfs: the driver keeps MIG capabilities in /proc only "
            "(nv_cap_enable_devfs=0), where every guest sees every instance's"
        )
    found = _lane_mig(inventory, lane)
    keys = _keys(*found) if found is not None else None
    if not keys:
        return "mig_caps_unknown: the instance's GPU minor or instance ids are unknown"
    major = _chardev_major(proc_root, _CAPS_DEVICE)
    assert major is not None  # DEVFS
    for key in keys:
        minor = _minor(proc_root, key, minors)
        if minor is None:
            return f"mig_caps_unknown: the driver lists no capability for {key}"
        access = _access(proc_root, key)
        reason = _ensure_node(dev_root, major, minor, access, make_node)
        if reason is not None:
            return reason
    return None


def _ensure_node(
    dev_root: Path,
    major: int,
    minor: int,
    access: dict[str, int],
    make_node: Callable[[Path, int, int], None],
) -> str | None:
    path = dev_root / _CAPS_DEVICE / f"nvidia-cap{minor}"
    device = os.makedev(major, minor)
    try:
        found = os.stat(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return f"mig_caps_missing: {path}: {exc.strerror}"
    else:
        if stat.S_ISCHR(found.st_mode) and found.st_rdev == device:
            return None
        return f"mig_caps_mismatch: {path} is not the character device {major}:{minor}"
    mode = access.get("DeviceFileMode", _DEFAULT_MODE) & 0o777
    uid = access.get("DeviceFileUID", _DEFAULT_UID)
    gid = access.get("DeviceFileGID", _DEFAULT_GID)
    made = False
    try:
        path.parent.mkdir(mode=0o755, exist_ok=True)
        make_node(path, stat.S_IFCHR | mode, device)
        made = True
        os.chmod(path, mode)
        os.chown(path, uid, gid)
    except OSError as exc:
        if made:  # a node with the wrong owner or mode is not left behind
            path.unlink(missing_ok=True)
        return (
            f"mig_caps_missing: {path} does not exist and could not be made ({exc.strerror}); "
            "run nvidia-modprobe for the instance's capabilities, or start the node as root"
        )
    log.info("made MIG capability node %s (%d:%d, mode %o)", path, major, minor, mode)
    return None
