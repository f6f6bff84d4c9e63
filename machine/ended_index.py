"""Ended invocations by id, on disk, for the whole idempotency window.

An id that ended is remembered for `window_s` seconds of *node time*: the time
the node has been running, as CLOCK_MONOTONIC measures it, summed across
restarts (the running total is kept in the index). A wall-clock step, forward
or back, never shortens the window. Time the node is down does not count, and
time not yet written when it crashed is lost from the total too, so an id is
always remembered at least the window, and longer by any downtime.

One SQLite file (`ended.sqlite3`, WAL mode): one table keyed by id, holding its
request's digest, its recorded outcome, when it ended (wall clock, for people)
and its node time (for expiry). The journal is its write-ahead log: endings
stay in the journal until `add` has made them durable here (`synchronous=FULL`:
the commit is fsynced), so a crash between the two loses nothing; adding an
id again replaces its entry, and its window starts again (never shorter).

Bounded: `room()` says how many more ids fit under `max_ids`; the caller refuses
new work while there is none, and `seconds_until_room()` says when the oldest
expires. An id is never dropped to make room.

Writes (`add`, `expire`) come from one thread at a time (the journal's writer);
`get` reads on a connection of its own, which never waits for the writer.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from machine.journal_errors import JournalError, check_safe
from machine.journal_records import EndedRecord

__all__ = [
    "EXPIRE_BATCH",
    "INDEX_FILENAME",
    "MAX_IDS",
    "WINDOW_S",
    "EndedIndex",
    "IndexUnusable",
]

INDEX_FILENAME = "ended.sqlite3"
WINDOW_S = 24 * 3600.0
# About 600 bytes an id on disk (its outcome is most of it; up to ~7 KiB with 16 full
# labels and a 1 KiB command line): 1,000,000 is ~0.6 GB, at most ~7 GB.
MAX_IDS = 1_000_000
# Rows forgotten per expiry call at most: a longer prefix (a window lowered at a
# restart, or a fast node) goes over several calls.
EXPIRE_BATCH = 10_000
_BUSY_MS = 5000  # a reader never blocks a WAL writer; this bounds a stray lock

# Rows are added in rowid order (a new rowid is the largest yet) and node time only
# grows, so what left the window is a prefix by rowid: no index on node time needed.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS ended (
    id TEXT PRIMARY KEY,
    digest TEXT NOT NULL,
    outcome BLOB NOT NULL,
    ended_at REAL NOT NULL,
    node_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS clock (
    one INTEGER PRIMARY KEY CHECK (one = 1),
    node_time REAL NOT NULL
);
"""
_COLUMNS = "id, digest, outcome, ended_at"


class IndexUnusable(JournalError):
    """The index file cannot be opened or read as one (damaged, or not ours)."""

    def __init__(self, path: Path, problem: object) -> None:
        self.path = path
        super().__init__(
            f"index of ended invocations {path} is unusable ({problem}): inspect it, or "
            "move it aside (the ids it held may then run again)"
        )


# A full disk or failing I/O is the disk's trouble, not a damaged index: the file is
# fine, and moving it aside would forget every id it holds.
_DISK_ERRORS = {"SQLITE_FULL": errno.ENOSPC, "SQLITE_CANTOPEN": errno.EACCES}


def _open_error(path: Path, exc: sqlite3.DatabaseError) -> OSError | IndexUnusable:
    name = getattr(exc, "sqlite_errorname", "") or ""
    if name in _DISK_ERRORS or name.startswith("SQLITE_IOERR"):
        return OSError(_DISK_ERRORS.get(name, errno.EIO), f"{exc} ({name})", str(path))
    return IndexUnusable(path, exc)


def _record(row: tuple[str, str, bytes, float]) -> EndedRecord:
    return EndedRecord(
        invocation_id=row[0], request_digest=row[1], outcome=bytes(row[2]), ended_at=row[3]
    )


def _connect(path: Path, *, synchronous: str) -> sqlite3.Connection:
    # isolation_level=None: no implicit transactions; each write says BEGIN itself.
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        db.execute(f"PRAGMA busy_timeout = {_BUSY_MS}")
        db.execute("PRAGMA journal_mode = WAL")
        db.execute(f"PRAGMA synchronous = {synchronous}")
    except BaseException:
        db.close()
        raise
    return db


