"""SIGINT and SIGTERM: the first asks for a graceful stop, the second stops at once.

A stop forced by a second signal ends the process with 128 + the signal's
number, as shells report a death by signal: 130 after a second SIGINT
(Ctrl-C), 143 after a second SIGTERM. A third signal changes nothing.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import TypeVar

import trio

__all__ = ["ForcedStop", "SignalWatcher", "sole_error"]

log = logging.getLogger(__name__)
_E = TypeVar("_E", bound=BaseException)


class ForcedStop(Exception):
    """A second SIGINT or SIGTERM stopped the daemon without waiting for running work."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_status = 128 + signum
        super().__init__(
            f"second {signal.Signals(signum).name}: stopped at once without waiting for"
            f" running work (exit status {self.exit_status})"
        )


class SignalWatcher:
    """Sets `stop` on the first signal, saying what shutdown waits for (`plan()`);
    cancels `work` on the second and sets `forced`, which cuts guests' kill grace
    short (their endings run shielded). Run it in a nursery outside `work`."""

    def __init__(self, stop: trio.Event, plan: Callable[[], str]) -> None:
        self.stop = stop
        self.work = trio.CancelScope()
        self.forced = trio.Event()
        self.forced_by: int | None = None
        self._plan = plan

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                if not self.stop.is_set():
                    log.warning("%s: %s (Ctrl-C again to stop now)", name, self._plan())
                    self.stop.set()
                elif self.forced_by is None:
                    log.warning("second %s: stopping now", name)
                    self.forced_by = signum
                    self.forced.set()
                    self.work.cancel()

    def raise_if_forced(self) -> None:
        if self.forced_by is not None:
            raise ForcedStop(self.forced_by)


def sole_error(error: BaseException, kind: type[_E]) -> _E | None:
    """The `kind` exception when that is all `error` holds (nurseries wrap errors in groups)."""
    while isinstance(error, BaseExceptionGroup):
        found, rest = error.split(kind)
        if found is None or rest is not None:
            return None
        error = found.exceptions[0]
    return error if isinstance(error, kind) else None
