"""One in-process daemon for a whole test module, for tests that need no fresh node.

A daemon costs about a second to start and stop (its lane hosts are processes), and
a test of one refusal takes milliseconds: a module of such tests shares one. pytest-trio
runs each test in a trio run of its own, so the shared daemon runs in a trio run on a
thread of its own, started by a module-scoped fixture; each test talks to it over HTTP
from its own run, and reads the daemon's internals (ledger, journal, tokens, lane
memory) on the daemon's own event loop, never racing it.

Each test gets a `SharedNode` through `SharedDaemon.node()`. On the way out that
cancels every invocation the test left live, resumes every lane it drained, and then
checks the node is back to where the module started it: the capacity, no live tokens,
no lane memory held, ledger and journal empty. A test that leaks state into the next
one fails there, naming itself. Ids are remembered across the module (a resubmitted id
answers its first outcome), so each test uses ids of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import queue
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import httpx
import trio

from tests.adversarial.fixtures import Node, NodeState
from tests.api_fixtures import RunningDaemon, running_daemon

__all__ = ["SharedDaemon", "SharedNode", "shared_daemon", "until"]

T = TypeVar("T")
CALL_SECONDS = 10.0
THREAD_SECONDS = 60.0
SETTLE_SECONDS = 10.0


@dataclasses.dataclass
class SharedNode(Node):
    """A `Node` whose reads of the daemon's internals run on the daemon's thread."""

    shared: SharedDaemon | None = None

    def inside(self, fn: Callable[[], T]) -> T:
        """`fn()` on the daemon's own thread: how a test reads (or sets) its internals."""
        assert self.shared is not None
        return self.shared.call(fn)

    def live_tokens(self) -> int:
        return self.inside(super().live_tokens)

    def lane_bytes(self) -> dict[str, int]:
        return self.inside(super().lane_bytes)

    def ledger_reservations(self) -> set[str]:
        return self.inside(super().ledger_reservations)

    def journal_reservations(self) -> set[str]:
        return self.inside(super().journal_reservations)


class SharedDaemon:
    """A daemon running on its own thread; `node()` is one test's view of it."""

    def __init__(self, running: RunningDaemon, token: trio.lowlevel.TrioToken) -> None:
        self.running = running
        self.url = running.url
        self.token = token
        self.baseline: NodeState | None = None
        # httpx loads the CA bundle for each client (a tenth of a second): once here.
        self._tls = ssl.create_default_context()

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()` on the daemon's event loop, from any thread (this one blocks until it
        has run: a few microseconds of the daemon's time)."""
        answer: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)

        def job() -> None:
            try:
                answer.put((True, fn()))
            except BaseException as exc:  # handed to the caller, not lost in the daemon
                answer.put((False, exc))

        self.token.run_sync_soon(job)
        ok, value = answer.get(timeout=CALL_SECONDS)
        if not ok:
            raise value
        result: T = value
        return result

    @contextlib.asynccontextmanager
    async def node(
        self, *, client_timeout: float = 10.0, limits: httpx.Limits | None = None
    ) -> AsyncIterator[SharedNode]:
        """One test's node: an HTTP client in the caller's trio run. On the way out,
        what the test left live is ended and the node must be back at its baseline."""
        running = self.running
        async with httpx.AsyncClient(
            base_url=running.url,
            timeout=client_timeout,
            limits=limits or httpx.Limits(),
            verify=self._tls,
        ) as client:
            node = SharedNode(
                running.url, running.scheduler, running.admin, running.daemon, client, self
            )
            if self.baseline is None:
                self.baseline = await node.state()
            try:
                yield node
            except BaseException:
                # The test failed: tidy up for the next one, and report the failure.
                with (
                    trio.move_on_after(SETTLE_SECONDS, shield=True),
                    contextlib.suppress(Exception),
                ):
                    await self._restore(node, check=False)
                raise
            await self._restore(node)

    async def _restore(self, node: SharedNode, *, check: bool = True) -> None:
        assert self.baseline is not None
        listing = await node.client.get("/v1/invocations", params={"limit": 500}, headers=node.op)
        assert listing.status_code == 200, listing.text
        for status in listing.json()["invocations"]:
            if status["state"] in ("queued", "running"):
                ended = await node.client.delete(f"/v1/invocations/{status['id']}", headers=node.op)
                assert ended.status_code == 200, ended.text
        for lane in (await node.snapshot())["lanes"]:
            if lane["drained"]:
                resumed = await node.client.post(
                    f"/v1/lanes/{lane['lane_id']}/resume", headers=node.adm
                )
                assert resumed.status_code == 200, resumed.text
        if not check:
            return
        after = await node.state()
        # A cancel answers once what it held is released: nothing is left to wait for.
        baseline = dataclasses.replace(self.baseline, invocations=after.invocations)
        assert after == baseline, "the test left the shared daemon changed"


@contextlib.contextmanager
def shared_daemon(
    tmp_path: pathlib.Path, *argv: str, devices: str = "sim", pynvml_module: Any = None
) -> Iterator[SharedDaemon]:
    """`running_daemon(tmp_path, *argv)` on a thread of its own, until the block ends."""
    started: queue.Queue[SharedDaemon | BaseException] = queue.Queue(maxsize=1)
    failure: list[BaseException] = []
    stop: list[trio.Event] = []

    async def main() -> None:
        stop.append(trio.Event())
        async with running_daemon(
            tmp_path, *argv, devices=devices, pynvml_module=pynvml_module
        ) as running:
            started.put(SharedDaemon(running, trio.lowlevel.current_trio_token()))
            await stop[0].wait()

    def serve() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # re-raised by the test thread, not a stray warning
            failure.append(exc)
            if started.empty():
                started.put(exc)

    thread = threading.Thread(target=serve, name="shared-daemon", daemon=True)
    thread.start()
    item = started.get(timeout=THREAD_SECONDS)
    if isinstance(item, BaseException):
        thread.join(THREAD_SECONDS)
        raise item
    try:
        yield item
    finally:
        with contextlib.suppress(trio.RunFinishedError):
            item.token.run_sync_soon(stop[0].set)
        thread.join(THREAD_SECONDS)
        assert not thread.is_alive(), "the shared daemon did not stop"
        if failure:
            raise failure[0]


async def until(check: Callable[[], object], what: str, seconds: float = 10.0) -> None:
    """Wait for `check()` to be true, looking every few milliseconds; fail after `seconds`."""
    with trio.move_on_after(seconds):
        while True:
            if check():
                return
            await trio.sleep(0.005)
    raise AssertionError(f"not {what} after {seconds} s")
