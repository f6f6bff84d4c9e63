"""Invocation logs on disk: every byte of each invocation's stdout and stderr, bounded.

Each invocation gets `<folder>/<id>.stdout` and `<id>.stderr` (mode 0600 in a 0700
folder of the state folder, which the sandbox masks from every guest), each made at
its stream's first byte: an invocation that writes nothing costs no file and no disk
call, and its logs read as empty. Bounds: at
most `invocation_bytes` per invocation (both streams; later bytes are cut and only
the status's tail shows them), `total_bytes` over every log, at most MAX_KEPT ended
invocations, and each is removed `retention_s` seconds after its end.

The total is shared fairly: each invocation holding logs is guaranteed an equal share
(`total_bytes` over their number). When a write would pass the total, room comes from
whoever holds the most, when that is over its share: an ended invocation's logs are
evicted (whole, the largest first, the older of equals first), or, when the writer
itself holds the most (or only running ones are over their shares), the writer's
new bytes are cut (`total_limit`). So one invocation's output never evicts logs that
are within their share, and whatever is evicted before its retention says so
(`logs_cut: evicted`). A running invocation's logs are never evicted. Writes run in
worker threads of their own
limiter, each under a deadline: a full, failing or stuck disk cuts that
invocation's logs and its status says so (`logs_cut`); the invocation itself runs
and ends as it would have.

Below every bound, the disk floor (`--state-min-free`, `machine/disk_floor.py`):
a write that would leave less free space than the floor on the state folder's
filesystem (the journal's) keeps what fits above it, and that invocation's
later bytes are cut (`disk_floor`). Bytes are counted as the filesystem
allocates them (whole blocks), so the floor holds to the block.
"""

from __future__ import annotations

import dataclasses
import errno
import heapq
import itertools
import logging
import os
import stat
import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import trio

from machine.disk_floor import DiskFloor
from supervisor.wire import INVOCATION_ID

__all__ = ["STREAMS", "InvocationLogs", "LogLimits", "LogStore", "LogStoreError"]

log = logging.getLogger(__name__)

STREAMS = ("stdout", "stderr")
# Ended invocations whose logs are kept, whatever their size (the index stays bounded).
MAX_KEPT = 4096
# One write (or create, or removal) of log files; past it the logs are cut.
WRITE_SECONDS = 10.0
# How often logs past their retention are looked for.
SWEEP_SECONDS = 60.0
# Log writes never take the threads the journal and the rest of the node use.
WRITER_THREADS = 4


class LogStoreError(Exception):
    """The logs folder is unsafe or unreadable (start-up stops)."""


@dataclasses.dataclass(frozen=True)
class LogLimits:
    invocation_bytes: int  # stdout + stderr of one invocation
    total_bytes: int  # every log on disk
    retention_s: float  # after the invocation's end


