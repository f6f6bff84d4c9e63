"""Helpers shared by tests: running the installed command as a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Guests run as other uids: their socket and token folders must be reachable from
# /tmp, never under pytest's 0700 tmp_path. One base per test run, removed at exit.
GUEST_BASE = pathlib.Path(tempfile.gettempdir()) / f"litegraph-tests-{os.getpid()}"
# Guests' working folders: no guest's cwd may lie in /tmp (its sandbox has its own).
GUEST_CWD_BASE = pathlib.Path("/var/tmp") / f"litegraph-tests-{os.getpid()}"
# The system's Python, which guests can run (the test venv may sit under /root).
GUEST_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or "python3"


# A daemon run by a normal user cannot give guests uids of their own or cgroups, so it
# refuses process work (and is not ready): the suite's daemons run guests unconfined
# then. What confinement itself does is tested as root; those tests skip otherwise.
UNCONFINED_UNLESS_ROOT: dict[str, str] = (
    {} if os.geteuid() == 0 else {"LITEGRAPH_NODE_ALLOW_UNCONFINED_GUESTS": "true"}
)


def guest_run_dir() -> str:
    """A fresh --guest-run-dir that guest uids can enter."""
    GUEST_BASE.mkdir(mode=0o711, exist_ok=True)
    GUEST_BASE.chmod(0o711)
    return tempfile.mkdtemp(prefix="run-", dir=GUEST_BASE)


def guest_cwd() -> pathlib.Path:
    """A folder any guest uid may enter and read, to run a guest in."""
    GUEST_CWD_BASE.mkdir(mode=0o755, exist_ok=True)
    GUEST_CWD_BASE.chmod(0o755)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="cwd-", dir=GUEST_CWD_BASE))
    folder.chmod(0o755)
    return folder


def guest_cwd_roots() -> str:
    """`--guest-cwd-roots` for a test daemon: where `guest_cwd` makes its folders."""
    return json.dumps([str(GUEST_CWD_BASE)])


def _hidden_by(path: pathlib.Path) -> pathlib.Path | None:
    """The topmost folder above `path` that other uids cannot enter (root's 0700 home)."""
    for folder in reversed(path.parents):
        if not folder.stat().st_mode & 0o001:
            return folder
    return None


def reveal_lines(fix: pathlib.Path, paths: Iterable[pathlib.Path]) -> list[str]:
    """Shell lines for a private mount namespace (`unshare --mount --propagation private`)
    that let other uids reach each of `paths` (the clone, the venv, its base Python)
    wherever a folder above it is closed to them: each is bound into a fresh 0755 tree
    under `fix` (itself reachable), which is laid over that folder. None where every
    path is reachable already."""
    trees: dict[pathlib.Path, pathlib.Path] = {}
    revealed: list[pathlib.Path] = []
    lines: list[str] = []
    for path in sorted({p.resolve() for p in paths}):
        hidden = _hidden_by(path)
        if hidden is None or any(path.is_relative_to(done) for done in revealed):
            continue
        tree = trees.setdefault(hidden, fix / f"tree-{len(trees)}")
        target = tree / path.relative_to(hidden)
        target.mkdir(parents=True)
        for folder in (target, *target.parents):
            if not folder.is_relative_to(tree):
                break
            folder.chmod(0o755)
        lines.append(f"mount --bind '{path}' '{target}'")
        revealed.append(path)
    return lines + [f"mount --rbind '{tree}' '{hidden}'" for hidden, tree in trees.items()]


def remove_guest_dirs() -> None:
    shutil.rmtree(GUEST_BASE, ignore_errors=True)
    shutil.rmtree(GUEST_CWD_BASE, ignore_errors=True)


# stderr lines of children started by `spawned`, read by a thread so a chatty
# child never blocks on a full pipe.
_LINES: dict[int, queue.Queue[str | None]] = {}


def node_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "node", *args]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LITEGRAPH_NODE_")}
    env["PYTHONPATH"] = str(ROOT)
    env["LITEGRAPH_NODE_GUEST_RUN_DIR"] = guest_run_dir()
    env["LITEGRAPH_NODE_GUEST_CWD_ROOTS"] = guest_cwd_roots()  # `guest_cwd` folders
    env.update(UNCONFINED_UNLESS_ROOT)
    env.update(extra)
    return env


def run_client(
    env: dict[str, str], *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """A client command (`run`, `status`, ...) to its end in a guest folder, its output
    as text."""
    return subprocess.run(
        node_command(*args),
        capture_output=True,
        text=True,
        env=env,
        cwd=guest_cwd(),
        timeout=timeout,
        check=False,
    )


def _drain(stream: object, lines: queue.Queue[str | None]) -> None:
    assert hasattr(stream, "readline")
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


def _stderr_lines(proc: subprocess.Popen[str], timeout: float) -> Iterator[str | None]:
    """A `spawned` child's stderr lines as they come; None once it has ended.
    Stops without None when `timeout` passes first."""
    lines = _LINES[proc.pid]
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            return
        yield line
        if line is None:
            return


def wait_for_line(proc: subprocess.Popen[str], pattern: str, timeout: float = 20.0) -> str:
    """Wait for a stderr line of a `spawned` child to match; returns the first group."""
    seen = []
    for line in _stderr_lines(proc, timeout):
        if line is None:
            break
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
        lines: queue.Queue[str | None] = queue.Queue()
        _LINES[proc.pid] = lines
        reader = threading.Thread(target=_drain, args=(proc.stderr, lines), daemon=True)
        reader.start()
        failed = False
        try:
            yield proc
        except BaseException:
            failed = True
            raise
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
            reader.join(timeout=10)
            del _LINES[proc.pid]
            if failed:  # the child's own account of what went wrong, shown by pytest
                _dump(lines)


def _dump(lines: queue.Queue[str | None]) -> None:
    while True:
        try:
            line = lines.get_nowait()
        except queue.Empty:
            return
        if line is not None:
            sys.stderr.write(line)


def stop(proc: subprocess.Popen[str], signum: int, timeout: float = 20.0) -> int:
    proc.send_signal(signum)
    return proc.wait(timeout=timeout)


def rest_of_stderr(proc: subprocess.Popen[str], timeout: float = 20.0) -> list[str]:
    """Every stderr line of a `spawned` child not read yet, up to its end."""
    seen = list(_stderr_lines(proc, timeout))
    if not seen or seen[-1] is not None:
        raise AssertionError("stderr did not end; got:\n" + "".join(x or "" for x in seen))
    return [line.rstrip("\n") for line in seen if line is not None]


SLEEP_A_MINUTE = {"kind": "builtin", "name": "sleep", "args": {"seconds": 60}}


def submit_a_sleeper(url: str, state: pathlib.Path, work: object = SLEEP_A_MINUTE) -> None:
    """One invocation of a daemon with state in `state` that runs for a minute (or runs
    `work`), running by the time this returns."""
    body = {
        "id": "sleeper",
        "work": work,
        "resources": {"cpu_millis": 100, "memory_bytes": 2**20},
    }
    with httpx.Client(base_url=url, timeout=5) as client:
        deadline = time.monotonic() + 20
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.05)
        secret = json.loads((state / "auth.json").read_text())["scheduler"]
        headers = {"Authorization": f"Bearer {secret}"}
        assert client.post("/v1/invocations", json=body, headers=headers).status_code == 202
        while client.get("/v1/invocations/sleeper", headers=headers).json()["state"] != "running":
            assert time.monotonic() < deadline, "never running"
            time.sleep(0.05)
