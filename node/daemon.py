"""The composition root: builds every component from the Config and runs them
in one trio nursery until a signal or an explicit stop asks for shutdown."""

from __future__ import annotations

import logging
import signal
import threading

import trio

from api.app import create_app
from api.server import serve_http
from node.config import Config
from node.readiness import Readiness
from node.sdnotify import notify

__all__ = ["Daemon"]

log = logging.getLogger(__name__)
# Hypercorn's graceful window plus margin: past it everything is cancelled.
SHUTDOWN_DEADLINE = 15.0


class Daemon:
    """One node daemon. `await nursery.start(daemon.run)` returns the bound URL."""

    def __init__(self, config: Config, *, handle_signals: bool = True) -> None:
        self.config = config
        self.stop = trio.Event()
        self.readiness = Readiness(("http",))
        self.url = ""
        self._handle_signals = handle_signals

    async def _watch_signals(self, task_status: trio.TaskStatus[None]) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                if self.stop.is_set():
                    log.warning("second %s: stopping now", signal.Signals(signum).name)
                    raise KeyboardInterrupt
                log.info("%s: shutting down gracefully", signal.Signals(signum).name)
                self.stop.set()

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        app = create_app(self.readiness)
        async with trio.open_nursery() as outer:
            if self._handle_signals and threading.current_thread() is threading.main_thread():
                await outer.start(self._watch_signals)
            async with trio.open_nursery() as components:
                addresses = await components.start(serve_http, app, self.config.listen, self.stop)
                self.url = addresses[0]
                self.readiness.done("http")
                log.info("listening on %s", self.url)
                notify("READY=1")
                task_status.started(self.url)
                await self.stop.wait()
                notify("STOPPING=1")
                # Components stop by `stop`; past this deadline they are cancelled.
                components.cancel_scope.deadline = trio.current_time() + SHUTDOWN_DEADLINE
            outer.cancel_scope.cancel()  # the signal watcher never ends by itself
        log.info("stopped")
