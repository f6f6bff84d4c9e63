"""What a claim's configuration asks of this driver: passthrough, or nothing.

Mediated is the default: a claim's pods get no device node and do GPU work only as
lane work with their tokens. Passthrough (the device nodes of a whole GPU or a MIG
instance in the pods' containers, and CUDA_VISIBLE_DEVICES naming it) is given only
where the DeviceClass asks for it, in its config for this driver:

    config: [{opaque: {driver: lanes.litegraph.dev, parameters: {passthrough: true}}}]

The allocation carries that config (`source: FromClass`), for the requests it names
(a subrequest `req/sub` by its request's name too). Schedulers before 1.35 (and 1.34
and 1.32 before their fixes) name none: such a config is taken for every request of
this driver only where they all ask for one DeviceClass, since it can then be no
other class's; otherwise the claim is refused `passthrough_ambiguous`. A claim's own
config (`FromClaim`) may not ask for it: whoever writes a claim would grant
themselves the device. Any other parameter, or one that is not a boolean, is a
malformed claim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ConfigRefused", "passthrough_requests"]

_KNOWN = frozenset({"passthrough"})


class ConfigRefused(ValueError):
    """A config for this driver it cannot take; `reason` is the claim's error code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _named(requests: frozenset[str], named: frozenset[str]) -> set[str]:
    return {r for r in requests if r in named or r.partition("/")[0] in named}


def passthrough_requests(
    allocation: Mapping[str, Any],
    requests: frozenset[str],
    driver: str,
    classes: frozenset[str] = frozenset(),
) -> frozenset[str]:
    """The claim's requests (of `requests`, those this driver was allocated for) whose
    devices are passed through; `classes`: the DeviceClasses those requests ask for."""
    through: set[str] = set()
    for entry in allocation.get("devices", {}).get("config", []) or []:
        opaque = entry.get("opaque") or {}
        if opaque.get("driver") != driver:
            continue
        parameters = opaque.get("parameters") or {}
        if not isinstance(parameters, dict) or not set(parameters) <= _KNOWN:
            raise ConfigRefused("claim_malformed", f"{driver} takes only {sorted(_KNOWN)}")
        wanted = parameters.get("passthrough", False)
        if not isinstance(wanted, bool):
            raise ConfigRefused("claim_malformed", "passthrough must be true or false")
        if not wanted:
            continue
        if entry.get("source") != "FromClass":
            raise ConfigRefused(
                "passthrough_not_allowed", "only a DeviceClass's config may ask for passthrough"
            )
        named = frozenset(entry.get("requests") or [])
        if named:
            through.update(_named(requests, named))
        elif len(classes) == 1:
            through.update(requests)
        else:
            raise ConfigRefused(
                "passthrough_ambiguous",
                "a DeviceClass asks for passthrough but the allocation does not say for "
                "which of the claim's requests, which ask for more than one class",
            )
    return frozenset(through)
