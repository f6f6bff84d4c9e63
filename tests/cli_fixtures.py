"""The `litegraph-node` command called in this process, and `dev` daemons to call it on.

A fresh interpreter costs most of a second before the command does anything, so tests
whose subject is what a command does and says call `node.cli.main` here, as the console
script does, with the environment, working folder, stdout and stderr a shell would give
it (`cli`). Exit statuses, signals and the wiring of real pipes stay with the tests that
start the command as a process (`tests.helpers.spawned`, `run_client`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from node.cli import main
from tests.helpers import guest_cwd, node_command, spawned, stop, wait_for_line

__all__ = [
    "DEV_LISTENING",
    "GUEST_WAITS",
    "Dev",
    "Ran",
    "Running",
    "admin_headers",
    "cli",
    "cli_in_thread",
    "headers",
    "started_dev",
    "until",
    "wait_ended",
]

DEV_LISTENING = r"dev: listening on (http://\S+)"
# A shell guest's last words: it waits, in its folder, until the test creates `go` there.
GUEST_WAITS = "while [ ! -e go ]; do sleep 0.02; done"


@dataclasses.dataclass(frozen=True)
class Ran:
    """How a command ended: its exit status and all it wrote, as a process's would be."""

    returncode: int
    out: bytes
    err: bytes

    @property
    def stdout(self) -> str:
        return self.out.decode()

    @property
    def stderr(self) -> str:
        return self.err.decode()


class _Sink(io.BytesIO):
    """What a command writes to one stream; a waiter learns of each write at once."""

    def __init__(self) -> None:
        super().__init__()
        self.wrote = threading.Condition()

    def write(self, data: Any) -> int:
        with self.wrote:
            written = super().write(data)
            self.wrote.notify_all()
        return written

    def wait_for(self, text: bytes, timeout: float) -> bytes:
        """All written so far, once it holds `text`; fails after `timeout` seconds."""
        with self.wrote:
            if not self.wrote.wait_for(lambda: text in self.getvalue(), timeout):
                raise AssertionError(f"never wrote {text!r}; wrote {self.getvalue()!r}")
            return self.getvalue()


@contextlib.contextmanager
def _as_a_shell_runs_it(env: dict[str, str], cwd: pathlib.Path) -> Iterator[tuple[_Sink, _Sink]]:
    """This process as the command's own would be: `env` as its whole environment, `cwd`
    its folder, stdout and stderr to sinks; the test's own restored afterwards, with the
    logging set-up a command may replace (`snapshot` configures its own)."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_streams = sys.stdout, sys.stderr
    root = logging.getLogger()
    saved_logging = root.handlers[:], root.level, logging.getLogger("hypercorn.access").level
    out, err = _Sink(), _Sink()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.stdout = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(err, encoding="utf-8", write_through=True)
    try:
        yield out, err
    finally:
        for wrapper in (sys.stdout, sys.stderr):
            wrapper.flush()
            wrapper.detach()  # the sinks stay open, to be read
        sys.stdout, sys.stderr = saved_streams
        root.handlers[:], level, access = saved_logging
        root.setLevel(level)
        logging.getLogger("hypercorn.access").setLevel(access)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


def cli(env: dict[str, str], *argv: str, cwd: pathlib.Path | None = None) -> Ran:
    """`litegraph-node ARGV...` to its end in this process, as a shell with `env` runs it
    in `cwd` (by default a fresh folder any guest may start in)."""
    with _as_a_shell_runs_it(env, cwd or guest_cwd()) as (out, err):
        code = main(list(argv))
    return Ran(code, out.getvalue(), err.getvalue())


class Running:
    """A command running in a thread of this process (`cli_in_thread`)."""

    def __init__(self, out: _Sink, err: _Sink, thread: threading.Thread) -> None:
        self._out, self._err, self._thread = out, err, thread
        self.code: int | None = None

    def wait_for_stdout(self, text: bytes, timeout: float = 20) -> bytes:
        """All it wrote to stdout so far, once that holds `text`."""
        return self._out.wait_for(text, timeout)

    def wait_for_stderr(self, text: bytes, timeout: float = 20) -> bytes:
        """All it wrote to stderr so far, once that holds `text`."""
        return self._err.wait_for(text, timeout)

    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout: float = 60) -> Ran:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the command did not end"
        assert self.code is not None, "the command raised (see the thread's exception)"
        return Ran(self.code, self._out.getvalue(), self._err.getvalue())


@contextlib.contextmanager
def cli_in_thread(env: dict[str, str], *argv: str) -> Iterator[Running]:
    """`cli`, started in a thread: the test watches what it writes while it runs. Until
    the block ends this process's environment, folder and streams are the command's."""
    with _as_a_shell_runs_it(env, guest_cwd()) as (out, err):
        thread = threading.Thread(target=lambda: setattr(running, "code", main(list(argv))))
        running = Running(out, err, thread)
        thread.start()
        try:
            yield running
        finally:
            thread.join(60)


def until(check: Callable[[], bool], what: str, seconds: float = 20) -> None:
    """Wait until `check()` holds: asked every 50 ms, failing after `seconds`."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.05)


