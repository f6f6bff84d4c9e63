"""A kept thread: one long-lived thread that runs blocking jobs, one at a time.

Blocking work (a journal write and its fsync, a fork, cgroupfs calls) runs off
the event loop. A thread kept for it answers faster than a worker thread taken
per call (`trio.to_thread`: a limiter, a thread cache and a context copy each
time): the hand-off is a condition variable, the answer one
`TrioToken.run_sync_soon` that reschedules the waiting task. The journal's
writes are the hot path of every durable step (a grant, a release before DELETE
answers); guests' forks and cgroups come dozens at once.

`run(fn)` behaves as `trio.to_thread.run_sync(fn, abandon_on_cancel=True)`
under a limiter of one: jobs run in the order they were asked for, one at a
time; a caller that is cancelled (its deadline passed) gets `Cancelled` at
once. Its job, if it had not started, is taken out of the queue and never
runs; if it had, it runs to its end (it cannot be interrupted), its result is
dropped, and the jobs behind it wait for it. So the queue holds only jobs whose
callers still wait: it is bounded by them.

`run(fn, shield=True)` waits for the job whatever happens to the caller: what
the job made (a forked child, a cgroup) is always handed back, and a cancel
is raised at the caller's next checkpoint.

With `idle_exit` the thread ends after that many seconds with nothing to do
and starts again with the next job; with None it lives as long as the process
(a child forked with a parent-death signal dies when the thread that forked it
ends). It is a daemon thread, like trio's workers.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import trio

__all__ = ["IDLE_EXIT", "KeptThread"]

T = TypeVar("T")

# How long an idle thread waits for the next job before it ends (by default).
IDLE_EXIT = 10.0


class _Job(Generic[T]):
    __slots__ = ("abandoned", "error", "fn", "result", "started", "task", "token")

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.task = trio.lowlevel.current_task()
        self.token = trio.lowlevel.current_trio_token()
        self.started = False  # taken by the thread (under the lock)
        self.abandoned = False  # its caller stopped waiting (set in the trio thread)
        self.result: T | None = None
        self.error: BaseException | None = None


class KeptThread:
    def __init__(self, name: str, *, idle_exit: float | None = IDLE_EXIT) -> None:
        self._idle_exit = idle_exit
        self._name = name
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._jobs: deque[_Job[Any]] = deque()
        self._running = False  # the thread is alive (under the lock)
        self.threads_started = 0  # how often the thread was (re)started

    @property
    def queued(self) -> int:
        """Jobs waiting for the thread (not the one it runs)."""
        return len(self._jobs)

    async def run(self, fn: Callable[[], T], *, shield: bool = False) -> T:
        """Run `fn` in the thread after the jobs asked for before it; return its result
        or raise its exception. Cancellable unless `shield` (see the module's docstring)."""
        job = _Job(fn)
        with self._lock:
            self._jobs.append(job)
            if self._running:
                self._ready.notify()
            else:
                self._running = True
                self.threads_started += 1
                threading.Thread(target=self._work, name=self._name, daemon=True).start()

        def abort(_: object) -> trio.lowlevel.Abort:
            if shield:
                return trio.lowlevel.Abort.FAILED
            job.abandoned = True
            with self._lock:
                if not job.started:
                    self._jobs.remove(job)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        if job.error is not None:
            error, job.error = job.error, None  # no cycle through the traceback
            raise error
        return job.result  # type: ignore[return-value]

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._jobs:
                    if not self._ready.wait(self._idle_exit) and not self._jobs:
                        self._running = False
                        return
                job = self._jobs.popleft()
                job.started = True
            try:
                job.result = job.fn()
            except BaseException as exc:  # handed to the caller, who raises it
                job.error = exc
            try:
                job.token.run_sync_soon(_deliver, job)
            except trio.RunFinishedError:
                pass  # the run that asked is gone: nobody waits for the answer


def _deliver(job: _Job[Any]) -> None:
    """In the trio thread: wake the caller, unless it stopped waiting meanwhile."""
    if not job.abandoned:
        trio.lowlevel.reschedule(job.task)
