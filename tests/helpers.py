"""Helpers shared by tests: running the installed command as a subprocess."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent


def node_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "node", *args]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LITEGRAPH_NODE_")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def wait_for_line(proc: subprocess.Popen[str], pattern: str, timeout: float = 20.0) -> str:
    """Read the child's stderr until a line matches; returns the first group."""
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match.group(1)
    proc.kill()
    raise AssertionError(f"no line matching {pattern!r}; got:\n{''.join(seen)}")


@contextlib.contextmanager
def spawned(argv: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """A child with piped stderr; killed and reaped however the test ends."""
    with subprocess.Popen(
        argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    ) as proc:
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


def stop(proc: subprocess.Popen[str], signum: int, timeout: float = 20.0) -> int:
    proc.send_signal(signum)
    return proc.wait(timeout=timeout)
