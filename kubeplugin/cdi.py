"""The per-claim CDI spec a prepared claim's pods get: one device, the claim, whose only
edit mounts the claim's own folder (its token file and the node's socket for it) in
the container, and names its lanes. Mediated: no device node, and never the token
itself (neither in the spec nor in an environment variable, only the path of the file
that holds it). Passed through (`kubeplugin.claim_config`): its devices' nodes too, and
CUDA_VISIBLE_DEVICES naming them.

The spec lives in the runtime's dynamic CDI folder, a tmpfs a reboot empties: kubelet
calls Prepare again then, and writing the spec again is how it comes back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubeplugin.files import TOKEN_NAME, write_whole
from kubeplugin.sockets import DRIVER_NAME

__all__ = [
    "CDI_DIR",
    "CDI_VERSION",
    "CLAIM_MOUNT",
    "SOCKET_NAME",
    "CdiError",
    "Passthrough",
    "claim_device_id",
    "claim_spec",
    "remove_claim_spec",
    "spec_path",
    "write_claim_spec",
]

CDI_DIR = Path("/var/run/cdi")
# The oldest CDI version with every field used here: a device name that starts with a
# digit (a claim's UID) and a device node's hostPath (passthrough) are 0.5.0's.
CDI_VERSION = "0.5.0"
# Where the claim's folder appears in its containers.
CLAIM_MOUNT = "/run/litegraph"
# The node's socket for the claim's pods, in the claim's folder: its tokens work there.
SOCKET_NAME = "node.sock"
_CLASS = "claim"
# CDI's rule for a device name; a claim UID (a UUID) is one.
_DEVICE_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,62}")


class CdiError(ValueError):
    """A claim UID that cannot name a CDI device."""


def _checked(claim_uid: str) -> str:
    if not _DEVICE_NAME.fullmatch(claim_uid):
        raise CdiError(f"claim uid {claim_uid!r} cannot name a CDI device")
    return claim_uid


def claim_device_id(claim_uid: str, driver: str = DRIVER_NAME) -> str:
    """The fully qualified CDI device id kubelet hands the runtime: vendor/class=name."""
    return f"{driver}/{_CLASS}={_checked(claim_uid)}"


def spec_path(claim_uid: str, *, cdi_dir: Path = CDI_DIR, driver: str = DRIVER_NAME) -> Path:
    """CDI's transient spec name: vendor-class_id, one file per claim."""
    return cdi_dir / f"{driver}-{_CLASS}_{_checked(claim_uid)}.json"


@dataclass(frozen=True)
class Passthrough:
    """What a passed-through claim's containers get besides: device nodes (the path in
    the container, the node on the host) and the uuids CUDA_VISIBLE_DEVICES names."""

    nodes: tuple[tuple[str, str], ...] = ()
    visible: tuple[str, ...] = ()


def claim_spec(
    claim_uid: str,
    claim_dir: Path,
    lane_ids: Sequence[str],
    *,
    passthrough: Passthrough = Passthrough(),
    driver: str = DRIVER_NAME,
) -> dict[str, Any]:
    mount = {
        "hostPath": str(claim_dir),
        "containerPath": CLAIM_MOUNT,
        "type": "bind",
        # Read-write: connecting to the node's socket in it needs write permission.
        "options": ["bind", "rw", "nosuid", "nodev", "noexec"],
    }
    env = [
        f"LITEGRAPH_CLAIM_UID={claim_uid}",
        f"LITEGRAPH_LANE_IDS={','.join(lane_ids)}",
        f"LITEGRAPH_CAPABILITY_TOKEN_FILE={CLAIM_MOUNT}/{TOKEN_NAME}",
        f"LITEGRAPH_NODE_SOCKET={CLAIM_MOUNT}/{SOCKET_NAME}",
    ]
    edits: dict[str, Any] = {"env": env, "mounts": [mount]}
    if passthrough.visible:
        env.append(f"CUDA_VISIBLE_DEVICES={','.join(passthrough.visible)}")
    if passthrough.nodes:
        edits["deviceNodes"] = [
            {"path": inside, "hostPath": host} for inside, host in passthrough.nodes
        ]
    return {
        "cdiVersion": CDI_VERSION,
        "kind": f"{driver}/{_CLASS}",
        "devices": [{"name": _checked(claim_uid), "containerEdits": edits}],
    }


def write_claim_spec(
    claim_uid: str,
    claim_dir: Path,
    lane_ids: Sequence[str],
    *,
    passthrough: Passthrough = Passthrough(),
    cdi_dir: Path = CDI_DIR,
    driver: str = DRIVER_NAME,
) -> Path:
    """Write (or write again: Prepare is repeated) the claim's spec, whole. Returns its
    path."""
    target = spec_path(claim_uid, cdi_dir=cdi_dir, driver=driver)
    cdi_dir.mkdir(parents=True, exist_ok=True)
    spec = claim_spec(claim_uid, claim_dir, lane_ids, passthrough=passthrough, driver=driver)
    write_whole(target, json.dumps(spec, indent=2).encode(), 0o644)
    return target


def remove_claim_spec(
    claim_uid: str, *, cdi_dir: Path = CDI_DIR, driver: str = DRIVER_NAME
) -> bool:
    """Remove the claim's spec; False when there was none (Unprepare is repeated too)."""
    try:
        spec_path(claim_uid, cdi_dir=cdi_dir, driver=driver).unlink()
    except FileNotFoundError:
        return False
    return True