class InvocationLogs:
    """One invocation's two log files: written while it runs, read by followers."""

    def __init__(self, store: LogStore, invocation_id: str) -> None:
        self.id = invocation_id
        self._store = store
        self.bytes = 0  # counted against the bounds (both files)
        self.sizes = dict.fromkeys(STREAMS, 0)  # bytes of this run in each file
        self.cut: str | None = None  # why some bytes were not kept ("evicted": all of them)
        self.created = False  # it takes bytes (an older run's files of the id are gone)
        self.closed = False  # no byte will be added any more
        self.ended_at: float | None = None  # wall clock
        self._changed: trio.Event | None = None  # made when a reader asks for it
        # Streams whose file this run made (or found at start); only these are read.
        self._on_disk: set[str] = set()
        self.stale = False  # an older run of the id left files that must go first

    def path(self, stream: str) -> Path:
        return self._store.folder / f"{self.id}.{stream}"

    def on_disk(self, stream: str) -> bool:
        """`stream` has a file of this run's (a stream never written has none)."""
        return stream in self._on_disk

    def files(self) -> list[Path]:
        return [self.path(s) for s in STREAMS if s in self._on_disk]

    @property
    def changed(self) -> trio.Event:
        """Set at the next write, creation or close (take it before reading)."""
        if self._changed is None:
            self._changed = trio.Event()
        return self._changed

    def _notify(self) -> None:
        # Logs nobody follows (most of them) cost no event.
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _cut_at(self, reason: str) -> None:
        if self.cut is None:
            self.cut = reason
            log.warning("logs of %s cut: %s", self.id, reason)

    async def create(self) -> None:
        """Take bytes from now on. No file is made here (each stream's is made at its first
        byte) unless an older run of the id left files: they are emptied first, so that no
        reader sees them. A failure cuts the logs, never the invocation."""
        if self.stale:
            try:
                await self._store.in_thread(_create, [self.path(s) for s in STREAMS])
                self._on_disk.update(STREAMS)
            except (OSError, trio.TooSlowError) as exc:
                self._cut_at(_failure("create_failed", exc))
                self._notify()
                return
        self.created = True
        self._notify()

    async def write(self, stream: str, data: bytes) -> None:
        """Append `data` to `stream`'s file, within the bounds; never raises for the disk."""
        if not data or self.closed or not self.created or self.cut is not None:
            return
        floor = self._store.floor
        if floor is not None and floor.stale() and not await self._read_floor(floor):
            return
        allowed, victims, reason, reserved = self._store.make_room(self, stream, len(data))
        if reason is not None:
            self._cut_at(reason)
        if not allowed and not victims:
            return
        first = allowed > 0 and stream not in self._on_disk
        try:
            await self._store.in_thread(_append, self.path(stream), data[:allowed], victims, first)
        except (OSError, trio.TooSlowError) as exc:
            self._cut_at(_failure("write_failed", exc))
        finally:
            if floor is not None:
                floor.done(reserved)
            # Readers open the file only from now on (after a failed first write it may
            # be missing: that reads as empty). Per-stream writes are never concurrent.
            if allowed:
                self._on_disk.add(stream)
        self._notify()

    async def _read_floor(self, floor: DiskFloor) -> bool:
        """Read the free space (at most once a READING_SECONDS), in a log thread: a stuck
        disk stalls it. False: the logs are cut (it failed, or the other stream's write
        was cut meanwhile)."""
        try:
            await self._store.in_thread(floor.read)
        except (OSError, trio.TooSlowError) as exc:
            self._cut_at(_failure("write_failed", exc))
            self._notify()
        return self.cut is None

    async def close(self) -> None:
        """No more bytes: followers end once they have read everything."""
        if self.closed:
            return
        self.closed = True
        self.ended_at = time.time()
        victims = self._store.ended(self)
        self._notify()
        await self._store.remove(victims)


