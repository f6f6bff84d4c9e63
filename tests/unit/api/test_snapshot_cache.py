"""The snapshot is rebuilt only after a change, and its sequence counts every change."""

from __future__ import annotations

import pathlib

import trio

from api.snapshot_cache import SnapshotCache
from machine import Machine


async def test_rebuilt_only_on_change_and_sequence_counts_changes(tmp_path: pathlib.Path) -> None:
    machine = await Machine.open(
        node_id="n1",
        devices="sim",
        sim_file=None,
        state_dir=tmp_path,
        reserved_cpu_millis=0,
        reserved_memory_bytes=0,
        vram_headroom_bytes=0,
    )
    builds: list[int] = []

    def build(changes: int):  # type: ignore[no-untyped-def]
        builds.append(changes)
        return machine.snapshot(sequence=changes)

    try:
        cache = SnapshotCache(build)
        first = cache.encoded()
        assert cache.encoded() is first and len(builds) == 1  # unchanged: same bytes
        start = cache.current().sequence
        cache.mark_changed()
        cache.mark_changed()  # two changes, nobody read in between
        assert cache.current().sequence == start + 2
        assert cache.encoded() != first and len(builds) == 2
    finally:
        with trio.CancelScope(shield=True):
            await machine.aclose()
