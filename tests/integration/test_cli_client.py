"""The client commands against a real `dev` daemon: finding it from the state folder,
the hint `dev` prints, per-command help and --version."""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import shlex
import signal
import stat
import subprocess
from collections.abc import Iterator

import pytest

from tests.helpers import clean_env, guest_cwd, node_command, spawned, stop, wait_for_line

DEV_LISTENING = r"dev: listening on (http://\S+)"


def client(
    env: dict[str, str], *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        node_command(*args),
        capture_output=True,
        text=True,
        env=env,
        cwd=guest_cwd(),
        timeout=timeout,
        check=False,
    )


def _as_typed(hint: str) -> list[str]:
    """The printed hint as argv, with the program word replaced by this interpreter's."""
    words = shlex.split(hint)
    assert words[0] == "litegraph-node", hint
    return node_command(*words[1:])


@pytest.fixture
def xdg_dev(tmp_path: pathlib.Path) -> Iterator[tuple[str, str, dict[str, str]]]:
    """`dev` with its default state folder (under XDG_STATE_HOME) on a free port:
    yields its URL, the hint it printed and the environment a user's shell has."""
    env = clean_env(XDG_STATE_HOME=str(tmp_path / "xdg"))
    with spawned(node_command("dev", "--listen", "127.0.0.1:0"), env) as proc:
        url = wait_for_line(proc, DEV_LISTENING)
        hint = wait_for_line(proc, r"try:\s+(.*)$")
        yield url, hint, env
        assert stop(proc, signal.SIGINT) == 0


def test_the_dev_hint_works_as_printed_on_another_port(
    xdg_dev: tuple[str, str, dict[str, str]],
) -> None:
    url, hint, env = xdg_dev
    assert not url.endswith(":7380")
    assert hint == "litegraph-node run -- sleep 2"
    result = subprocess.run(
        _as_typed(hint), capture_output=True, text=True, env=env, cwd=guest_cwd(), timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "succeeded" in result.stderr


def test_the_dev_hint_works_as_printed_with_another_state_dir(tmp_path: pathlib.Path) -> None:
    state = tmp_path / "my state"
    env = clean_env(XDG_STATE_HOME=str(tmp_path / "xdg"))
    argv = node_command("dev", "--listen", "127.0.0.1:0", "--state-dir", str(state))
    with spawned(argv, env) as proc:
        wait_for_line(proc, DEV_LISTENING)
        hint = wait_for_line(proc, r"try:\s+(.*)$")
        assert hint == f"litegraph-node --state-dir {shlex.quote(str(state))} run -- sleep 2"
        result = subprocess.run(
            _as_typed(hint), capture_output=True, text=True, env=env, cwd=guest_cwd(), timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert stop(proc, signal.SIGINT) == 0


def test_the_address_file_is_private_and_removed_on_a_clean_exit(tmp_path: pathlib.Path) -> None:
    state = tmp_path / "state"
    argv = node_command("dev", "--listen", "127.0.0.1:0", "--state-dir", str(state))
    with spawned(argv, clean_env()) as proc:
        url = wait_for_line(proc, DEV_LISTENING)
        address = state / "address.json"
        assert stat.S_IMODE(address.stat().st_mode) == 0o600
        written = json.loads(address.read_text())
        assert written == {"url": url, "auth_file": str(state / "auth.json"), "pid": proc.pid}
        assert "scheduler" not in address.read_text()  # where the secrets are, not them
        assert stop(proc, signal.SIGINT) == 0
    assert not address.exists()


def test_a_client_without_a_daemon_fails_with_one_clear_line(tmp_path: pathlib.Path) -> None:
    state = tmp_path / "nothing"
    result = client(clean_env(), "--state-dir", str(state), "run", "--", "true")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"litegraph-node run: no daemon is running with state folder {state}"
        f" (no {state}/address.json); start one with `litegraph-node dev`"
    ]


def test_a_client_of_a_killed_daemon_sends_its_secret_nowhere(tmp_path: pathlib.Path) -> None:
    state = tmp_path / "state"
    argv = node_command("dev", "--listen", "127.0.0.1:0", "--state-dir", str(state))
    with spawned(argv, clean_env()) as proc:
        wait_for_line(proc, DEV_LISTENING)
        pid = proc.pid
        proc.kill()  # no clean exit: the address file stays behind
        proc.wait(timeout=20)
    result = client(clean_env(), "--state-dir", str(state), "run", "--", "true")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"litegraph-node run: no daemon is running with state folder {state} (pid {pid},"
        f" which wrote {state}/address.json, is gone); start one with `litegraph-node dev`"
    ]


def test_a_tampered_address_file_is_refused(tmp_path: pathlib.Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    planted = state / "address.json"
    planted.write_text('{"url": "http://127.0.0.1:9", "auth_file": "/x", "pid": 1}')
    planted.chmod(0o644)  # anyone could have pointed our secret elsewhere
    result = client(clean_env(), "--state-dir", str(state), "run", "--", "true")
    assert result.returncode == 1
    assert "address file" in result.stderr and "mode 0644" in result.stderr


def test_version_is_the_package_version() -> None:
    result = client(clean_env(), "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"litegraph-node {importlib.metadata.version('litegraph-node')}\n"


def test_a_subcommands_help_lists_its_own_flags() -> None:
    result = client(clean_env(), "run", "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith("usage: litegraph-node run [options]")
    assert "Options of 'run'" in text and "--timeout" in text and "--state-dir" in text
    # Not the global help: no list of commands, no daemon-only option.
    assert "contracts" not in text and "--reserved-cpu" not in text
    serve = client(clean_env(), "serve", "--help").stdout
    assert "--reserved-cpu" in serve and "--timeout" not in serve
