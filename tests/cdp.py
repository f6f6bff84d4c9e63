"""A headless Chromium driven over the DevTools protocol on a pipe (no port, no network).

Chromium reads commands on fd 3 and writes replies on fd 4, each a JSON
object ended by a NUL byte (`--remote-debugging-pipe`). `page()` yields a
`Page` attached to the browser's one tab; `evaluate` runs an expression in
it (awaiting a promise), `wait_for` polls one until it is truthy, `viewport`
sets the tab's size, `click` and `press` send the mouse and keyboard input a
person would, and `screenshot` saves what the tab shows as a PNG.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import trio

__all__ = ["Page", "page"]

CALL_SECONDS = 20
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


class Page:
    def __init__(self, send: trio.lowlevel.FdStream, receive: trio.lowlevel.FdStream) -> None:
        self._send, self._receive = send, receive
        self._buffer = b""
        self._next_id = 0
        self.session: str | None = None

    async def _message(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = await self._receive.receive_some(1 << 16)
            if not chunk:
                raise EOFError("chromium closed its DevTools pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        command: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if self.session is not None:
            command["sessionId"] = self.session
        with trio.fail_after(CALL_SECONDS):
            await self._send.send_all(json.dumps(command).encode() + b"\0")
            while True:  # events and other replies are not needed: skipped
                message = await self._message()
                if message.get("id") == self._next_id:
                    break
        if "error" in message:
            raise RuntimeError(f"{method}: {message['error']}")
        result: dict[str, Any] = message.get("result", {})
        return result

    async def evaluate(self, expression: str) -> Any:
        reply = await self.call(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

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
    process = await trio.lowlevel.open_process(
        argv,
        pass_fds=(to_chrome_r, from_chrome_w),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(to_chrome_r)
    os.close(from_chrome_w)
    send = trio.lowlevel.FdStream(to_chrome_w)
    receive = trio.lowlevel.FdStream(from_chrome_r)
    driver = Page(send, receive)
    try:
        with trio.fail_after(CALL_SECONDS):
            while True:
                targets = (await driver.call("Target.getTargets"))["targetInfos"]
                tabs = [t for t in targets if t["type"] == "page"]
                if tabs:
                    break
                await trio.sleep(0.05)
        attached = await driver.call(
            "Target.attachToTarget", targetId=tabs[0]["targetId"], flatten=True
        )
        driver.session = attached["sessionId"]
        await driver.call("Runtime.enable")
        yield driver
    finally:
        # Ask the browser to quit, so it takes its helper processes along; then make sure.
        with trio.move_on_after(5, shield=True):
            driver.session = None
            with contextlib.suppress(Exception):
                await driver.call("Browser.close")
            await process.wait()
        with trio.move_on_after(10, shield=True):
            process.kill()
            await process.wait()
            await send.aclose()
            await receive.aclose()
