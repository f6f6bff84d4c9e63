"""Group commit: appends that arrive while an fsync is in flight share the next one.

Each `commit(record)` queues its frame and waits until the batch holding it is
written and fsynced (`Journal.append_framed`, one write, one fsync, run by the
machine's journal runner: the journal's writer thread, one write at a time, a deadline).
Only then does it return, so the durability promise of a single append holds
for every record: the caller learns "durable" or gets the error.
A failed batch is cut back by the journal as a whole, and every waiter of that
batch gets the error.

One flusher runs at a time, as a trio system task started by the first record
that finds none running; it drains the queue batch by batch and then ends. A
batch holds at most `max_records` records and `max_bytes` bytes (one commit's
records are always taken together, whatever their size); at most `max_pending`
records wait, beyond that `commit` refuses at once with `JournalBacklog` (the
disk is not keeping up). A record whose caller gave up (cancelled, or its
deadline passed) before its batch was taken is not written.

Waiting costs no cancel scope and no event per record: the waiter parks its
task, the flusher reschedules it, and the deadline is the flusher's (see
`commit`). This is the hot path of every invocation (three records each).
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import trio

from machine.journal import Journal, JournalError, Record, frame

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
    """Records that go to the disk together (one write), and the task waiting for them."""

    __slots__ = ("abandoned", "deadline", "error", "items", "size", "task")

    def __init__(self, records: Sequence[Record], deadline: float) -> None:
        items: list[tuple[Record, bytes]] = []
        size = 0
        for record in records:
            framed = frame(record)
            items.append((record, framed))
            size += len(framed)
        self.items = items
        self.size = size
        self.deadline = deadline
        self.task: trio.lowlevel.Task | None = None  # None once woken (or never waiting)
        self.error: BaseException | None = None
        self.abandoned = False

    def wake(self, error: BaseException | None = None) -> None:
        self.error = error
        task, self.task = self.task, None
        if task is not None:
            trio.lowlevel.reschedule(task)


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
        self._queued = 0  # records in the queue
        self._flushing = False
        self.batches = 0  # fsynced batches, and the records they held (for the bench)
        self.records = 0

    async def commit(self, *records: Record, shield: bool = False) -> None:
        """Return once `records` are durable, all written in one batch; raise the
        batch's error, JournalBacklog, or trio.TooSlowError once the deadline
        (`timeout` from now) has passed (a record already being written may still land).

        `shield`: a cancel does not interrupt the wait (cleanup that must be recorded);
        the deadline still bounds it. Otherwise a cancel abandons the records: if
        their batch was not taken yet, they are not written.

        The deadline is enforced by the flusher, not by a cancel scope per caller: a
        batch's write is bounded by the earliest deadline in it, and a record whose
        deadline passed while it waited is failed without being written.
        """
        if self._queued + len(records) > self._max_pending:
            raise JournalBacklog(f"{self._queued} journal records already wait for the disk")
        pending = _Pending(records, trio.current_time() + self._timeout)
        pending.task = trio.lowlevel.current_task()
        self._queue.append(pending)
        self._queued += len(records)
        if not self._flushing:
            self._flushing = True
            trio.lowlevel.spawn_system_task(self._flush, name="journal group commit")

        def abort(_: object) -> trio.lowlevel.Abort:
            if shield:
                return trio.lowlevel.Abort.FAILED
            pending.abandoned = True
            pending.task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        if pending.error is not None:
            raise _again(pending.error) from pending.error

    def _take(self) -> list[_Pending]:
        batch: list[_Pending] = []
        records = size = 0
        now = trio.current_time()
        while self._queue and records < self._max_records:
            head = self._queue[0]
            if head.abandoned or head.deadline <= now:
                self._queue.popleft()
                self._queued -= len(head.items)
                if not head.abandoned:
                    head.wake(trio.TooSlowError("the journal did not take the record in time"))
                continue
            if batch and (
                size + head.size > self._max_bytes or records + len(head.items) > self._max_records
            ):
                break
            batch.append(self._queue.popleft())
            self._queued -= len(head.items)
            records += len(head.items)
            size += head.size
        return batch

    async def _flush(self) -> None:
        batch: list[_Pending] = []
        try:
            # One scheduling tick first: tasks made runnable alongside this one (the
            # items of a batch, many invocations ending at once) join the batch.
            await trio.lowlevel.checkpoint()
            while batch := self._take():
                await self._write(batch)
                batch = []
        finally:
            # Only a cancelled run (the trio run ending) gets here with records left.
            self._flushing = False
            for pending in (*batch, *self._queue):
                pending.wake(JournalError("journal writer stopped"))
            self._queue.clear()
            self._queued = 0

    async def _write(self, batch: Sequence[_Pending]) -> None:
        items = [item for p in batch for item in p.items]
        error: BaseException | None = None
        try:
            # The earliest deadline of the batch bounds its write: every record in it
            # is answered by its own deadline.
            with trio.fail_at(min(p.deadline for p in batch)):
                await self._run(functools.partial(self._journal.append_framed, items))
        except (OSError, JournalError, trio.TooSlowError) as exc:
            error = exc
        except Exception as exc:  # a system task must not raise: hand it to the waiters
            log.exception("journal group commit failed")
            error = JournalError(f"journal write failed: {exc!r}")
        else:
            self.batches += 1
            self.records += len(items)
        for pending in batch:
            pending.wake(error)
