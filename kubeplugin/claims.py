"""A ResourceClaim as Prepare needs it: read from the API server (kubelet's request
names only the claim), checked, and turned into what to prepare on this node.

Checked, each failure a typed reason for that claim alone: the claim is the one kubelet
named (its UID), the scheduler has allocated it, and at least one of its results is this
driver's on this node's pool. Results of other drivers are theirs to prepare.
"""

from __future__ import annotations

import dataclasses
import decimal
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx2
import trio
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.resource_v1 import ResourceClaim

from kubeplugin.claim_config import ConfigRefused, passthrough_requests
from kubeplugin.server import ClaimRef
from kubeplugin.sockets import DRIVER_NAME

__all__ = [
    "READ_SECONDS",
    "AllocatedDevice",
    "ClaimPlan",
    "ClaimRefused",
    "plan_claim",
    "read_claim",
]

READ_SECONDS = 10.0


class ClaimRefused(Exception):
    """Why a claim cannot be prepared here: `reason` is the per-claim error's code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class AllocatedDevice:
    """One of this driver's allocation results: which device, for which request, and
    for a shared device the part it took (its share id and `memory`, in bytes)."""

    request: str
    device: str
    share_id: str | None = None
    memory_bytes: int | None = None
    # Its device nodes in the pods' containers (`kubeplugin.claim_config`).
    passthrough: bool = False


@dataclass(frozen=True)
class ClaimPlan:
    claim: ClaimRef
    devices: tuple[AllocatedDevice, ...]
    # The pods the claim is reserved for, as the API server said at Prepare (logged):
    # its tokens are bound to its own socket, which only its pods' containers mount,
    # not to these uids (kubelet prepares a claim once for every pod that shares it).
    pod_uids: tuple[str, ...]


# Kubernetes' quantity suffixes (apimachinery's resource.Quantity): binary, decimal SI,
# and a decimal exponent.
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"m": -1, "": 0, "k": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}
_QUANTITY = re.compile(
    r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[mkMGTPE]|[eE][+-]?[0-9]+)?"
)


_QUANTITY_CHARS = 64
_MAX_EXPONENT = 30
_MAX_BYTES = 2**63 - 1


def _quantity(text: str) -> int:
    """A Kubernetes quantity of bytes (`20Gi`, `1.5Gi`, `1500M`, `1e9`, `1073741824`) as
    a whole number of bytes, a fraction rounded up as the API server does; ValueError
    for anything else or below 0."""
    match = _QUANTITY.fullmatch(text.strip()) if len(text) <= _QUANTITY_CHARS else None
    if match is None:
        raise ValueError(f"not a quantity: {text[:_QUANTITY_CHARS]!r}")
    number, suffix = decimal.Decimal(match.group(1)), match.group(2) or ""
    if suffix in _BINARY:
        value = number * (1 << (10 * _BINARY[suffix]))
    elif suffix in _DECIMAL:
        value = number.scaleb(3 * _DECIMAL[suffix])
    else:
        exponent = int(suffix[1:])
        if abs(exponent) > _MAX_EXPONENT:  # no byte count is near: and 10**huge is slow
            raise ValueError(f"a quantity out of range: {text!r}")
        value = number.scaleb(exponent)
    if value < 0 or value > _MAX_BYTES:
        raise ValueError(f"a quantity out of range: {text!r}")
    return int(value.to_integral_value(rounding=decimal.ROUND_CEILING))


def _classes(claim: Mapping[str, Any], requests: frozenset[str]) -> frozenset[str]:
    """The DeviceClasses the claim's `requests` ask for (a `firstAvailable` request's
    subrequests each name one)."""
    found: set[str] = set()
    for request in (claim.get("spec") or {}).get("devices", {}).get("requests", []) or []:
        name = request.get("name")
        exactly = request.get("exactly") or {}
        if name in requests and exactly.get("deviceClassName"):
            found.add(exactly["deviceClassName"])
        for sub in request.get("firstAvailable") or []:
            if f"{name}/{sub.get('name')}" in requests and sub.get("deviceClassName"):
                found.add(sub["deviceClassName"])
    return frozenset(found)


def plan_claim(
    ref: ClaimRef, claim: Mapping[str, Any], *, node: str, driver: str = DRIVER_NAME
) -> ClaimPlan:
    """What to prepare for `claim` (a ResourceClaim as the API server returns it)."""
    uid = claim.get("metadata", {}).get("uid")
    if uid != ref.uid:
        raise ClaimRefused(
            "claim_uid_mismatch", f"kubelet named {ref.uid}, the API server has {uid}"
        )
    status = claim.get("status") or {}
    allocation = status.get("allocation")
    if not allocation:
        raise ClaimRefused("claim_not_allocated", f"{ref.namespace}/{ref.name} has no allocation")
    devices = []
    for result in allocation.get("devices", {}).get("results", []):
        if result.get("driver") != driver:
            continue
        if result.get("pool") != node:
            raise ClaimRefused(
                "claim_other_node", f"device {result.get('device')} is in pool {result.get('pool')}"
            )
        memory = (result.get("consumedCapacity") or {}).get("memory")
        try:
            devices.append(
                AllocatedDevice(
                    request=result["request"],
                    device=result["device"],
                    share_id=result.get("shareID"),
                    memory_bytes=None if memory is None else _quantity(str(memory)),
                )
            )
        except (KeyError, ValueError) as exc:
            raise ClaimRefused("claim_malformed", f"an allocation result: {exc!r}") from None
    if not devices:
        raise ClaimRefused("claim_not_ours", f"no device of {driver} is allocated to it")
    try:
        ours = frozenset(d.request for d in devices)
        through = passthrough_requests(allocation, ours, driver, _classes(claim, ours))
    except ConfigRefused as refused:
        raise ClaimRefused(refused.reason, str(refused)) from None
    devices = [dataclasses.replace(d, passthrough=d.request in through) for d in devices]
    pods = tuple(
        consumer["uid"]
        for consumer in status.get("reservedFor", [])
        if consumer.get("resource") == "pods" and consumer.get("uid")
    )
    return ClaimPlan(ref, tuple(devices), pods)


async def read_claim(client: AsyncClient, ref: ClaimRef) -> dict[str, Any]:
    """The claim as the API server holds it; ClaimRefused when it cannot be had."""
    try:
        with trio.fail_after(READ_SECONDS):
            found = await client.get(ResourceClaim, ref.name, namespace=ref.namespace)
    except trio.TooSlowError:
        raise ClaimRefused("claim_unreadable", f"no answer in {READ_SECONDS:g} s") from None
    except ApiError as exc:
        reason = "claim_not_found" if exc.status.code == 404 else "claim_unreadable"
        raise ClaimRefused(reason, str(exc.status.message)) from None
    except httpx2.TransportError as exc:
        raise ClaimRefused("claim_unreadable", f"the API server is unreachable: {exc!r}") from None
    claim: dict[str, Any] = found.to_dict()
    return claim
