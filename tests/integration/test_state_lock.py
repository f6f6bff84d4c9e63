"""One daemon per state folder: `serve` and `dev` lock it before touching anything in it.

A second daemon on a folder once started beside the first: it replaced the first
one's signing key, rewrote `address.json` so clients reached it, and both appended
to one journal; a restart did the same while the old daemon was still in its
shutdown grace. The lock wait is given in the environment
(`LITEGRAPH_NODE_STATE_LOCK_WAIT`, as `--state-lock-wait`).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx

from tests.helpers import (
    clean_env,
    node_command,
    rest_of_stderr,
    spawned,
    submit_a_sleeper,
    wait_for_line,
)

LISTENING = r"listening on (http://\S+)"


def _serve(state: pathlib.Path, *argv: str) -> list[str]:
    return node_command(
        "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--devices", "none", *argv
    )


def _files(state: pathlib.Path) -> dict[str, bytes]:
    """What a second daemon must leave alone: keys, secrets, address, journal."""
    names = ["auth.json", "address.json", "reservations.journal"]
    found = {name: (state / name).read_bytes() for name in names if (state / name).exists()}
    for key in sorted((state / "keys").iterdir()):
        found[f"keys/{key.name}"] = key.read_bytes()
    return found


def _started(proc: subprocess.Popen[str], state: pathlib.Path, url: str = "") -> str:
    """The URL of a daemon once it has started whole (its address file is written)."""
    url = url or wait_for_line(proc, LISTENING)
    deadline = time.monotonic() + 20
    address = state / "address.json"
    while not address.exists() or json.loads(address.read_text())["pid"] != proc.pid:
        assert time.monotonic() < deadline and proc.poll() is None, "never started"
        time.sleep(0.05)
    return url


def _refusal(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if "cannot start" in x]
    return line


def _run(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, env=clean_env(**env), timeout=30, check=False
    )


@contextlib.contextmanager
def _stopping(state: pathlib.Path, grace: str) -> Iterator[subprocess.Popen[str]]:
    """A daemon in its shutdown grace: one SIGTERM while an invocation runs."""
    with spawned(_serve(state, "--shutdown-grace", grace), clean_env()) as old:
        submit_a_sleeper(wait_for_line(old, LISTENING), state)
        old.send_signal(signal.SIGTERM)
        wait_for_line(old, r"(SIGTERM: stopping)")
        yield old


def test_a_second_serve_on_one_state_folder_exits_1_naming_the_first_and_changes_nothing(
    tmp_path: pathlib.Path,
) -> None:
    state = tmp_path / "state"
    # No grace at its end: its sleeper is cancelled at once when it stops.
    with spawned(_serve(state, "--shutdown-grace", "0"), clean_env()) as first:
        url = _started(first, state)
        submit_a_sleeper(url, state)
        before = _files(state)
        assert json.loads(before["address.json"])["pid"] == first.pid
        second = _run(_serve(state), LITEGRAPH_NODE_STATE_LOCK_WAIT="0.5")
        line = _refusal(second)
        assert line.startswith(f"litegraph-node: cannot start: state folder {state} is in use")
        assert f"pid {first.pid}" in line and "--state-lock-wait" in line
        assert _files(state) == before
        # The first goes on, reachable where clients find it, with its own key.
        assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0
    assert not (state / "address.json").exists()


def test_dev_and_serve_refuse_to_share_a_state_folder(tmp_path: pathlib.Path) -> None:
    xdg = tmp_path / "xdg"
    dev_state = xdg / "litegraph-node"
    dev_env = clean_env(XDG_STATE_HOME=str(xdg), LITEGRAPH_NODE_STATE_LOCK_WAIT="0.5")
    dev = node_command("dev", "--listen", "127.0.0.1:0", "--devices", "none")
    with spawned(dev, dev_env) as holder:
        _started(holder, dev_state)
        before = _files(dev_state)
        line = _refusal(_run(_serve(dev_state), LITEGRAPH_NODE_STATE_LOCK_WAIT="0.5"))
        assert f"pid {holder.pid}" in line
        assert _files(dev_state) == before
        assert holder.poll() is None
    serve_state = tmp_path / "served"
    with spawned(_serve(serve_state), clean_env()) as holder:
        _started(holder, serve_state)
        before = _files(serve_state)
        refused = _run([*dev, "--state-dir", str(serve_state)], **dev_env)
        assert f"pid {holder.pid}" in _refusal(refused)
        assert _files(serve_state) == before


def test_a_restart_during_the_old_daemons_shutdown_grace_waits_for_it_then_starts(
    tmp_path: pathlib.Path,
) -> None:
    state = tmp_path / "state"
    with _stopping(state, grace="3") as old:
        env = clean_env(LITEGRAPH_NODE_STATE_LOCK_WAIT="30")
        with spawned(_serve(state), env) as new:
            said = wait_for_line(new, r"(state folder .* is in use by pid \d+.*)")
            assert f"pid {old.pid}" in said
            url = wait_for_line(new, LISTENING)
            # It started only once the old one had gone, after its grace.
            assert old.poll() == 0, "the new daemon started beside the old one"
            _started(new, state, url)  # clients now find the new one
            assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
            new.send_signal(signal.SIGTERM)
            assert new.wait(timeout=30) == 0


def test_a_restart_that_outwaits_its_bound_exits_1_naming_the_old_daemon(
    tmp_path: pathlib.Path,
) -> None:
    state = tmp_path / "state"
    with _stopping(state, grace="60") as old:
        started = time.monotonic()
        line = _refusal(_run(_serve(state), LITEGRAPH_NODE_STATE_LOCK_WAIT="1"))
        assert 1 <= time.monotonic() - started < 20
        assert f"pid {old.pid}" in line and "waited 1s" in line
        assert old.poll() is None  # still in its grace, untouched
        old.send_signal(signal.SIGTERM)  # a second signal: stop now
        assert old.wait(timeout=30) == 143
        rest_of_stderr(old)
