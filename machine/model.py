"""One object for the daemon to hold: inventory, health, ledger and journal, wired.

`Machine.open(...)` takes plain parameters (no Config): it discovers devices,
seeds health from the first readings, opens the journal, adopts what it held
and reconciles leftovers of a dead daemon. Reserving journals the grant
(fsync, in the journal's writer thread, under a deadline) before returning it; records
that arrive while an fsync is in flight share the next one (group commit,
`group_commit.py`); if the
journal cannot record it the ledger gives it back and the caller gets the
error. Release frees the ledger first, synchronously, so resources are free
the moment the work ends, then journals the release.

While the journal cannot write (a full disk), `journal_problem()` says why;
`watch_journal` retries in the background so an idle node notices when the
disk takes writes again, and any write that succeeds clears it as well.
"""

from __future__ import annotations

import functools
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import trio

from machine.cgroups import Cgroups, pool_cgroup_prefix
from machine.devnodes import PROC, check_mig_caps
from machine.discovery import discover
from machine.ended_index import EXPIRE_BATCH
from machine.group_commit import GroupCommit
from machine.health import DEFAULT_FATAL_XIDS, HealthTracker, HealthTransition
from machine.inventory import CpuInfo, Inventory, MemoryInfo
from machine.journal import (
    MAX_IDS,
    WINDOW_S,
    EndedRecord,
    Journal,
    JournalError,
    JournalReplay,
    ProcessEndedRecord,
    ProcessStartedRecord,
    Record,
    ReleaseRecord,
    ReserveRecord,
)
from machine.kept_thread import KeptThread
from machine.lanes import build_lanes
from machine.ledger import Ledger, Reservation, ReservationRequest
from machine.monitor import probe_once, sync_ledger
from machine.reconcile import ReconcileReport, reconcile
from machine.snapshot import NodeSnapshot, build_snapshot
from machine.vram_drift import drift_notes, vram_drift

