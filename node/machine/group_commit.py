"""Group commit: appends that arrive while an fsync is in flight share the next one.

Each `commit(record)` queues its frame and waits until the batch holding it is
written and fsynced (`Journal.append_framed`, one write, one fsync, run by the
machine's journal runner: a worker thread, one write at a time, a deadline).
Only then does it return, so the durability promise of a single append holds
for every record: the caller learns "durable" or gets the error.
A failed batch is cut back by the journal as a whole, and every waiter of that
batch gets the error.

One flusher runs at a time, as a trio system task started by the first record
that finds none running; it drains the queue batch by batch and then ends. A
batch holds at most `max_records` records and `max_bytes` bytes (one record is
always taken, whatever its size); at most `max_pending` records wait, beyond
that `commit` refuses at once with `JournalBacklog` (the disk is not keeping up).
A record whose caller gave up (cancelled or timed out) before its batch was
taken is not written.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import trio

from node.machine.journal import Journal, JournalError, Record, frame

__all__ = [
    "MAX_BATCH_BYTES",
    "MAX_BATCH_RECORDS",
    "MAX_PENDING",
    "GroupCommit",
    "JournalBacklog",
]

log = logging.getLogger(__name__)

MAX_BATCH_RECORDS = 256
MAX_BATCH_BYTES = 1 << 20
MAX_PENDING = 4096


class JournalBacklog(JournalError):
    """Too many records already wait for the disk."""


def _again(error: BaseException) -> BaseException:
    """A copy of a batch's error for one waiter (one exception object raised in many
    tasks would pile up their tracebacks); same type, so callers catch it as before."""
    try:
        return type(error)(*error.args)
    except Exception:
        return JournalError(str(error))


class _Pending:
    __slots__ = ("abandoned", "done", "error", "framed", "record")

    def __init__(self, record: Record) -> None:
        self.record = record
        self.framed = frame(record)
        self.done = trio.Event()
        self.error: BaseException | None = None
        self.abandoned = False


class GroupCommit:
    def __init__(
        self,
        journal: Journal,
        *,
        run: Callable[[Callable[[], None]], Awaitable[None]],
        timeout: float,
        max_records: int = MAX_BATCH_RECORDS,
        max_bytes: int = MAX_BATCH_BYTES,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self._journal = journal
        # Runs a journal write: in a worker thread, one at a time, under a deadline.
        self._run = run
        self._timeout = timeout
        self._max_records = max_records
        self._max_bytes = max_bytes
        self._max_pending = max_pending
        self._queue: deque[_Pending] = deque()
        self._flushing = False
        self.batches = 0  # fsynced batches, and the records they held (for the bench)
        self.records = 0

    async def commit(self, record: Record) -> None:
        """Return once `record` is durable; raise the batch's error, JournalBacklog, or
        trio.TooSlowError after the deadline (the record may still land later)."""
        if len(self._queue) >= self._max_pending:
            raise JournalBacklog(f"{len(self._queue)} journal records already wait for the disk")
        pending = _Pending(record)
        self._queue.append(pending)
        if not self._flushing:
            self._flushing = True
            trio.lowlevel.spawn_system_task(self._flush, name="journal group commit")
        try:
            with trio.fail_after(self._timeout):
                await pending.done.wait()
        except BaseException:
            pending.abandoned = True
            raise
        if pending.error is not None:
            raise _again(pending.error) from pending.error

    def _take(self) -> list[_Pending]:
        batch: list[_Pending] = []
        size = 0
        while self._queue and len(batch) < self._max_records:
            head = self._queue[0]
            if head.abandoned:
                self._queue.popleft()
                head.done.set()
                continue
            if batch and size + len(head.framed) > self._max_bytes:
                break
            batch.append(self._queue.popleft())
            size += len(head.framed)
        return batch

    async def _flush(self) -> None:
        batch: list[_Pending] = []
        try:
            # One scheduling tick first: tasks made runnable alongside this one (the two
            # records of one invocation's cleanup, the items of a batch) join the batch.
            await trio.lowlevel.checkpoint()
            while batch := self._take():
                await self._write(batch)
                batch = []
        finally:
            # Only a cancelled run (the trio run ending) gets here with records left.
            self._flushing = False
            for pending in (*batch, *self._queue):
                if not pending.done.is_set():
                    pending.error = JournalError("journal writer stopped")
                    pending.done.set()
            self._queue.clear()

    async def _write(self, batch: Sequence[_Pending]) -> None:
        items = [(p.record, p.framed) for p in batch]
        error: BaseException | None = None
        try:
            await self._run(functools.partial(self._journal.append_framed, items))
        except (OSError, JournalError, trio.TooSlowError) as exc:
            error = exc
        except Exception as exc:  # a system task must not raise: hand it to the waiters
            log.exception("journal group commit failed")
            error = JournalError(f"journal write failed: {exc!r}")
        else:
            self.batches += 1
            self.records += len(batch)
        for pending in batch:
            pending.error = error
            pending.done.set()
