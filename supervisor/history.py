"""How invocations ended before, as the journal remembers them, for the list.

The journal remembers every ended invocation for the idempotency window, across
restarts (`machine/journal.py`: fsynced, replayed on start, a corrupt journal
stops start-up), and hands the newest `LISTED_ENDED` (4,096) to the list at
start. This is that set decoded once, so listing it costs no decoding: seeded
from the replay, then fed each ending the journal took; it lists the newest
4,096 that ended inside the window (by wall clock here: a clock step can hide
one from the list, never from `GET /v1/invocations/{id}` or from idempotency).
An outcome this version cannot read is listed as `failed`, reason
`recorded_outcome_unreadable`, never dropped.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

from machine.journal import LISTED_ENDED, WINDOW_S, EndedRecord
from supervisor.remembered import recorded_status
from supervisor.wire import InvocationStatus

__all__ = ["History"]


class History:
    def __init__(
        self,
        records: Iterable[EndedRecord] = (),
        *,
        count: int = LISTED_ENDED,
        seconds: float = WINDOW_S,
    ) -> None:
        self._count = count
        self._seconds = seconds
        self._ended: OrderedDict[str, tuple[float, InvocationStatus]] = OrderedDict()
        for record in records:
            self.add(record)

    def add(self, record: EndedRecord, status: InvocationStatus | None = None) -> None:
        """Remember `record` (the journal took it), newest last; the oldest over the
        bound is no longer listed. `status`: its outcome, when the
        caller has it decoded already (it wrote it)."""
        self._ended.pop(record.invocation_id, None)
        self._ended[record.invocation_id] = (record.ended_at, status or recorded_status(record))
        while len(self._ended) > self._count:
            self._ended.popitem(last=False)

    def statuses(self) -> list[InvocationStatus]:
        """Those that ended inside the window."""
        horizon = time.time() - self._seconds
        return [status for ended_at, status in self._ended.values() if ended_at >= horizon]