__all__ = ["Machine", "snapshot_once"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# How long shutdown waits for a journal write still running in its worker thread.
JOURNAL_CLOSE_WAIT = 5.0
# When a client refused for a journal that cannot write should try again.
JOURNAL_RETRY_INTERVAL = 5.0
# How often a journal that failed a write, or lacks its reserve, is retried when
# nothing else writes (each try fails fast on a full disk).
JOURNAL_RECOVER_INTERVAL = 1.0
# How often ended ids past the idempotency window are forgotten (and node time kept).
EXPIRE_INTERVAL = 60.0


def _health_and_ledger(
    inventory: Inventory,
    tracker: HealthTracker,
    *,
    reserved_cpu_millis: int,
    reserved_memory_bytes: int,
    vram_headroom_bytes: int,
) -> tuple[HealthTracker, Ledger]:
    """Seed health from the first readings and build the ledger over the lanes."""
    now = trio.current_time()
    for gpu in inventory.gpus:
        tracker.register(gpu.uuid, at=now)
        for mig in gpu.mig_instances:  # read with its GPU; its own XIDs are its own
            tracker.register(mig.uuid, at=now, parent=gpu.uuid)
    for probe in inventory.probes:
        tracker.observe(probe, at=now)
    ledger = Ledger(
        lanes=build_lanes(inventory),
        cpu_capacity_millis=inventory.cpu.capacity_millis,
        memory_capacity_bytes=inventory.memory.capacity_bytes,
        reserved_cpu_millis=reserved_cpu_millis,
        reserved_memory_bytes=reserved_memory_bytes,
        vram_headroom_bytes=vram_headroom_bytes,
        device_health=tracker.states(),
    )
    return tracker, ledger


async def snapshot_once(
    *,
    node_id: str,
    devices: str,
    sim_file: Path | None,
    reserved_cpu_millis: int,
    reserved_memory_bytes: int,
    vram_headroom_bytes: int,
    fatal_xids: frozenset[int] = DEFAULT_FATAL_XIDS,
    pynvml_module: Any = None,
) -> NodeSnapshot:
    """Discover once and describe the machine, touching no journal and no process
    (a running daemon on the same state folder is left alone)."""
    inventory = await discover(devices, sim_file=sim_file, pynvml_module=pynvml_module)
    try:
        tracker, ledger = _health_and_ledger(
            inventory,
            HealthTracker(fatal_xids=fatal_xids),
            reserved_cpu_millis=reserved_cpu_millis,
            reserved_memory_bytes=reserved_memory_bytes,
            vram_headroom_bytes=vram_headroom_bytes,
        )
        return build_snapshot(
            node_id=node_id,
            sequence=1,
            inventory=inventory,
            health=tracker,
            ledger=ledger,
        )
    finally:
        if inventory.source is not None:
            await inventory.source.aclose()


class Machine:
    def __init__(
        self,
        *,
        node_id: str,
        inventory: Inventory,
        tracker: HealthTracker,
        ledger: Ledger,
        journal: Journal,
        replay: JournalReplay,
        journal_timeout: float,
    ) -> None:
        self.node_id = node_id
        self.inventory = inventory
        self.health = tracker
        self.ledger = ledger
        # Host memory as the latest health probe read it (discovery's until then).
        self.memory = inventory.memory
        self.journal = journal
        self.replay = replay
        self.recovery: ReconcileReport | None = None
        self.removed_cgroups: list[str] = []
        self._sequence = 0
        self._journal_timeout = journal_timeout
        # The journal's writes, one at a time, in a thread kept for them.
        self._writer = KeptThread("journal writer")
        self.group_commit = GroupCommit(journal, run=self._journal, timeout=journal_timeout)

    @classmethod
    async def open(
        cls,
        *,
        node_id: str,
        devices: str,
        sim_file: Path | None,
        state_dir: Path,
        reserved_cpu_millis: int,
        reserved_memory_bytes: int,
        vram_headroom_bytes: int,
        fatal_xids: frozenset[int] = DEFAULT_FATAL_XIDS,
        recovery_probes: int = 3,
        on_transition: Callable[[HealthTransition], None] | None = None,
        pynvml_module: Any = None,
        reconcile_grace: float = 5.0,
        cgroups: Cgroups | None = None,
        journal_timeout: float = 10.0,
        host: tuple[CpuInfo, MemoryInfo] | None = None,
        accept_journal_loss: bool = False,
        idempotency_window: float = WINDOW_S,
        idempotency_max_ids: int = MAX_IDS,
        dev_root: Path | None = None,
        proc_root: Path = PROC,
    ) -> Machine:
        """Discover, open and replay the journal, reconcile. Raises JournalError (unsafe,
        corrupt or lost journal: `accept_journal_loss` opens one that lost records) and
        DiscoveryError (bad mode or sim file); NVML trouble is a readiness reason in
        `inventory`, not an exception. `host`: see `discover`. `dev_root`: where guests'
        device nodes are (`--dev-root`); with NVML, MIG lanes whose capability nodes
        cannot be had there are out of service with why (machine/devnodes.py)."""
        inventory = await discover(
            devices, sim_file=sim_file, pynvml_module=pynvml_module, host=host
        )
        ledger_box: list[Ledger] = []

        def transition(event: HealthTransition) -> None:
            if ledger_box:  # keep allocatable in step with health, at once
                ledger_box[0].set_device_health(event.device_id, event.to_state, event.reasons)
            if on_transition is not None:
                on_transition(event)

        tracker, ledger = _health_and_ledger(
            inventory,
            HealthTracker(
                fatal_xids=fatal_xids, recovery_probes=recovery_probes, on_transition=transition
            ),
            reserved_cpu_millis=reserved_cpu_millis,
            reserved_memory_bytes=reserved_memory_bytes,
            vram_headroom_bytes=vram_headroom_bytes,
        )
        ledger_box.append(ledger)
        if dev_root is not None and inventory.backend == "nvml":
            check = functools.partial(
                check_mig_caps, inventory, ledger.lanes(), dev_root, proc_root
            )
            for lane_id, reason in (await trio.to_thread.run_sync(check)).items():
                ledger.fault_lane(lane_id, reason, cause="mig_caps")
        with trio.fail_after(journal_timeout):
            journal, replay = await trio.to_thread.run_sync(
                functools.partial(
                    Journal.open,
                    state_dir,
                    accept_loss=accept_journal_loss,
                    window_s=idempotency_window,
                    max_ids=idempotency_max_ids,
                ),
                abandon_on_cancel=True,
            )
        for reservation in replay.reservations.values():
            ledger.adopt(reservation)
        machine = cls(
            node_id=node_id,
            inventory=inventory,
            tracker=tracker,
            ledger=ledger,
            journal=journal,
            replay=replay,
            journal_timeout=journal_timeout,
        )
        if cgroups is not None:
            # Each invocation's cgroup is named by its reservation, each ready sandbox's
            # by this state folder's pool prefix: kill what the dead daemon left there
            # (setsid escapees included) before reconcile ends its process groups.
            # Other names may be another daemon's: untouched.
            pooled = pool_cgroup_prefix(state_dir)
            ours = set(replay.reservations)
            ours.update(name for name in cgroups.leftovers() if name.startswith(pooled))
            machine.removed_cgroups = await cgroups.remove_leftovers(only=ours)
        machine.recovery = await reconcile(journal, ledger=ledger, grace=reconcile_grace)
        return machine

    async def _journal(self, write: Callable[[], T]) -> T:
        with trio.fail_after(self._journal_timeout):
            return await self._writer.run(write)

    async def reserve(self, request: ReservationRequest) -> Reservation:
        """Reserve and journal; raises ReservationRefused, or the journal's error."""
        reservation = self.ledger.reserve(request)
        try:
            await self.group_commit.commit(ReserveRecord(reservation=reservation))
        except BaseException:
            # Not durably recorded: do not hand it out. A record that lands late is
            # released by reconcile on the next start (it has no process); a standing
            # one reconcile keeps, so its release is recorded after it here.
            self.ledger.release(reservation.reservation_id)
            if reservation.standing:
                await self._record_release(reservation.reservation_id)
            raise
        return reservation

    async def _record_release(self, reservation_id: str) -> None:
        try:
            await self.group_commit.commit(
                ReleaseRecord(reservation_id=reservation_id), shield=True
            )
        except (OSError, JournalError, trio.TooSlowError) as exc:
            log.error("journal release of %s failed: %s", reservation_id, exc)

    async def release(self, reservation_id: str) -> Reservation | None:
        """Free now, then journal; idempotent. A journal failure is logged, not raised:
        the resources are already free here, and a restart releases the record.

        A standing reservation is journaled first and freed only once that is durable
        (a restart would keep it): a journal failure is raised, and it stays held, never
        free for a moment to be handed out."""
        held = self.ledger.get(reservation_id)
        if held is not None and held.standing:
            await self.group_commit.commit(
                ReleaseRecord(reservation_id=reservation_id), shield=True
            )
            return self.ledger.release(reservation_id)
        reservation = self.ledger.release(reservation_id)
        if reservation is None:
            return None
        try:
            await self.group_commit.commit(
                ReleaseRecord(reservation_id=reservation_id), shield=True
            )
        except (OSError, JournalError, trio.TooSlowError) as exc:
            log.warning("journal release of %s failed: %s", reservation_id, exc)
        return reservation

    async def end(
        self,
        reservation_id: str,
        *,
        pid: int | None,
        outcome: EndedRecord,
        keep: bool = False,
    ) -> bool:
        """An invocation ended: free its reservation now (unless `keep`: its process
        survived SIGKILL and still holds it), then journal the release, its process's
        end and how it ended together, in one write and one fsync, shielded and under
        the journal's deadline. A failure is logged, not raised: the resources are
        already free here, a restart releases the reservation and finds the pid dead;
        only the outcome is lost (a resubmission after a restart would run again).
        Returns whether the records are durable."""
        records: list[Record] = []
        if not keep:
            if self.ledger.release(reservation_id) is not None:
                records.append(ReleaseRecord(reservation_id=reservation_id))
            if pid is not None:
                records.append(ProcessEndedRecord(reservation_id=reservation_id, pid=pid))
        records.append(outcome)
        try:
            await self.group_commit.commit(*records, shield=True)
            return True
        except Exception as exc:  # whatever it is, the invocation still ends
            log.error(
                "journal of the end of %s failed (its reservation is free; a resubmission "
                "after a restart would run it again): %s",
                reservation_id,
                exc,
            )
            return False

    async def process_started(self, reservation_id: str, pid: int, start_ticks: int | None) -> None:
        """`start_ticks`: `machine.proc.process_start_ticks(pid)` read at spawn."""
        await self.group_commit.commit(
            ProcessStartedRecord(reservation_id=reservation_id, pid=pid, start_ticks=start_ticks)
        )

    async def invocation_ended(self, record: EndedRecord) -> None:
        """Remember durably how an invocation ended (kept for a bounded count and time)."""
        await self.group_commit.commit(record, shield=True)

    def ended_invocation(self, invocation_id: str) -> EndedRecord | None:
        """How `invocation_id` ended, if the journal still remembers it. Raises
        JournalError when the index of ended invocations cannot be read."""
        try:
            return self.journal.ended(invocation_id)
        except sqlite3.Error as exc:
            raise JournalError(f"index {self.journal.index.path}: {exc}") from exc

    def journal_problem(self) -> str | None:
        """Why the journal cannot write (its last write failed) or has no room kept for
        it (a full disk: it writes endings, and no new work is admitted), or None."""
        problem = self.journal.write_problem or self.journal.reserve_problem
        return None if problem is None else f"journal {self.journal.path}: {problem}"

    async def watch_journal(self, *, interval: float = JOURNAL_RECOVER_INTERVAL) -> None:
        """Until cancelled: while the journal's last write failed or its reserve is not
        held, retry every `interval`."""
        while True:
            await trio.sleep(interval)
            if self.journal_problem() is None:
                continue
            try:
                await self._journal(self.journal.recover)
            except (OSError, JournalError, trio.TooSlowError) as exc:
                log.debug("journal %s still cannot write: %s", self.journal.path, exc)
            else:
                if self.journal_problem() is None:
                    log.info("journal %s writes again", self.journal.path)

    async def expire_ended(self, *, interval: float = EXPIRE_INTERVAL) -> None:
        """Until cancelled: every `interval`, forget the ended ids whose window passed."""
        while True:
            await trio.sleep(interval)
            try:
                # A batch a call, so grants and endings are written in between.
                while await self._journal(self.journal.expire) >= EXPIRE_BATCH:
                    pass
            except (sqlite3.Error, trio.TooSlowError) as exc:
                log.warning("index %s: expiry failed, retried: %s", self.journal.index.path, exc)

    def idempotency_room(self) -> int:
        """How many more ended ids fit in the window: below 1, new work must wait."""
        return self.journal.room()

    def seconds_until_idempotency_room(self) -> float:
        return self.journal.index.seconds_until_room()

    def snapshot(
        self,
        *,
        sequence: int | None = None,
        readiness_reasons: tuple[str, ...] = (),
        notes: tuple[str, ...] = (),
        drained: bool = False,
    ) -> NodeSnapshot:
        """A snapshot numbered `sequence` (the caller counts changes), or the next number."""
        self._sequence = max(self._sequence + 1, sequence or 0)
        snapshot = build_snapshot(
            node_id=self.node_id,
            sequence=self._sequence,
            inventory=self.inventory,
            health=self.health,
            ledger=self.ledger,
            readiness_reasons=readiness_reasons,
            notes=notes,
            memory=self.memory,
            drained=drained,
        )
        drifted = drift_notes(vram_drift(snapshot))
        if not drifted:
            return snapshot
        return msgspec.structs.replace(snapshot, notes=(*snapshot.notes, *drifted))

    def refresh_host_memory(self) -> None:
        """Read host memory again; a failed read keeps the previous figures."""
        if self.inventory.host_memory is None:
            return
        try:
            self.memory = self.inventory.host_memory()
        except Exception as exc:  # psutil and /proc reads: keep the last good figures
            log.debug("host memory read failed: %s", exc)

    async def probe(self, *, probe_timeout: float = 10.0) -> None:
        """One health probe: every device (when there are any), then host memory."""
        if self.inventory.source is not None:
            await probe_once(
                self.inventory.source, self.health, probe_timeout=probe_timeout, ledger=self.ledger
            )
        self.refresh_host_memory()

    async def monitor(
        self,
        *,
        interval: float = 5.0,
        probe_timeout: float = 10.0,
        on_probe: Callable[[], None] = lambda: None,
    ) -> None:
        """Probe until cancelled; `on_probe` hears of every finished probe."""
        sync_ledger(self.health, self.ledger)
        while True:
            await self.probe(probe_timeout=probe_timeout)
            on_probe()
            await trio.sleep(interval)

    async def aclose(self, *, journal_wait: float = JOURNAL_CLOSE_WAIT) -> None:
        if self.inventory.source is not None:
            await self.inventory.source.aclose()
        # A journal write abandoned by its caller (timed out or cancelled) may still run
        # in the writer thread. Closing the descriptor under it could send the rest of
        # its bytes to whatever file next gets that descriptor number, so the close
        # runs in the writer too, after it: waited for shielded, and bounded.
        with trio.move_on_after(journal_wait, shield=True):
            await self._writer.run(self.journal.close)
            return
        # Still stuck (a hung disk): leave the descriptor to the process exit rather
        # than pull it from under the write; what the write finishes is still journaled.
        log.error(
            "journal %s: a write was still running %.1f s into shutdown; leaving it open",
            self.journal.path,
            journal_wait,
        )
