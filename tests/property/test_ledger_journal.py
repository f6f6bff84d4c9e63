"""A stateful property test over the capacity ledger and its journal.

Reserve, release (twice), change device health, drain/resume lanes, record
ended invocations and crash + restart from the journal (sometimes with a torn
tail), checking after every step: allocatable is never negative, allocated
equals the sum of live reservations, the ledger rebuilt from the journal
equals the one before the crash, every ended invocation is remembered as it
last ended, and the replay lists exactly the newest `RETAIN`, through every
compaction (which moves endings into the on-disk index).

The machine's journals live in tmpfs where there is one: opening a journal after a
crash syncs what it repairs whatever `durable` says, and on a disk those syncs were
most of an example's time. What the property checks is what the journal holds, not
how the disk under it keeps it (`test_durable_journal_replays` does, on disk).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from machine.health import HealthState
from machine.inventory import CpuInfo, GpuDevice, Inventory, MemoryInfo, MigInstance
from machine.journal import (
    JOURNAL_FILENAME,
    EndedRecord,
    Journal,
    JournalReplay,
    Record,
    ReleaseRecord,
    ReserveRecord,
    frame,
)
from machine.lanes import Isolation, Requirement, build_lanes
from machine.ledger import (
    Ledger,
    RefusalReason,
    Reservation,
    ReservationRefused,
    ReservationRequest,
)

GiB = 1 << 30
GPUS = ("GPU-a", "GPU-b", "GPU-m")
INVENTORY = Inventory(
    backend="sim",
    cpu=CpuInfo(logical_cores=8, physical_cores=4, model="m", numa_nodes=1, capacity_millis=8000),
    memory=MemoryInfo(total_bytes=32 * GiB, available_bytes=32 * GiB, capacity_bytes=32 * GiB),
    gpus=(
        GpuDevice(uuid="GPU-a", name="g", pci_bus_id=None, memory_total_bytes=16 * GiB),
        GpuDevice(uuid="GPU-b", name="g", pci_bus_id=None, memory_total_bytes=8 * GiB),
        GpuDevice(
            uuid="GPU-m",
            name="g",
            pci_bus_id=None,
            memory_total_bytes=16 * GiB,
            mig_enabled=True,
            mig_instances=(
                MigInstance(uuid="MIG-1", name="1g", memory_total_bytes=4 * GiB),
                MigInstance(uuid="MIG-2", name="2g", memory_total_bytes=8 * GiB),
            ),
        ),
    ),
)
LANES = build_lanes(INVENTORY)
IDS_LIST = [f"inv-{i}" for i in range(8)]
IDS = st.sampled_from(IDS_LIST)
RETAIN = 3  # ended invocations listed by a replay: small, so the bound is exercised
_dirs = itertools.count()
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


def new_ledger(health: dict[str, HealthState], drained: set[str]) -> Ledger:
    ledger = Ledger(
        lanes=LANES,
        cpu_capacity_millis=8000,
        memory_capacity_bytes=32 * GiB,
        reserved_cpu_millis=500,
        reserved_memory_bytes=GiB,
        vram_headroom_bytes=GiB // 2,
        device_health=health,
    )
    for lane_id in drained:
        ledger.drain(lane_id)
    return ledger


def open_journal(state_dir: Path) -> tuple[Journal, JournalReplay]:
    # Not fsync'd per record here: durability is the unit tests' job, speed is ours. Its
    # reserve is kept small: every open takes it back (the same code whatever its size),
    # and 16 MiB of it zeroed at each of an example's restarts were a sixth of its time.
    return Journal.open(
        state_dir, durable=False, compact_every=12, listed=RETAIN, reserve_bytes=64 << 10
    )


class LedgerJournalMachine(RuleBasedStateMachine):
    base: Path = Path(tempfile.gettempdir())

    def __init__(self) -> None:
        super().__init__()
        self.dir = self.base / f"m{next(_dirs)}"
        self.health = dict.fromkeys(GPUS, HealthState.HEALTHY)
        self.drained: set[str] = set()
        self.ledger = new_ledger(self.health, self.drained)
        self.journal, _ = open_journal(self.dir)
        self.live: dict[str, Reservation] = {}
        self.ended: OrderedDict[str, EndedRecord] = OrderedDict()

    def teardown(self) -> None:
        self.journal.close()
        shutil.rmtree(self.dir)  # in tmpfs: memory

    @rule(
        rid=IDS,
        cpu=st.integers(0, 4000),
        mem=st.integers(0, 12).map(lambda g: g * GiB),
        requirement=st.sampled_from(Requirement),
        isolation=st.sampled_from(Isolation),
        vram=st.sampled_from([0, GiB, 3 * GiB, 7 * GiB, 20 * GiB]),
        gpus=st.integers(1, 2),
    )
    def reserve(
        self,
        rid: str,
        cpu: int,
        mem: int,
        requirement: Requirement,
        isolation: Isolation,
        vram: int,
        gpus: int,
    ) -> None:
        request = ReservationRequest(
            reservation_id=rid,
            cpu_millis=cpu,
            memory_bytes=mem,
            requirement=requirement,
            isolation=isolation,
            vram_bytes=vram,
            gpus=gpus,
        )
        before = self.ledger.capacity()
        try:
            reservation = self.ledger.reserve(request)
        except ReservationRefused as refusal:
            assert self.ledger.capacity() == before  # all or nothing
            assert (refusal.reason is RefusalReason.DUPLICATE_RESERVATION) == (rid in self.live)
            return
        assert rid not in self.live
        assert len(reservation.lanes) >= 1
        self.journal.record_reserve(reservation)
        self.live[rid] = reservation

    @rule(rid=IDS)
    def release_twice(self, rid: str) -> None:
        released = self.ledger.release(rid)
        assert (released is not None) == (rid in self.live)
        if released is not None:
            self.journal.record_release(rid)
            del self.live[rid]
        after = self.ledger.capacity()
        assert self.ledger.release(rid) is None
        assert self.ledger.capacity() == after

    @rule(device=st.sampled_from(GPUS), state=st.sampled_from(HealthState))
    def health_change(self, device: str, state: HealthState) -> None:
        self.health[device] = state
        self.ledger.set_device_health(device, state)

    @rule(index=st.integers(0, len(LANES) - 1), drain=st.booleans())
    def drain_or_resume(self, index: int, drain: bool) -> None:
        lane_id = LANES[index].lane_id
        if drain:
            self.ledger.drain(lane_id)
            self.drained.add(lane_id)
        else:
            self.ledger.resume(lane_id)
            self.drained.discard(lane_id)

    @rule(rid=IDS, digest=st.sampled_from(["x", "y"]))
    def invocation_ended(self, rid: str, digest: str) -> None:
        record = EndedRecord(
            invocation_id=rid, request_digest=digest, ended_at=time.time(), outcome=b"{}"
        )
        self.journal.record_ended(record)
        self.ended.pop(rid, None)
        self.ended[rid] = record

    @rule(rids=st.lists(IDS, min_size=1, max_size=4, unique=True), digest=st.sampled_from("xy"))
    def release_and_end_in_one_group_commit(self, rids: list[str], digest: str) -> None:
        batch: list[Record] = []
        for rid in rids:
            if self.ledger.release(rid) is not None:
                batch.append(ReleaseRecord(reservation_id=rid))
                del self.live[rid]
            ended = EndedRecord(
                invocation_id=rid, request_digest=digest, ended_at=time.time(), outcome=b"{}"
            )
            batch.append(ended)
            self.ended.pop(rid, None)
            self.ended[rid] = ended
        self.journal.append_batch(batch)  # one write, one fsync, acknowledged together

    @rule(count=st.integers(1, 6), cut=st.floats(0.0, 1.0, exclude_max=True))
    def crash_during_a_group_commit(self, count: int, cut: float) -> None:
        """The daemon dies while a batch is being written: nothing of it was acknowledged,
        so every acknowledged record replays; whole frames of the batch may replay too
        (reconcile releases those), and the torn rest is dropped."""
        scratch = new_ledger(dict.fromkeys(GPUS, HealthState.HEALTHY), set())
        unacked = [
            scratch.reserve(ReservationRequest(reservation_id=f"unacked-{i}", cpu_millis=1))
            for i in range(count)
        ]
        frames = [frame(ReserveRecord(reservation=r)) for r in unacked]
        data = b"".join(frames)
        prefix = data[: int(len(data) * cut)]
        self.journal.close()
        fd = os.open(self.dir / JOURNAL_FILENAME, os.O_WRONLY | os.O_APPEND)
        os.write(fd, prefix)
        os.close(fd)
        whole = set()
        end = 0
        for reservation, framed in zip(unacked, frames, strict=True):
            end += len(framed)
            if end <= len(prefix):
                whole.add(reservation.reservation_id)
        self.journal, replay = open_journal(self.dir)
        assert set(replay.reservations) == set(self.live) | whole
        assert {k: v for k, v in replay.reservations.items() if k in self.live} == self.live
        assert replay.ended == dict(list(self.ended.items())[-RETAIN:])
        for rid in whole:  # as reconcile does on start: never acknowledged, released
            self.journal.record_release(rid)

    @rule(torn=st.sampled_from([b"", b"\x00\x00", b"\x00\x00\x00\x30\x12\x34\x56\x78abc"]))
    def crash_and_restart(self, torn: bytes) -> None:
        before = self.ledger.capacity()
        self.journal.close()
        if torn:  # a write the dead daemon never finished
            fd = os.open(self.dir / JOURNAL_FILENAME, os.O_WRONLY | os.O_APPEND)
            os.write(fd, torn)
            os.close(fd)
        self.journal, replay = open_journal(self.dir)
        assert (replay.problem is None) == (not torn)
        assert replay.ended == dict(list(self.ended.items())[-RETAIN:])
        ledger = new_ledger(self.health, self.drained)
        for reservation in replay.reservations.values():
            ledger.adopt(reservation)
        assert replay.reservations == self.live
        assert ledger.capacity() == before
        self.ledger = ledger

    @invariant()
    def allocatable_never_negative(self) -> None:
        cap = self.ledger.capacity()
        for amounts in (cap.cpu_millis, cap.memory_bytes, cap.gpus, *(u.vram for u in cap.lanes)):
            assert amounts.allocatable >= 0
            assert amounts.allocatable <= amounts.capacity

    @invariant()
    def allocated_is_sum_of_live(self) -> None:
        cap = self.ledger.capacity()
        assert self.ledger.reservations() == self.live
        assert self.journal.reservations() == self.live
        for rid in IDS_LIST:
            assert self.journal.ended(rid) == self.ended.get(rid)
        assert cap.cpu_millis.allocated == sum(r.cpu_millis for r in self.live.values())
        assert cap.memory_bytes.allocated == sum(r.memory_bytes for r in self.live.values())
        held: dict[str, int] = {}
        for r in self.live.values():
            for grant in r.lanes:
                if grant.kind.value != "cpu":
                    held[grant.lane_id] = held.get(grant.lane_id, 0) + grant.vram_bytes
        for usage in cap.lanes:
            assert usage.vram.allocated == held.get(usage.lane_id, 0)
            assert usage.vram.allocated + usage.vram.reserved <= usage.vram.capacity
        assert cap.gpus.allocated == len(held)


def test_ledger_and_journal_state_machine(tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory(dir=SHM or tmp_path) as base:
        LedgerJournalMachine.base = Path(base)
        run_state_machine_as_test(
            LedgerJournalMachine,
            settings=settings(max_examples=200, stateful_step_count=30, deadline=None),
        )


def test_durable_journal_replays(tmp_path: Path) -> None:
    journal, _ = Journal.open(tmp_path, durable=True)
    ledger = new_ledger(dict.fromkeys(GPUS, HealthState.HEALTHY), set())
    for i in range(5):
        journal.record_reserve(
            ledger.reserve(ReservationRequest(reservation_id=f"d{i}", cpu_millis=10))
        )
    journal.close()
    _, replay = Journal.open(tmp_path)
    assert replay.reservations == ledger.reservations()
