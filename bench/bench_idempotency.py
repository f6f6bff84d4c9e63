"""What remembering ended ids on disk for the whole window costs, side by side:

- no-op submissions in process (`bench_throughput.in_process`: 64 concurrent
  clients, each submitting a builtin `echo` and waiting for it to end, the
  journal fsync'd on disk) with the on-disk index of ended invocations (SQLite,
  `machine/ended_index.py`) already holding PREFILL ids, against the same with
  the endings kept in a dict in memory, as the node kept its newest 4,096
  before. In process is the strict comparison: the index costs the same
  microseconds per invocation through the HTTP API, where each invocation takes
  longer, so its share there is smaller;
- the index's own costs: a lookup of an id it does not hold (every new
  submission makes one) and an ending added (a compaction adds them in bulk).

Variants alternate, REPEATS times each after a warm-up; medians and ranges.
"""

from __future__ import annotations

import contextlib
import pathlib
import sqlite3
import tempfile
import time
from collections.abc import Iterable, Iterator

import trio

import machine.journal
from bench.bench_throughput import in_process
from bench.harness import Finding, median
from machine.ended_index import INDEX_FILENAME, EndedIndex
from machine.journal_records import EndedRecord

REPEATS = 5
N = 3000
PREFILL = 900_000  # 90% of the default --idempotency-max-ids: near its fullest, still admitting
OUTCOME = b'{"id":"x","state":"succeeded","requirement":"cpu","isolation":"shared"}' * 5


class MemoryIndex:
    """The endings in a dict: what the node did before the index (no disk, no window)."""

    def __init__(self, path: pathlib.Path, window_s: float, max_ids: int) -> None:
        self.path, self.window_s, self.max_ids = path, window_s, max_ids
        self._ended: dict[str, EndedRecord] = {}

    @classmethod
    def open(
        cls, state_dir: pathlib.Path, *, window_s: float, max_ids: int, **_kw: object
    ) -> MemoryIndex:
        return cls(state_dir / "memory", window_s, max_ids)

    @property
    def count(self) -> int:
        return len(self._ended)

    def add(self, records: Iterable[EndedRecord]) -> None:
        self._ended.update((r.invocation_id, r) for r in records)

    def get(self, invocation_id: str) -> EndedRecord | None:
        return self._ended.get(invocation_id)

    def newest(self, limit: int) -> list[EndedRecord]:
        return list(self._ended.values())[-limit:] if limit else []

    def expire(self) -> int:
        return 0

    def room(self) -> int:
        return self.max_ids - len(self._ended)

    def seconds_until_room(self) -> float:
        return 1.0

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _in_memory() -> Iterator[None]:
    """Journals opened meanwhile keep their endings in a `MemoryIndex`."""
    names = vars(machine.journal)
    saved = names["EndedIndex"]
    names["EndedIndex"] = MemoryIndex
    try:
        yield
    finally:
        names["EndedIndex"] = saved


def _prefill(state_dir: pathlib.Path, count: int) -> None:
    """`count` ended ids in the index, as a node at its bound holds them."""
    state_dir.mkdir(mode=0o700, exist_ok=True)
    EndedIndex.open(state_dir).close()
    db = sqlite3.connect(state_dir / INDEX_FILENAME, isolation_level=None)
    now = time.time()
    db.execute("BEGIN")
    db.executemany(
        "INSERT INTO ended (id, digest, outcome, ended_at, node_at) VALUES (?, ?, ?, ?, 0)",
        ((f"old-{n:09d}", "0" * 64, OUTCOME, now) for n in range(count)),
    )
    db.execute("COMMIT")
    db.close()


async def _rate(state_dir: pathlib.Path, prefix: str) -> float:
    return (await in_process(state_dir, count=N, prefix=f"{prefix}-"))[0]


def _index_costs(state_dir: pathlib.Path) -> tuple[float, float]:
    """(µs per lookup of an id not held, µs per ending added in batches of 1,000)."""
    index = EndedIndex.open(state_dir)
    try:
        lookups = 20_000
        start = time.perf_counter()
        for n in range(lookups):
            index.get(f"absent-{n}")
        lookup = (time.perf_counter() - start) / lookups * 1e6
        records = [
            EndedRecord(
                invocation_id=f"added-{n}", request_digest="0" * 64, ended_at=0.0, outcome=OUTCOME
            )
            for n in range(20_000)
        ]
        start = time.perf_counter()
        for first in range(0, len(records), 1000):
            index.add(records[first : first + 1000])
        added = (time.perf_counter() - start) / len(records) * 1e6
    finally:
        index.close()
    return lookup, added


def _spread(samples: list[float]) -> str:
    return f"{median(samples):,.0f}/s ({min(samples):,.0f}-{max(samples):,.0f})"


def run() -> list[Finding]:
    with tempfile.TemporaryDirectory() as base:
        on_disk, in_memory = pathlib.Path(base, "index"), pathlib.Path(base, "memory")
        _prefill(on_disk, PREFILL)
        size = (on_disk / INDEX_FILENAME).stat().st_size
        trio.run(_rate, on_disk, "warm")
        indexed: list[float] = []
        memory: list[float] = []
        for repeat in range(REPEATS):
            indexed.append(trio.run(_rate, on_disk, f"r{repeat}"))
            with _in_memory():
                memory.append(trio.run(_rate, in_memory, f"r{repeat}"))
        lookup, added = _index_costs(on_disk)
    ratio = median(indexed) / median(memory)
    return [
        Finding(
            name=f"no-op submissions, index holding {PREFILL:,} ids vs endings in memory",
            target="the index costs under 10% (ratio >= 0.90)",
            figures={
                "index": _spread(indexed),
                "in memory": _spread(memory),
                "index file": f"{size / 2**20:,.0f} MiB ({size / PREFILL:,.0f} B an id)",
                "lookup of an absent id": f"{lookup:.1f} µs",
                "ending added": f"{added:.1f} µs",
            },
            ratio=ratio,
            met=ratio >= 0.90,
        )
    ]
