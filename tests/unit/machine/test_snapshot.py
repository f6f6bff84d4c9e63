"""NodeSnapshot: built from inventory + health + ledger, JSON round trip, schema, no secrets."""

from __future__ import annotations

import datetime
import json
from typing import Any

import msgspec
import pytest

from machine.discovery import discover
from machine.discovery_sim import discover_sim, load_sim_spec
from machine.health import HealthState, HealthTracker
from machine.inventory import CpuInfo, Inventory, MemoryInfo
from machine.lanes import Isolation, Requirement, build_lanes
from machine.ledger import Ledger, ReservationRequest
from machine.monitor import sync_ledger
from machine.snapshot import (
    SCHEMA_VERSION,
    HostBackedVram,
    NodeSnapshot,
    build_snapshot,
    rfc3339,
)

GiB = 1 << 30
_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "null": type(None),
}


def validate(value: Any, schema: dict[str, Any], defs: dict[str, Any], path: str = "$") -> None:
    """A small JSON Schema check covering what msgspec emits for these types."""
    if "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[-1]]
    if "anyOf" in schema:
        errors = []
        for option in schema["anyOf"]:
            try:
                validate(value, option, defs, path)
                return
            except AssertionError as exc:
                errors.append(str(exc))
        raise AssertionError(f"{path}: no anyOf option matched: {errors}")
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in enum"
    if "type" in schema:
        expected = _TYPES[schema["type"]]
        assert isinstance(value, expected), f"{path}: {value!r} is not {schema['type']}"
        if schema["type"] == "integer":
            assert not isinstance(value, bool), path
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{path}: missing {key}"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{path}: extra {set(value) - set(props)}"
        for key, item in value.items():
            if key in props:
                validate(item, props[key], defs, f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            validate(item, schema["items"], defs, f"{path}[{i}]")


def host(available: int) -> tuple[CpuInfo, MemoryInfo]:
    """A fake host, so that the simulated VRAM cap never depends on this machine."""
    cpu = CpuInfo(
        logical_cores=2, physical_cores=1, model="test", numa_nodes=1, capacity_millis=2000
    )
    return cpu, MemoryInfo(
        total_bytes=available, available_bytes=available, capacity_bytes=available
    )


async def machine(available: int = 1 << 50) -> tuple[Inventory, HealthTracker, Ledger]:
    inv = await discover_sim(load_sim_spec(), host=host(available))
    tracker = HealthTracker()
    for probe in inv.probes:
        tracker.register(probe.device_id)
        tracker.observe(probe, at=0)
    ledger = Ledger(
        lanes=build_lanes(inv),
        cpu_capacity_millis=inv.cpu.capacity_millis,
        memory_capacity_bytes=inv.memory.capacity_bytes,
        reserved_cpu_millis=1000,
        reserved_memory_bytes=GiB,
        vram_headroom_bytes=GiB // 2,
    )
    sync_ledger(tracker, ledger)
    if inv.source is not None:
        await inv.source.aclose()
    return inv, tracker, ledger


async def test_snapshot_contents_and_round_trip() -> None:
    inv, tracker, ledger = await machine()
    ledger.reserve(ReservationRequest(reservation_id="i1", cpu_millis=500, vram_bytes=2 * GiB))
    ledger.reserve(
        ReservationRequest(
            reservation_id="i2", requirement=Requirement.GPU, isolation=Isolation.PARTITIONED
        )
    )
    lanes = ledger.lanes()
    ledger.drain(lanes[-1].lane_id)
    tracker.observe(msgspec.structs.replace(inv.probes[0], xids=(79,)), at=1)
    sync_ledger(tracker, ledger)
    moment = datetime.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=datetime.UTC)
    snap = build_snapshot(
        node_id="node-a",
        sequence=7,
        inventory=inv,
        health=tracker,
        ledger=ledger,
        observed_at=moment,
        readiness_reasons=["journal_recovering"],
    )
    assert snap.schema_version == SCHEMA_VERSION
    assert snap.observed_at == "2026-01-02T03:04:05.678Z"
    assert snap.readiness_reasons == ("journal_recovering",)
    assert [d.health for d in snap.devices] == [HealthState.UNHEALTHY, HealthState.HEALTHY]
    assert snap.devices[0].health_reasons == ("xid_79: critical device error, needs a reset",)
    assert snap.devices[0].temperature_c == 41.0
    assert [lane.kind.value for lane in snap.lanes] == ["cpu", "gpu", "mig", "mig", "mig"]
    assert snap.lanes[-1].drained and not snap.lanes[0].drained
    assert snap.lanes[1].health is HealthState.UNHEALTHY
    cap = snap.capacity
    assert cap.cpu_millis.capacity == 16000 and cap.cpu_millis.allocated == 500
    assert cap.cpu_millis.allocatable == 14500
    assert cap.gpus.capacity == 4
    # The unhealthy GPU and the drained MIG add nothing; one MIG is held.
    assert cap.gpus.allocatable == 1
    assert len(cap.vram_bytes) == 4 and cap.vram_bytes[0].allocatable == 0

    raw = msgspec.json.encode(snap)
    assert msgspec.json.decode(raw, type=NodeSnapshot) == snap
    text = raw.decode()
    for secret in ("token", "secret", "password", "handle", "v4.public"):
        assert secret not in text