class EndedIndex:
    def __init__(
        self,
        path: Path,
        writer: sqlite3.Connection,
        reader: sqlite3.Connection,
        *,
        window_s: float,
        max_ids: int,
        clock: Callable[[], float],
    ) -> None:
        self.path = path
        self.window_s = window_s
        self.max_ids = max_ids
        self._writer = writer
        self._reader = reader
        self._read_lock = threading.Lock()  # one reader connection, callers on any thread
        self._clock = clock
        self._closed = False
        (count,) = writer.execute("SELECT count(*) FROM ended").fetchone()
        self.count: int = count
        # The newest row has the largest node time (rows are added in node-time order):
        # read by rowid, never by a scan of the table.
        row = writer.execute(
            "SELECT max(coalesce((SELECT node_time FROM clock), 0),"
            " coalesce((SELECT node_at FROM ended ORDER BY rowid DESC LIMIT 1), 0))"
        ).fetchone()
        self._base: float = row[0]
        self._opened_at = clock()

    @classmethod
    def open(
        cls,
        state_dir: Path,
        *,
        window_s: float = WINDOW_S,
        max_ids: int = MAX_IDS,
        durable: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> EndedIndex:
        """Open (creating it 0600) the index in `state_dir`; raises JournalUnsafe for a
        file that is not ours, IndexUnusable for one SQLite cannot use."""
        path = state_dir / INDEX_FILENAME
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except OSError:
            check_safe(path, os.lstat(path))  # a symlink or a folder: say which
            raise
        try:
            check_safe(path, os.fstat(fd))
        finally:
            os.close(fd)
        synchronous = "FULL" if durable else "OFF"
        opened: list[sqlite3.Connection] = []
        try:
            opened.append(_connect(path, synchronous=synchronous))
            opened[0].executescript(_SCHEMA)
            opened.append(_connect(path, synchronous=synchronous))
            return cls(path, *opened, window_s=window_s, max_ids=max_ids, clock=clock)
        except sqlite3.DatabaseError as exc:
            for db in opened:
                db.close()
            raise _open_error(path, exc) from None

    def node_time(self) -> float:
        """Seconds this node has run, summed over its runs (as far as they were kept)."""
        return self._base + (self._clock() - self._opened_at)

    def add(self, records: Iterable[EndedRecord]) -> None:
        """Remember `records` durably (one fsynced transaction); an id already held is
        replaced. Raises sqlite3.Error (a full disk): nothing was added."""
        now = self.node_time()
        rows = [(r.invocation_id, r.request_digest, r.outcome, r.ended_at, now) for r in records]
        if not rows:
            return
        db = self._writer
        db.execute("BEGIN IMMEDIATE")
        try:
            # Ids held already (added before a crash, or ended again) are replaced, not
            # counted twice.
            held = sum(
                db.execute("SELECT count(*) FROM ended WHERE id = ?", (row[0],)).fetchone()[0]
                for row in rows
            )
            db.executemany(
                "INSERT OR REPLACE INTO ended (id, digest, outcome, ended_at, node_at)"
                " VALUES (?, ?, ?, ?, ?)",
                rows,
            )
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise
        self.count += len({row[0] for row in rows}) - held

    def get(self, invocation_id: str) -> EndedRecord | None:
        """How `invocation_id` ended, if it ended inside the window."""
        horizon = self.node_time() - self.window_s
        with self._read_lock:
            row = self._reader.execute(
                f"SELECT {_COLUMNS} FROM ended WHERE id = ? AND node_at >= ?",  # noqa: S608
                (invocation_id, horizon),
            ).fetchone()
        return None if row is None else _record(row)

    def newest(self, limit: int) -> list[EndedRecord]:
        """The `limit` last added inside the window, oldest first."""
        horizon = self.node_time() - self.window_s
        with self._read_lock:
            rows = self._reader.execute(
                f"SELECT {_COLUMNS} FROM ended WHERE node_at >= ?"  # noqa: S608
                " ORDER BY rowid DESC LIMIT ?",
                (horizon, limit),
            ).fetchall()
        return [_record(row) for row in reversed(rows)]

    def expire(self) -> int:
        """Forget what ended before the window and keep the node's running time; returns
        how many were forgotten. Raises sqlite3.Error (nothing changed)."""
        now = self.node_time()
        db = self._writer
        db.execute("BEGIN IMMEDIATE")
        try:
            # At most EXPIRE_BATCH a call: a long prefix (a window lowered at a restart)
            # goes over several calls, never in one transaction that holds up the writer.
            cursor = db.execute(
                "DELETE FROM ended WHERE rowid IN (SELECT rowid FROM ended"
                " WHERE node_at < ? ORDER BY rowid LIMIT ?)",
                (now - self.window_s, EXPIRE_BATCH),
            )
            db.execute(
                "INSERT INTO clock (one, node_time) VALUES (1, ?)"
                " ON CONFLICT (one) DO UPDATE SET node_time = max(node_time, excluded.node_time)",
                (now,),
            )
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise
        self.count = max(0, self.count - cursor.rowcount)
        return cursor.rowcount

    def room(self) -> int:
        return self.max_ids - self.count

    def seconds_until_room(self) -> float:
        """When the oldest id held leaves the window (at least 1 s)."""
        with self._read_lock:
            row = self._reader.execute(
                "SELECT node_at FROM ended ORDER BY rowid LIMIT 1"
            ).fetchone()
        if row is None:  # the room is held by endings not moved here yet: a window away
            return self.window_s
        (oldest,) = row
        return max(1.0, float(oldest) + self.window_s - self.node_time())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(sqlite3.Error):
            self.expire()  # keeps the running time for the next start
        self._reader.close()
        self._writer.close()