def headers(state: pathlib.Path, role: str = "scheduler") -> dict[str, str]:
    """The bearer header of the daemon with state in `state`, for `role`."""
    auth = json.loads((state / "auth.json").read_text())
    return {"Authorization": f"Bearer {auth[role]}"}


def admin_headers(state: pathlib.Path) -> dict[str, str]:
    return headers(state, "admin")


def wait_ended(url: str, state: pathlib.Path, *ids: str, seconds: float = 20) -> dict[str, str]:
    """The end state of each of `ids`, once all have ended (the node's long-poll)."""
    body = {"ids": list(ids), "timeout_s": seconds}
    reply = httpx.post(
        f"{url}/v1/invocations:wait", json=body, headers=headers(state), timeout=seconds + 10
    )
    assert reply.status_code == 200, reply.text
    waited = reply.json()
    assert waited["pending"] == [] and waited["unknown"] == [], waited
    return {status["id"]: status["state"] for status in waited["ended"]}


@dataclasses.dataclass(frozen=True)
class Dev:
    """A `dev` daemon started by `started_dev`."""

    url: str
    state: pathlib.Path
    env: dict[str, str]
    proc: subprocess.Popen[str]
    devices: str  # what its banner says after `devices:`
    hint: str  # ... and after `try:`

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=headers(self.state), timeout=30)

    def clean_up(self) -> None:
        """Back as started, for the next test that shares it: nothing queued or running,
        the node and every lane admitting work."""
        admin = admin_headers(self.state)
        with self.client() as client:
            listed = client.get(
                "/v1/invocations", params=[("state", "queued"), ("state", "running")]
            )
            assert listed.status_code == 200, listed.text
            for invocation in listed.json()["invocations"]:
                client.delete(f"/v1/invocations/{invocation['id']}")  # answers once released
            if client.get("/v1/node").json()["drained"]:
                assert client.post("/v1/node/resume", headers=admin).status_code == 200
            for lane in client.get("/v1/snapshot").json()["lanes"]:
                if lane["drained"]:
                    reply = client.post(f"/v1/lanes/{lane['lane_id']}/resume", headers=admin)
                    assert reply.status_code == 200, reply.text


@contextlib.contextmanager
def started_dev(
    env: dict[str, str], *argv: str, state: pathlib.Path | None = None
) -> Iterator[Dev]:
    """`dev ARGV...` on a free loopback port until the block ends, then stopped with
    Ctrl-C: it must exit 0. Its state folder is `state`, or without one dev's own under
    XDG_STATE_HOME."""
    state_dir = ("--state-dir", str(state)) if state else ()
    command = node_command("dev", "--listen", "127.0.0.1:0", *state_dir, *argv)
    with spawned(command, env) as proc:
        url = wait_for_line(proc, DEV_LISTENING)
        devices = wait_for_line(proc, r"  devices: +(.*)")
        hint = wait_for_line(proc, r"  try: +(.*)")
        if state is None:
            state = pathlib.Path(env["XDG_STATE_HOME"]) / "litegraph-node"
        yield Dev(url, state, env, proc, devices, hint)
        assert stop(proc, signal.SIGINT) == 0