def _failure(what: str, exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return f"{what}: the disk did not answer within {WRITE_SECONDS:g}s"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return f"{what}: disk full"
    return f"{what}: {exc}"[:200]


def _blocks(size: int, block: int) -> int:
    """Bytes a file of `size` bytes takes on disk (whole blocks)."""
    return -(-size // block) * block


def _fits(size: int, room: int, block: int) -> int:
    """Bytes that may be appended to a file of `size` bytes while it grows on disk by at
    most `room`: the rest of its last block, then whole blocks."""
    return _blocks(size, block) - size + room // block * block


def _create(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        os.close(fd)


def _append(path: Path, data: bytes, victims: list[Path], first: bool) -> None:
    _unlink(victims)
    if not data:
        return
    # Created (and emptied) at the stream's first byte only: a file removed under us
    # later is not made again.
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    if first:
        flags |= os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _unlink(paths: Iterable[Path]) -> None:
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:  # logged, and the bound is still counted as freed
            log.error("cannot remove log %s: %s", path, exc)


class LogStore:
    """Every invocation's logs: the live ones and the kept ended ones, with the bounds."""

    def __init__(self, folder: Path, limits: LogLimits, floor: DiskFloor | None = None) -> None:
        self.folder = folder
        self.limits = limits
        # Free space kept on the state folder's filesystem; None (or a floor of 0): none.
        self.floor = floor if floor is not None and floor.enabled else None
        self.total = 0
        self.holders = 0  # invocations with bytes counted (live and ended): shares' divisor
        self._live: dict[str, InvocationLogs] = {}
        self._ended: OrderedDict[str, InvocationLogs] = OrderedDict()  # oldest end first
        # The ended logs that hold bytes, largest first (older first among equals); an
        # entry no longer in `_ended` is skipped, and compacted away (see `_index`).
        self._largest: list[tuple[int, int, InvocationLogs]] = []
        self._order = itertools.count()
        self._limiter = trio.CapacityLimiter(WRITER_THREADS)
        self.readers = 0  # open log streams (the edge bounds them)

    @classmethod
    async def open(
        cls, folder: Path, limits: LogLimits, floor: DiskFloor | None = None
    ) -> LogStore:
        """Create the folder (0700) or check it is ours and private; index what it holds
        (from a previous run: ended) and apply the bounds at once."""
        store = cls(folder, limits, floor)
        found = await trio.to_thread.run_sync(_scan, folder)
        for invocation_id, (size, ended_at) in sorted(found.items(), key=lambda kv: kv[1][1]):
            logs = InvocationLogs(store, invocation_id)
            logs.created = logs.closed = True
            logs._on_disk.update(STREAMS)
            logs.ended_at = ended_at
            store._ended[invocation_id] = logs
            store._count(logs, size)
            store._index(logs)
        await store.remove(store._over_bounds(time.time()))
        return store

    async def in_thread(self, fn: object, *args: object) -> None:
        """Run a file operation in a log thread, under WRITE_SECONDS."""
        with trio.fail_after(WRITE_SECONDS):
            await trio.to_thread.run_sync(
                fn,  # type: ignore[arg-type]
                *args,
                limiter=self._limiter,
                abandon_on_cancel=True,
            )

    def begin(self, invocation_id: str) -> InvocationLogs:
        """Logs for an invocation that starts now (an older run's logs of the id go)."""
        old = self._ended.pop(invocation_id, None) or self._live.pop(invocation_id, None)
        logs = InvocationLogs(self, invocation_id)
        if old is not None:
            self._count(old, -old.bytes)
            logs.stale = bool(old.files())  # emptied by `create`
        self._live[invocation_id] = logs
        return logs

    def find(self, invocation_id: str) -> InvocationLogs | None:
        return self._live.get(invocation_id) or self._ended.get(invocation_id)

    def share(self, logs: InvocationLogs | None = None) -> int:
        """Each holder's guaranteed bytes: the total over the invocations holding logs
        (`logs` counted among them, as it asks to hold some)."""
        holders = self.holders + (1 if logs is not None and logs.bytes == 0 else 0)
        return self.limits.total_bytes // max(1, holders)

    def make_room(
        self, logs: InvocationLogs, stream: str, size: int
    ) -> tuple[int, list[Path], str | None, int]:
        """How many of `size` new bytes of `stream` `logs` may keep, the ended logs to
        remove to make room (already forgotten here), why the rest is cut (None: nothing
        is), and the bytes granted by the disk floor (`done` with them once written)."""
        reason = None
        allowed = max(0, min(size, self.limits.invocation_bytes - logs.bytes))
        if allowed < size:
            reason = "invocation_limit"
        floor = self.floor
        if floor is not None and allowed:
            fits = _fits(logs.sizes[stream], floor.room(), floor.block)
            if fits < allowed:
                allowed, reason = fits, "disk_floor"
        victims: list[Path] = []
        while self.total + allowed > self.limits.total_bytes:
            # The largest over-share gives first: the largest ended logs if they are
            # over their share and at least as large as the writer's would be, else
            # the writer's new bytes (no ended logs within their share are taken).
            largest = self._largest_ended()
            if (
                largest is None
                or largest.bytes <= self.share(logs)
                or largest.bytes < logs.bytes + allowed
            ):
                allowed = max(0, self.limits.total_bytes - self.total)
                reason = "total_limit"
                break
            victims += self._forget(largest.id, evicted=True)
        reserved = 0
        if floor is not None and allowed:
            reserved = _blocks(logs.sizes[stream] + allowed, floor.block) - _blocks(
                logs.sizes[stream], floor.block
            )
            if not floor.reserve(reserved):  # another writer took the room meanwhile
                allowed, reason, reserved = 0, "disk_floor", 0
        logs.sizes[stream] += allowed
        self._count(logs, allowed)
        return allowed, victims, reason, reserved

    def ended(self, logs: InvocationLogs) -> list[Path]:
        """`logs` is complete: it joins the ended ones; returns what the bounds evict."""
        if self._live.get(logs.id) is logs:
            del self._live[logs.id]
            self._ended[logs.id] = logs
            self._index(logs)
        return self._over_bounds(time.time())

    def _count(self, logs: InvocationLogs, size: int) -> None:
        """`size` more (or, negative, fewer) bytes of `logs` count against the bounds."""
        held, holds = logs.bytes > 0, logs.bytes + size > 0
        self.holders += holds - held
        logs.bytes += size
        self.total += size

    def _index(self, logs: InvocationLogs) -> None:
        """Ended `logs` (in `_ended`) enter the largest-first index; stale entries are
        compacted away before they outnumber the kept ones (it stays bounded)."""
        if not logs.bytes:
            return
        heapq.heappush(self._largest, (-logs.bytes, next(self._order), logs))
        if len(self._largest) > 2 * len(self._ended) + 64:
            self._largest = [e for e in self._largest if self._ended.get(e[2].id) is e[2]]
            heapq.heapify(self._largest)

    def _largest_ended(self) -> InvocationLogs | None:
        while self._largest:
            logs = self._largest[0][2]
            if self._ended.get(logs.id) is logs:
                return logs
            heapq.heappop(self._largest)
        return None

    def _forget(self, invocation_id: str, *, evicted: bool = False) -> list[Path]:
        """Forget ended logs; `evicted`: before their retention, and their status says so
        (when they held any byte)."""
        logs = self._ended.pop(invocation_id)
        if evicted and logs.bytes:
            logs.cut = "evicted"
            log.warning("logs of %s evicted (%d bytes) to make room", logs.id, logs.bytes)
        self._count(logs, -logs.bytes)
        return logs.files()

    def _over_bounds(self, now: float) -> list[Path]:
        """Forget the ended logs past their retention or beyond MAX_KEPT (oldest first),
        and beyond the total (largest first: only a lowered total at start passes it)."""
        victims: list[Path] = []
        # Oldest first, stopping at the first that stays: an ending costs its victims
        # plus one look, not a walk over every kept log.
        while self._ended:
            invocation_id, logs = next(iter(self._ended.items()))
            expired = (logs.ended_at or 0.0) + self.limits.retention_s <= now
            if not (expired or len(self._ended) > MAX_KEPT):
                break
            victims += self._forget(invocation_id, evicted=not expired)
        while self.total > self.limits.total_bytes:
            largest = self._largest_ended()
            if largest is None:
                break
            victims += self._forget(largest.id, evicted=True)
        return victims

    async def remove(self, victims: list[Path]) -> None:
        if not victims:
            return
        with trio.CancelScope(shield=True):
            try:
                await self.in_thread(_unlink, victims)
            except trio.TooSlowError:
                log.error("removing %d log files took over %ss", len(victims), WRITE_SECONDS)

    async def run(self) -> None:
        """Remove logs past their retention, every SWEEP_SECONDS, until cancelled."""
        while True:
            await trio.sleep(min(SWEEP_SECONDS, self.limits.retention_s))
            await self.remove(self._over_bounds(time.time()))


def _scan(folder: Path) -> dict[str, tuple[int, float]]:
    """Create or check the folder; (bytes, end time) of each invocation's logs in it."""
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        found = folder.lstat()
    except OSError as exc:
        raise LogStoreError(f"logs folder {folder}: {exc.strerror}") from exc
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.geteuid():
        raise LogStoreError(f"logs folder {folder} is not a folder of this daemon's own")
    if stat.S_IMODE(found.st_mode) & 0o077:
        os.chmod(folder, 0o700)  # inside the (checked, private) state folder
    logs: dict[str, tuple[int, float]] = {}
    for entry in os.scandir(folder):
        invocation_id, _, stream = entry.name.rpartition(".")
        if stream not in STREAMS or not INVOCATION_ID.fullmatch(invocation_id):
            continue
        info = entry.stat(follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode):
            continue
        size, ended_at = logs.get(invocation_id, (0, 0.0))
        logs[invocation_id] = (size + info.st_size, max(ended_at, info.st_mtime))
    return logs
