"""How invocations ended before, as the journal remembers them, for the list.

The journal keeps the newest `RETAIN_ENDED` (4,096) ended invocations that
ended in the last `RETAIN_ENDED_SECONDS` (24 h, by wall clock), across
restarts (`machine/journal.py`: fsynced, replayed on start, a corrupt
journal stops start-up). This is that set decoded once, so listing it costs
no decoding: seeded from the replay at start, then fed each ending the
journal took. It keeps the same bounds, so it lists what `GET
/v1/invocations/{id}` answers for. An outcome this version cannot read is
listed as `failed`, reason `recorded_outcome_unreadable`, never dropped.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

from machine.journal import RETAIN_ENDED, RETAIN_ENDED_SECONDS, EndedRecord
from supervisor.remembered import recorded_status
from supervisor.wire import InvocationStatus

__all__ = ["History"]


class History:
    def __init__(
        self,
        records: Iterable[EndedRecord] = (),
        *,
        count: int = RETAIN_ENDED,
        seconds: float = RETAIN_ENDED_SECONDS,
    ) -> None:
        self._count = count
        self._seconds = seconds
        self._ended: OrderedDict[str, tuple[float, InvocationStatus]] = OrderedDict()
        for record in records:
            self.add(record)

    def add(self, record: EndedRecord, status: InvocationStatus | None = None) -> None:
        """Remember `record` (the journal took it), newest last; the oldest over the
        bound is forgotten, as the journal forgets it. `status`: its outcome, when the
        caller has it decoded already (it wrote it)."""
        self._ended.pop(record.invocation_id, None)
        self._ended[record.invocation_id] = (record.ended_at, status or recorded_status(record))
        while len(self._ended) > self._count:
            self._ended.popitem(last=False)

    def statuses(self) -> list[InvocationStatus]:
        """Those that ended inside the window (older ones are forgotten by the journal)."""
        horizon = time.time() - self._seconds
        return [status for ended_at, status in self._ended.values() if ended_at >= horizon]