async def test_schema_shape_matches_encoding() -> None:
    inv, tracker, ledger = await machine()
    snap = build_snapshot(node_id="n", sequence=1, inventory=inv, health=tracker, ledger=ledger)
    schema = msgspec.json.schema(NodeSnapshot)
    definitions = schema["$defs"]
    top = definitions["NodeSnapshot"]
    encoded = json.loads(msgspec.json.encode(snap))
    validate(encoded, schema, definitions)
    broken = {**encoded, "lanes": [{**encoded["lanes"][0], "kind": "tpu"}]}
    with pytest.raises(AssertionError, match="enum"):
        validate(broken, schema, definitions)
    assert set(encoded) <= set(top["properties"])
    assert set(top["required"]) <= set(encoded)
    assert top["additionalProperties"] is False
    for name, section in (
        ("CapacitySection", encoded["capacity"]),
        ("LaneSection", encoded["lanes"][0]),
    ):
        assert set(section) == set(definitions[name]["properties"])
    for value in (encoded["lanes"][0]["kind"], encoded["devices"][0]["health"]):
        assert value == value.lower()  # snake_case enum values
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode({**encoded, "extra": 1}), type=NodeSnapshot)


async def test_snapshot_shows_simulated_vram_capped_to_host_memory() -> None:
    inv, tracker, ledger = await machine(available=24 * GiB)
    snap = build_snapshot(node_id="n", sequence=1, inventory=inv, health=tracker, ledger=ledger)
    cpu, *devices = snap.lanes
    assert cpu.host_backed_vram is None and cpu.vram_bytes == 0
    granted = [6 * GiB, 1536 << 20, 1536 << 20, 3 * GiB]
    assert [lane.host_backed_vram for lane in devices] == [
        HostBackedVram(declared_bytes=declared * GiB, granted_bytes=size)
        for declared, size in zip((24, 6, 6, 12), granted, strict=True)
    ]
    assert [lane.vram_bytes for lane in devices] == granted
    assert [v.capacity for v in snap.capacity.vram_bytes] == granted
    assert [n for n in snap.notes if n.startswith("simulated VRAM capped")] == [
        "simulated VRAM capped to host memory available: 12,884,901,888 of 51,539,607,552 "
        "bytes (12,288 MiB of the 49,152 MiB the sim file declares); simulated VRAM is host "
        "memory, and lanes get at most 1/2 of this host's 24,576 MiB (its cgroup limit when "
        "lower), never more than the 24,576 MiB available at start"
    ]
    encoded = json.loads(msgspec.json.encode(snap))
    schema = msgspec.json.schema(NodeSnapshot)
    validate(encoded, schema, schema["$defs"])
    assert encoded["lanes"][1]["host_backed_vram"] == {
        "declared_bytes": 24 * GiB,
        "granted_bytes": 6 * GiB,
    }


async def test_snapshot_of_simulated_vram_within_host_memory() -> None:
    inv, tracker, ledger = await machine()
    snap = build_snapshot(node_id="n", sequence=1, inventory=inv, health=tracker, ledger=ledger)
    shown = [lane.host_backed_vram for lane in snap.lanes[1:]]
    assert [(v.declared_bytes, v.granted_bytes) for v in shown if v] == [
        (size * GiB, size * GiB) for size in (24, 6, 6, 12)
    ]
    assert not any(n.startswith("simulated VRAM capped") for n in snap.notes)


async def test_cpu_only_snapshot() -> None:
    inv = await discover("none")
    ledger = Ledger(
        lanes=build_lanes(inv),
        cpu_capacity_millis=inv.cpu.capacity_millis,
        memory_capacity_bytes=inv.memory.capacity_bytes,
    )
    snap = build_snapshot(
        node_id="n", sequence=0, inventory=inv, health=HealthTracker(), ledger=ledger
    )
    assert snap.devices == () and len(snap.lanes) == 1 and snap.capacity.vram_bytes == ()
    assert snap.capacity.gpus.capacity == 0


def test_rfc3339_converts_to_utc() -> None:
    tz = datetime.timezone(datetime.timedelta(hours=2))
    assert rfc3339(datetime.datetime(2026, 1, 1, 2, 0, tzinfo=tz)) == "2026-01-01T00:00:00.000Z"
