"""Publishing the node's devices as ResourceSlices through the real client library
against a fake API server: created once, left alone while nothing changes, put back
after kubelet wipes them, replaced with a higher generation on a change, and a typed
error when the API server cannot be reached."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import trio

from kubeplugin.publisher import PublishError, SlicePublisher
from kubeplugin.slices import OfferedDevice
from tests.kube_fixtures import SLICES, client_for, fake_api_server

GIB = 1 << 30
WHEN = "2026-12-02T12:00:00Z"


def _devices(count: int, health: str = "ok") -> list[OfferedDevice]:
    return [OfferedDevice(f"gpu-{i}", 80 * GIB, health=health) for i in range(count)]  # type: ignore[arg-type]


def _generations(slices: dict[str, dict[str, object]]) -> set[object]:
    return {s["spec"]["pool"]["generation"] for s in slices.values()}  # type: ignore[index]


async def test_slices_are_published_kept_put_back_and_bumped_on_a_change() -> None:
    offered = _devices(2)
    async with fake_api_server() as api:
        client = client_for(api.url)
        try:
            publisher = SlicePublisher(client, "node-a", lambda: offered, now=lambda: WHEN)
            assert await publisher.publish() == 1
            (name,) = api.slices
            assert name == "node-a-lanes.litegraph.dev-0" and _generations(api.slices) == {1}
            devices = api.slices[name]["spec"]["devices"]
            assert [d["name"] for d in devices] == ["gpu-0", "gpu-1"]
            assert await publisher.publish() == 0  # nothing changed: only a list
            assert api.requests[-1] == ("GET", SLICES)
            api.slices.clear()  # kubelet wipes the node's slices at its start
            assert await publisher.publish() == 1
            assert _generations(api.slices) == {1}  # the same devices: the same generation
            offered[:] = _devices(100, health="unhealthy")  # tainted: 64 a slice
            assert await publisher.publish() == 2  # one replaced, one created
            assert len(api.slices) == 2 and _generations(api.slices) == {2}
            offered[:] = _devices(1)
            assert await publisher.publish() == 2  # one replaced, the other deleted
            assert list(api.slices) == [name] and _generations(api.slices) == {3}
            # A restarted daemon's publisher goes on above what the API server holds.
            again = SlicePublisher(client, "node-a", lambda: _devices(2), now=lambda: WHEN)
            assert await again.publish() == 1 and _generations(api.slices) == {4}
            # Another node's slices are not this node's to touch.
            other = SlicePublisher(client, "node-b", lambda: _devices(1), now=lambda: WHEN)
            await other.publish()
            assert await again.publish() == 0 and len(api.slices) == 2
        finally:
            await client.close()


async def test_an_unreachable_api_server_is_a_typed_error() -> None:
    async with fake_api_server() as api:
        url = api.url
    client = client_for(url)  # its port is closed now
    try:
        publisher = SlicePublisher(client, "node-a", lambda: _devices(1), now=lambda: WHEN)
        with trio.fail_after(30):
            try:
                await publisher.publish()
            except PublishError as exc:
                assert "unreachable" in str(exc)
            else:
                raise AssertionError("published to a closed port")
    finally:
        await client.close()


async def test_a_taint_keeps_the_time_it_was_first_seen() -> None:
    # NoExecute's eviction counts from timeAdded: a round must not move it on.
    clock = ["2026-12-02T12:00:00Z"]
    offered = _devices(1, health="lost")
    async with fake_api_server() as api:
        client = client_for(api.url)
        try:
            publisher = SlicePublisher(client, "node-a", lambda: offered, now=lambda: clock[0])
            await publisher.publish()
            clock[0] = "2026-12-02T12:05:00Z"
            assert await publisher.publish() == 0  # nothing changed, nothing replaced
            (held,) = api.slices.values()
            taint = held["spec"]["devices"][0]["taints"][0]
            assert taint["timeAdded"] == "2026-12-02T12:00:00Z"
            offered[:] = _devices(1)
            await publisher.publish()
            offered[:] = _devices(1, health="lost")  # lost again: a new taint, a new time
            await publisher.publish()
            (held,) = api.slices.values()
            assert held["spec"]["devices"][0]["taints"][0]["timeAdded"] == "2026-12-02T12:05:00Z"
        finally:
            await client.close()


def _as_the_api_server_stores(obj: dict[str, Any]) -> dict[str, Any]:
    """Empty maps dropped and quantities in their canonical form, as a real one does."""
    stored = copy.deepcopy(obj)
    for device in stored["spec"]["devices"]:
        if not device.get("attributes"):
            device.pop("attributes", None)
        memory = device["capacity"]["memory"]
        memory["value"] = f"{int(memory['value']) >> 30}Gi"
    return stored


async def test_slices_the_api_server_stores_in_its_own_form_are_not_replaced_each_round() -> None:
    async with fake_api_server() as api:
        api.normalize = _as_the_api_server_stores
        client = client_for(api.url)
        try:
            publisher = SlicePublisher(client, "node-a", lambda: _devices(2), now=lambda: WHEN)
            assert await publisher.publish() == 1
            for _ in range(3):
                assert await publisher.publish() == 0
            assert [m for m, _path in api.requests].count("PUT") == 0
            # Someone else's write is put right.
            (stored,) = api.slices.values()
            stored["spec"]["devices"] = stored["spec"]["devices"][:1]
            stored["metadata"]["resourceVersion"] = "999"
            assert await publisher.publish() == 1
            assert len(next(iter(api.slices.values()))["spec"]["devices"]) == 2
        finally:
            await client.close()


async def test_an_api_server_that_drops_sharing_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def without_sharing(obj: dict[str, Any]) -> dict[str, Any]:
        stored = copy.deepcopy(obj)  # a 1.35 API server without DRAConsumableCapacity
        for device in stored["spec"]["devices"]:
            device.pop("allowMultipleAllocations", None)
            device["capacity"]["memory"].pop("requestPolicy", None)
        return stored

    shared = [OfferedDevice("vram-0", 80 * GIB, shared=True)]
    async with fake_api_server() as api:
        api.normalize = without_sharing
        client = client_for(api.url)
        try:
            publisher = SlicePublisher(client, "node-a", lambda: shared, now=lambda: WHEN)
            with caplog.at_level(logging.ERROR, logger="kubeplugin.publisher"):
                assert await publisher.publish() == 1
                assert await publisher.publish() == 0
            assert publisher.sharing_refused
            (said,) = [r.getMessage() for r in caplog.records]
            assert "vram-0" in said and "1.36" in said
            api.normalize = lambda obj: obj
            api.slices.clear()
            assert await publisher.publish() == 1 and not publisher.sharing_refused
        finally:
            await client.close()


async def test_devices_the_api_server_would_refuse_are_a_typed_error_and_nothing_is_sent() -> None:
    too_small = [OfferedDevice("vram-0", GIB // 2, shared=True)]  # less than one 1 GiB step
    async with fake_api_server() as api:
        client = client_for(api.url)
        try:
            publisher = SlicePublisher(client, "node-a", lambda: too_small, now=lambda: WHEN)
            with pytest.raises(PublishError, match="cannot be published"):
                await publisher.publish()
            assert api.slices == {} and [m for m, _ in api.requests] == ["GET"]
        finally:
            await client.close()
