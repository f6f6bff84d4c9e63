"""Snapshot cost against lanes and live reservations: it must grow no worse than linearly.

Builds a NodeSnapshot (and encodes it to JSON, as GET /v1/snapshot does) for
1, 8 and 64 lanes and 10, 1,000 and 10,000 live reservations. The ledger keeps
running totals, so reservations should cost nothing per snapshot and lanes a
constant amount each. Each finding is a per-item cost ratio between a large
and a small configuration: <= 1.5 means "no worse than linear".
"""

from __future__ import annotations

import msgspec

from bench.harness import Finding, rate
from machine.health import HealthTracker
from machine.inventory import CpuInfo, GpuDevice, Inventory, MemoryInfo, MigInstance
from machine.lanes import Isolation, Requirement, build_lanes
from machine.ledger import Ledger, ReservationRequest
from machine.snapshot import build_snapshot

GiB = 1 << 30
LANES = (1, 8, 64)
RESERVATIONS = (10, 1_000, 10_000)
LINEAR = 1.5  # per-item cost may rise this much before we call it worse than linear


def machine(lanes: int) -> Inventory:
    """The CPU pool plus `lanes - 1` GPU lanes: whole GPUs and MIG GPUs with 3 instances."""
    gpus: list[GpuDevice] = []
    remaining = lanes - 1
    index = 0
    while remaining > 0:
        uuid = f"GPU-bench-{index:04d}"
        if remaining >= 3 and index % 2:
            migs = tuple(
                MigInstance(uuid=f"MIG-{uuid}-{m}", name="1g", memory_total_bytes=8 * GiB)
                for m in range(3)
            )
            gpus.append(
                GpuDevice(
                    uuid=uuid,
                    name="bench",
                    pci_bus_id=None,
                    memory_total_bytes=24 * GiB,
                    mig_enabled=True,
                    mig_instances=migs,
                )
            )
            remaining -= 3
        else:
            gpus.append(
                GpuDevice(uuid=uuid, name="bench", pci_bus_id=None, memory_total_bytes=80 * GiB)
            )
            remaining -= 1
        index += 1
    return Inventory(
        backend="sim",
        cpu=CpuInfo(
            logical_cores=256,
            physical_cores=128,
            model="bench",
            numa_nodes=2,
            capacity_millis=10**9,
        ),
        memory=MemoryInfo(total_bytes=1 << 50, available_bytes=1 << 50, capacity_bytes=1 << 50),
        gpus=tuple(gpus),
    )


def setup(lanes: int, reservations: int) -> tuple[Inventory, HealthTracker, Ledger]:
    inventory = machine(lanes)
    tracker = HealthTracker()
    for gpu in inventory.gpus:
        tracker.register(gpu.uuid)
    ledger = Ledger(
        lanes=build_lanes(inventory),
        cpu_capacity_millis=inventory.cpu.capacity_millis,
        memory_capacity_bytes=inventory.memory.capacity_bytes,
        device_health=tracker.states(),
    )
    has_gpu = any(lane.is_gpu and Isolation.SHARED in lane.accepts for lane in ledger.lanes())
    for i in range(reservations):
        on_gpu = has_gpu and i % 2 == 0
        ledger.reserve(
            ReservationRequest(
                reservation_id=f"inv-{i}",
                cpu_millis=10,
                memory_bytes=1 << 20,
                requirement=Requirement.GPU if on_gpu else Requirement.CPU,
                vram_bytes=1 << 20 if on_gpu else 0,
            )
        )
    return inventory, tracker, ledger


def cost_us(lanes: int, reservations: int) -> float:
    inventory, tracker, ledger = setup(lanes, reservations)
    encoder = msgspec.json.Encoder()
    sequence = 0

    def once() -> None:
        nonlocal sequence
        sequence += 1
        snap = build_snapshot(
            node_id="bench", sequence=sequence, inventory=inventory, health=tracker, ledger=ledger
        )
        encoder.encode(snap)

    return 1e6 / rate(once, seconds=0.3)


def run() -> list[Finding]:
    table = {(n, r): cost_us(n, r) for n in LANES for r in RESERVATIONS}
    figures = {f"{n} lanes, {r} res": f"{us:.1f} us" for (n, r), us in table.items()}
    findings = []
    # Per-lane cost at 64 lanes vs at 8 lanes (fixed overhead favours the larger case).
    for r in (10, 10_000):
        per_small = table[(8, r)] / 8
        per_large = table[(64, r)] / 64
        ratio = per_large / per_small
        findings.append(
            Finding(
                name=f"snapshot per-lane cost, 64 vs 8 lanes ({r} reservations)",
                target=f"per-lane cost ratio <= {LINEAR} (no worse than linear)",
                figures={
                    "8 lanes": f"{table[(8, r)]:.1f} us ({per_small:.2f} us/lane)",
                    "64 lanes": f"{table[(64, r)]:.1f} us ({per_large:.2f} us/lane)",
                },
                ratio=ratio,
                met=ratio <= LINEAR,
            )
        )
    # Per-reservation cost at 10,000 vs at 10 live reservations, for each lane count.
    for n in LANES:
        per_small = table[(n, 10)] / 10
        per_large = table[(n, 10_000)] / 10_000
        ratio = per_large / per_small
        findings.append(
            Finding(
                name=f"snapshot per-reservation cost, 10,000 vs 10 ({n} lanes)",
                target=f"per-reservation cost ratio <= {LINEAR} (no worse than linear)",
                figures={
                    "10 res": f"{table[(n, 10)]:.1f} us",
                    "1,000 res": f"{table[(n, 1_000)]:.1f} us",
                    "10,000 res": f"{table[(n, 10_000)]:.1f} us",
                    "growth x1000 items": f"{table[(n, 10_000)] / table[(n, 10)]:.2f}x",
                },
                ratio=ratio,
                met=ratio <= LINEAR,
            )
        )
    findings.append(
        Finding(
            name="snapshot cost table (build + JSON encode)",
            target="reference figures",
            figures=figures,
            ratio=table[(64, 10_000)] / table[(1, 10)],
            met=True,
        )
    )
    return findings
