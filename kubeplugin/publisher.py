"""Publishing the node's devices as ResourceSlices through the API server, and keeping
them published: kubelet deletes a node's slices when it starts and after a driver
unregisters, so each round compares what the API server holds with what the node has
and puts back what is missing.

One round (`publish`) lists this driver's slices for this node, then creates what is
missing, replaces what differs and deletes what is left over, each request bounded.
"Differs" is judged against what this publisher last wrote, by the resourceVersion the
API server answered it with: the API server stores a slice in its own form (empty maps
dropped, quantities rewritten, fields of gates that are off left out), so comparing its
form with ours would replace every slice every round. A slice someone else wrote (its
resourceVersion moved) is compared as it is, and replaced where it differs.
The pool's generation goes up whenever the devices change, in every slice of the pool,
and always above what the API server already holds (a restarted daemon's first round).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import httpx2
import trio
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.resource_v1 import ResourceSlice

from kubeplugin.slices import OfferedDevice, SliceError, resource_slices
from kubeplugin.sockets import DRIVER_NAME

__all__ = ["REQUEST_SECONDS", "PublishError", "SlicePublisher"]

log = logging.getLogger(__name__)

# One request to the API server.
REQUEST_SECONDS = 10.0


class PublishError(RuntimeError):
    """The API server did not take the node's slices (unreachable, or it refused)."""


def _dropped_sharing(sent: dict[str, Any], stored: dict[str, Any]) -> list[str]:
    kept = {d["name"] for d in stored.get("devices", []) if d.get("allowMultipleAllocations")}
    return [
        d["name"]
        for d in sent.get("devices", [])
        if d.get("allowMultipleAllocations") and d["name"] not in kept
    ]


class SlicePublisher:
    def __init__(
        self,
        client: AsyncClient,
        node: str,
        devices: Callable[[], Sequence[OfferedDevice]],
        *,
        now: Callable[[], str],
        driver: str = DRIVER_NAME,
    ) -> None:
        self._client = client
        self._node = node
        self._devices = devices
        self._now = now
        self._driver = driver
        self._published: tuple[OfferedDevice, ...] | None = None
        self.generation = 0
        # When each device's taint (by its health) was first seen: kept across rounds.
        self._tainted: dict[tuple[str, str], str] = {}
        # By slice name: the spec last written and the resourceVersion it was stored as.
        self._written: dict[str, tuple[dict[str, Any], str]] = {}
        # The API server dropped what a shared device needs (an older Kubernetes).
        self.sharing_refused = False

    async def publish(self) -> int:
        """One round; returns how many requests changed something. PublishError if the
        API server could not be reached or refused a request."""
        try:
            with trio.fail_after(REQUEST_SECONDS):
                held = {d["metadata"]["name"]: d for d in await self._held()}
            devices = tuple(self._devices())
            if devices != self._published:
                top = max((d["spec"]["pool"]["generation"] for d in held.values()), default=0)
                self.generation = max(self.generation, top) + 1
            wanted = {
                s["metadata"]["name"]: s
                for s in resource_slices(
                    self._node,
                    devices,
                    generation=self.generation,
                    added_at=self._taint_times(devices),
                    driver=self._driver,
                )
            }
            changed = 0
            lost: list[str] = []
            for name, slice_ in wanted.items():
                have = held.pop(name, None)
                spec = slice_["spec"]
                if have is None:
                    stored = await self._bounded(
                        self._client.create(ResourceSlice.from_dict(slice_))
                    )
                else:
                    version = have["metadata"]["resourceVersion"]
                    if have["spec"] == spec or self._written.get(name) == (spec, version):
                        self._written[name] = (spec, version)
                        continue
                    slice_["metadata"]["resourceVersion"] = version
                    stored = await self._bounded(
                        self._client.replace(ResourceSlice.from_dict(slice_))
                    )
                self._written[name] = (spec, stored.metadata.resourceVersion)
                lost.extend(_dropped_sharing(spec, stored.to_dict().get("spec", {})))
                changed += 1
            for name in held:
                await self._bounded(self._client.delete(ResourceSlice, name))
                self._written.pop(name, None)
                changed += 1
            for name in set(self._written) - set(wanted):
                del self._written[name]
            if changed:  # what the API server made of what was written this round
                self._say_sharing(lost)
        except trio.TooSlowError:
            raise PublishError(f"the API server did not answer in {REQUEST_SECONDS:g} s") from None
        except ApiError as exc:
            raise PublishError(f"the API server refused: {exc.status.message}") from exc
        except httpx2.TransportError as exc:  # refused, reset, cut
            raise PublishError(f"the API server is unreachable: {exc!r}") from exc
        except SliceError as exc:  # a device the API server would refuse: none is sent
            raise PublishError(f"the node's devices cannot be published: {exc}") from exc
        self._published = devices
        return changed

    def _say_sharing(self, lost: Sequence[str]) -> None:
        """Say so, once, where the API server dropped what sharing a GPU needs (below
        1.36, or with DRAConsumableCapacity off): it would give the device whole."""
        if lost and not self.sharing_refused:
            log.error(
                "the API server dropped allowMultipleAllocations of %s: sharing a GPU's "
                "VRAM needs Kubernetes 1.36 or later (DRAConsumableCapacity); claims "
                "given such a device whole are refused at Prepare",
                ", ".join(lost),
            )
        self.sharing_refused = bool(lost)

    def _taint_times(self, devices: Sequence[OfferedDevice]) -> dict[str, str]:
        now = self._now()
        seen = {(d.name, d.health): d.name for d in devices if d.health != "ok"}
        self._tainted = {key: self._tainted.get(key, now) for key in seen}
        return {name: self._tainted[key] for key, name in seen.items()}

    async def _held(self) -> list[dict[str, Any]]:
        """This driver's slices for this node, as the API server holds them."""
        fields: dict[str, Any] = {"spec.nodeName": self._node, "spec.driver": self._driver}
        return [s.to_dict() async for s in self._client.list(ResourceSlice, fields=fields)]

    async def _bounded(self, request: Any) -> Any:
        with trio.fail_after(REQUEST_SECONDS):
            return await request
