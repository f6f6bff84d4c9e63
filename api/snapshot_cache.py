"""The encoded snapshot, rebuilt only when state changed.

Anything that changes what a snapshot shows calls `mark_changed()`, which
counts the change; the next read rebuilds and re-encodes once, numbered with
that count (so `sequence` rises with every change, even unread ones), and
every other read returns the same bytes. Reading under load
therefore costs a dictionary lookup, not a rebuild.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from machine.snapshot import NodeSnapshot

__all__ = ["SnapshotCache"]


class SnapshotCache:
    def __init__(self, build: Callable[[int], NodeSnapshot]) -> None:
        self._build = build
        self._changes = 1
        self._changed = True
        self._snapshot: NodeSnapshot | None = None
        self._encoded = b""
        self._encoder = msgspec.json.Encoder()

    def mark_changed(self) -> None:
        self._changes += 1
        self._changed = True

    def _refresh(self) -> None:
        if self._changed or self._snapshot is None:
            self._changed = False
            self._snapshot = self._build(self._changes)
            self._encoded = self._encoder.encode(self._snapshot)

    def current(self) -> NodeSnapshot:
        self._refresh()
        assert self._snapshot is not None
        return self._snapshot

    def encoded(self) -> bytes:
        self._refresh()
        return self._encoded
