"""The snapshot is rebuilt only after a change, and its sequence counts every change."""

from __future__ import annotations

import pathlib

import trio

from api.snapshot_cache import SnapshotCache
from tests.supervisor_fixtures import open_machine


async def test_rebuilt_only_on_change_and_sequence_counts_changes(tmp_path: pathlib.Path) -> None:
    machine = await open_machine(tmp_path)
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
