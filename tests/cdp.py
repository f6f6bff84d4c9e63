"""A headless Chromium driven over the DevTools protocol on a pipe (no port, no network).

Chromium reads commands on fd 3 and writes replies on fd 4, each a JSON
object ended by a NUL byte (`--remote-debugging-pipe`).

`Browser.launch(browser, profile)` starts one Chromium, with no trio run
needed: a module-scoped fixture can start it once for many trio tests.
`browser.tab()`, in a test's trio run, yields a `Page` in a new tab (with a
session storage of its own; `own_context=True` gives it cookies, storage and a
cache of its own as well, as a fresh profile has), and closes it after.
`page(browser, profile)` is both at once: a Chromium of its own for one test.

`Page.evaluate` runs an expression in the tab (awaiting a promise),
`wait_for` polls one until it is truthy, `viewport` sets the tab's size,
`click` and `press` send the mouse and keyboard input a person would,
`screenshot` saves what the tab shows as a PNG, and `html` is the document
as Chromium's `--dump-dom` prints it.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import pathlib
import select
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import trio

__all__ = ["Browser", "Page", "page"]

CALL_SECONDS = 20
QUIT_SECONDS = 10
# Headless, and nothing that reaches past loopback.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


class _Pipe:
    """This trio run's streams on the browser's pipe (copies of its fds, closed after)."""

    def __init__(self, to_chrome: int, from_chrome: int) -> None:
        self.send = trio.lowlevel.FdStream(os.dup(to_chrome))
        self.receive = trio.lowlevel.FdStream(os.dup(from_chrome))
        self.lock = trio.Lock()  # one command and its reply at a time
        self.tabs = 0

    async def aclose(self) -> None:
        await self.send.aclose()
        await self.receive.aclose()


class Browser:
    """One Chromium process and our ends of its DevTools pipe.

    What was read but not yet parsed stays here between trio runs, so a test
    cancelled halfway through a reply leaves the next test whole messages."""

    def __init__(self, process: subprocess.Popen[bytes], to_chrome: int, from_chrome: int) -> None:
        self.process = process
        self._to_chrome, self._from_chrome = to_chrome, from_chrome
        self._buffer = b""
        self._next_id = 0
        self._pipe: _Pipe | None = None
        self._pipe_run: object = None

    @classmethod
    def launch(cls, browser: str, profile: pathlib.Path) -> Browser:
        to_chrome_r, to_chrome_w = (_high(fd) for fd in os.pipe())
        from_chrome_r, from_chrome_w = (_high(fd) for fd in os.pipe())
        argv = [
            sys.executable,
            "-c",
            _EXEC,
            str(to_chrome_r),
            str(from_chrome_w),
            browser,
            *FLAGS,
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            "about:blank",
        ]
        try:
            process = subprocess.Popen(
                argv,
                pass_fds=(to_chrome_r, from_chrome_w),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except BaseException:
            os.close(to_chrome_w)
            os.close(from_chrome_r)
            raise
        finally:
            os.close(to_chrome_r)
            os.close(from_chrome_w)
        return cls(process, to_chrome_w, from_chrome_r)

    def wait_ready(self, seconds: float = CALL_SECONDS) -> None:
        """Block until the browser answers on its pipe (it has started). Outside any trio
        run: a fixture can start Chromium before the test starts anything else."""
        self._next_id += 1
        sent = self._next_id
        command = {"id": sent, "method": "Browser.getVersion", "params": {}}
        os.write(self._to_chrome, json.dumps(command).encode() + b"\0")
        deadline = time.monotonic() + seconds
        while True:
            while b"\0" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._from_chrome], [], [], left)[0]:
                    raise TimeoutError(f"chromium did not answer in {seconds} s")
                chunk = os.read(self._from_chrome, 1 << 16)
                if not chunk:
                    raise EOFError("chromium closed its DevTools pipe")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            if json.loads(raw).get("id") == sent:
                return

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        """Ask the browser to quit, so it takes its helper processes along; then make sure.
        Blocking: for a fixture's teardown, outside any trio run."""
        if self.alive:
            self._next_id += 1
            command = {"id": self._next_id, "method": "Browser.close", "params": {}}
            with contextlib.suppress(OSError):
                os.write(self._to_chrome, json.dumps(command).encode() + b"\0")
        os.close(self._to_chrome)  # and the pipe's end: Chromium quits on it too
        os.close(self._from_chrome)
        try:
            self.process.wait(QUIT_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    async def aclose(self) -> None:
        """`close`, from within a trio run."""
        await self.detach()
        await trio.to_thread.run_sync(self.close)

    def _streams(self) -> _Pipe:
        run = trio.lowlevel.current_root_task()
        if self._pipe is None or self._pipe_run is not run:
            self._pipe, self._pipe_run = _Pipe(self._to_chrome, self._from_chrome), run
        return self._pipe

    async def detach(self) -> None:
        """Close this trio run's streams on the pipe (the pipe itself stays open)."""
        pipe, self._pipe, self._pipe_run = self._pipe, None, None
        if pipe is not None:
            await pipe.aclose()

    async def _message(self, pipe: _Pipe) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = await pipe.receive.receive_some(1 << 16)
            if not chunk:
                raise EOFError("chromium closed its DevTools pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message

    async def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        pipe = self._streams()
        async with pipe.lock:
            self._next_id += 1
            sent = self._next_id
            command: dict[str, Any] = {"id": sent, "method": method, "params": params}
            if session is not None:
                command["sessionId"] = session
            with trio.fail_after(CALL_SECONDS):
                await pipe.send.send_all(json.dumps(command).encode() + b"\0")
                while True:  # events and other (late) replies are not needed: skipped
                    message = await self._message(pipe)
                    if message.get("id") == sent:
                        break
        if "error" in message:
            raise RuntimeError(f"{method}: {message['error']}")
        result: dict[str, Any] = message.get("result", {})
        return result

    @contextlib.asynccontextmanager
    async def tab(self, own_context: bool = False) -> AsyncIterator[Page]:
        """A new tab, closed after. It starts with a session storage of its own, and no
        history; with `own_context` also with cookies, local storage and a cache of its
        own, as in a fresh profile (which costs a new renderer: some 0.3 s more)."""
        if not self.alive:
            raise RuntimeError(f"chromium exited ({self.process.returncode})")
        pipe = self._streams()
        pipe.tabs += 1
        try:
            where: dict[str, str] = {}
            if own_context:
                created = await self.call("Target.createBrowserContext")
                where["browserContextId"] = created["browserContextId"]
            target: str | None = None
            try:
                target = (await self.call("Target.createTarget", url="about:blank", **where))[
                    "targetId"
                ]
                attached = await self.call("Target.attachToTarget", targetId=target, flatten=True)
                tab = Page(self, attached["sessionId"])
                await tab.call("Runtime.enable")
                yield tab
            finally:
                with trio.move_on_after(5, shield=True), contextlib.suppress(Exception):
                    if own_context:  # its tabs go with it
                        await self.call("Target.disposeBrowserContext", **where)
                    elif target is not None:
                        await self.call("Target.closeTarget", targetId=target)
        finally:
            pipe.tabs -= 1
            if pipe.tabs == 0 and self._pipe is pipe:
                with trio.CancelScope(shield=True):
                    await self.detach()  # this trio run's copies of the pipe's fds


class Page:
    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        return await self.browser.call(method, self.session, **params)

    async def evaluate(self, expression: str) -> Any:
        reply = await self.call(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def html(self) -> str:
        """The document's markup now (what `--dump-dom` prints once the page settles)."""
        markup: str = await self.evaluate("document.documentElement.outerHTML")
        return markup

    async def viewport(self, width: int, height: int) -> None:
        """Lay the page out in a `width` x `height` CSS-pixel window, at one device pixel each."""
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    async def click(self, x: float, y: float) -> None:
        """A left click at (`x`, `y`), in CSS pixels from the viewport's top left."""
        for kind in ("mousePressed", "mouseReleased"):
            await self.call(
                "Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1
            )

    async def press(self, key: str, code: int) -> None:
        """Press and release `key` (a DOM key name such as "Escape"; `code`, its key code)."""
        for kind in ("keyDown", "keyUp"):
            await self.call(
                "Input.dispatchKeyEvent",
                type=kind,
                key=key,
                code=key,
                windowsVirtualKeyCode=code,
            )

    async def screenshot(self, path: pathlib.Path) -> pathlib.Path:
        """Save the visible part of the page at `path` (PNG); return `path`."""
        shot = await self.call("Page.captureScreenshot", format="png")
        await trio.Path(path.parent).mkdir(parents=True, exist_ok=True)
        await trio.Path(path).write_bytes(base64.b64decode(shot["data"]))
        return path

    async def wait_for(self, expression: str, seconds: float = 15) -> Any:
        """Poll `expression` in the page until it is truthy; return its value."""
        with trio.fail_after(seconds):
            while True:
                with contextlib.suppress(RuntimeError):  # the page may be navigating
                    value = await self.evaluate(expression)
                    if value:
                        return value
                await trio.sleep(0.05)


# Puts the pipe ends on fds 3 and 4, then becomes Chromium (sh allows only fds 0-9).
_EXEC = (
    "import os, sys; r, w = int(sys.argv[1]), int(sys.argv[2]);"
    " os.dup2(r, 3); os.dup2(w, 4); os.close(r); os.close(w);"
    " os.execv(sys.argv[3], sys.argv[3:])"
)


def _high(fd: int) -> int:
    """A copy of `fd` at 10 or above, so putting the pipes on 3 and 4 clobbers neither."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return high


@contextlib.asynccontextmanager
async def page(browser: str, profile: pathlib.Path) -> AsyncIterator[Page]:
    """A Chromium of its own and a tab in it, for one test."""
    chrome = Browser.launch(browser, profile)
    try:
        async with chrome.tab() as tab:
            yield tab
    finally:
        with trio.CancelScope(shield=True):
            await chrome.aclose()
