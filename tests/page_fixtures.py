"""What the status-page tests share across a module: one Chromium and one daemon.

pytest-trio runs each test in a trio run of its own, so nothing async outlives
a test. Both are therefore started without one: `Chromiums` holds a Chromium
process (`tests/cdp.py` talks to it from each test's run, a fresh browser
context a tab), and `daemon_in_a_thread` runs `running_daemon` in a trio run
on a thread of its own, for tests that only reach it over HTTP.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import queue
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from tests import cdp
from tests.api_fixtures import START_SECONDS, STOP_SECONDS, RunningDaemon, running_daemon

__all__ = ["Chromiums", "chromium", "daemon_in_a_thread"]

CHROMIUM = "/usr/bin/chromium"


def chromium() -> str:
    """Chromium's path; a skip where it is not installed (a failure under CI)."""
    found = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is required under CI (apt-get install chromium)")
        pytest.skip("chromium is not installed")
    return found


class Chromiums:
    """One Chromium for many tests: started on first use, and started again when the
    last one died (so a test that crashed it fails alone)."""

    def __init__(self, profiles: pathlib.Path) -> None:
        self._profiles = profiles
        self._browser: cdp.Browser | None = None
        self._started = 0

    def get(self) -> cdp.Browser:
        if self._browser is None or not self._browser.alive:
            self.close()
            self._started += 1
            profile = self._profiles / f"profile-{self._started}"
            self._browser = cdp.Browser.launch(chromium(), profile)
            try:  # up before the test starts its daemon: the two do not start side by side
                self._browser.wait_ready()
            except BaseException:
                self.close()
                raise
        return self._browser

    def close(self) -> None:
        browser, self._browser = self._browser, None
        if browser is not None:
            browser.close()


@contextlib.contextmanager
def daemon_in_a_thread(
    tmp_path: pathlib.Path, *argv: str, **options: Any
) -> Iterator[RunningDaemon]:
    """`running_daemon(tmp_path, *argv, **options)`, served from a thread of its own until
    the block ends; what it raised is raised here."""
    started: queue.Queue[tuple[RunningDaemon, trio.lowlevel.TrioToken, trio.Event] | None]
    started = queue.Queue()
    failed: list[BaseException] = []

    async def serve() -> None:
        async with running_daemon(tmp_path, *argv, **options) as node:
            done = trio.Event()
            started.put((node, trio.lowlevel.current_trio_token(), done))
            await done.wait()

    def run() -> None:
        try:
            trio.run(serve)
        except BaseException as error:  # handed to the test's thread, which raises it
            failed.append(error)
        finally:
            started.put(None)  # if it never got as far as starting

    thread = threading.Thread(target=run, name=f"daemon {tmp_path.name}")
    thread.start()
    stop: tuple[trio.lowlevel.TrioToken, trio.Event] | None = None
    try:
        got = started.get(timeout=START_SECONDS + 10)
        if got is None:
            raise RuntimeError("the daemon did not start") from (failed[0] if failed else None)
        node, token, done = got
        stop = (token, done)
        yield node
    finally:
        if stop is not None:
            with contextlib.suppress(trio.RunFinishedError):  # it stopped on its own
                trio.from_thread.run_sync(stop[1].set, trio_token=stop[0])
        thread.join(STOP_SECONDS + 10)
    assert not thread.is_alive(), "the daemon did not stop"
    if failed:
        raise RuntimeError("the daemon failed") from failed[0]
