"""`litegraph-node run -- CMD` against a `dev` daemon, both as real subprocesses."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import psutil  # type: ignore[import-untyped,unused-ignore]
import pytest

from api.auth import load_auth
from tests.helpers import (
    clean_env,
    guest_cwd,
    node_command,
    rest_of_stderr,
    run_client,
    spawned,
    stop,
    wait_for_line,
)

DEV_LISTENING = r"dev: listening on (http://\S+)"


@pytest.fixture
def dev_node(tmp_path: pathlib.Path) -> Iterator[tuple[str, dict[str, str], int]]:
    """A `dev` daemon on loopback port 0; yields its URL, the env `run` needs, its pid."""
    env = clean_env(LITEGRAPH_NODE_STATE_DIR=str(tmp_path / "state"))
    with spawned(node_command("dev", "--listen", "127.0.0.1:0"), env) as proc:
        url = wait_for_line(proc, DEV_LISTENING)
        yield url, env, proc.pid
        assert stop(proc, signal.SIGINT) == 0


def test_run_prints_output_and_exits_with_the_commands_status(
    dev_node: tuple[str, dict[str, str], int], tmp_path: pathlib.Path
) -> None:
    url, env, _ = dev_node
    result = run_client(env, "run", "--url", url, "--", "sh", "-c", "echo hi; exit 3")
    assert result.stdout == "hi\n", result.stderr
    assert result.returncode == 3, result.stderr
    assert "failed (nonzero_exit)" in result.stderr


def test_run_exits_0_when_the_command_succeeds(
    dev_node: tuple[str, dict[str, str], int], tmp_path: pathlib.Path
) -> None:
    url, env, _ = dev_node
    script = "printf 'a\\nb\\n'; echo err >&2"
    result = run_client(env, "run", "--url", url, "--", "sh", "-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "a\nb\n"
    assert "err\n" in result.stderr


def test_sigint_cancels_the_invocation(
    dev_node: tuple[str, dict[str, str], int], tmp_path: pathlib.Path
) -> None:
    url, env, daemon_pid = dev_node
    with spawned(node_command("run", "--url", url, "--", "sleep", "60"), env) as run:
        invocation_id = wait_for_line(run, r"(run-[0-9a-f]+): running")
        assert stop(run, signal.SIGINT) == 130
    secret = load_auth(tmp_path / "state" / "auth.json").scheduler
    reply = httpx.get(
        f"{url}/v1/invocations/{invocation_id}",
        headers={"Authorization": f"Bearer {secret}"},
        timeout=10,
    )
    assert reply.status_code == 200
    assert reply.json()["state"] == "cancelled"
    assert reply.json()["reason"] == "cancel_requested"
    # Cancelled means the process is gone: the daemon has no child left but its lane hosts.
    children = psutil.Process(daemon_pid).children(recursive=True)
    assert [p for p in children if "lanehost" not in p.cmdline()] == []


def _dev(tmp_path: pathlib.Path) -> tuple[list[str], dict[str, str]]:
    """A `dev` daemon that cancels running work at once when it stops."""
    env = clean_env(LITEGRAPH_NODE_STATE_DIR=str(tmp_path / "state"))
    argv = node_command("dev", "--listen", "127.0.0.1:0", "--shutdown-grace", "0")
    return argv, env


def _no_transport_noise(lines: list[str]) -> None:
    said = "\n".join(lines)
    assert "Traceback" not in said and "attempts failed" not in said, said
    assert "cannot reach" not in said, said


def test_a_run_whose_node_stops_says_the_shutdown_cancelled_it(tmp_path: pathlib.Path) -> None:
    argv, env = _dev(tmp_path)
    with spawned(argv, env) as daemon:
        url = wait_for_line(daemon, DEV_LISTENING)
        with spawned(node_command("run", "--url", url, "--", "sleep", "60"), env) as run:
            invocation_id = wait_for_line(run, r"(run-[0-9a-f]+): running")
            assert stop(daemon, signal.SIGTERM, timeout=60) == 0
            assert run.wait(timeout=30) == 130
            said = rest_of_stderr(run)
    # The node answered before it went: how the invocation ended, and why.
    assert said[-1] == f"{invocation_id}: cancelled (shutdown)", said
    _no_transport_noise(said)


def test_a_run_whose_node_is_killed_says_in_one_line_that_it_went_away(
    tmp_path: pathlib.Path,
) -> None:
    argv, env = _dev(tmp_path)
    with spawned(argv, env) as daemon:
        url = wait_for_line(daemon, DEV_LISTENING)
        with spawned(node_command("run", "--url", url, "--", "sleep", "60"), env) as run:
            invocation_id = wait_for_line(run, r"(run-[0-9a-f]+): running")
            daemon.kill()
            daemon.wait(timeout=30)
            assert run.wait(timeout=60) == 69
            said = rest_of_stderr(run)
    assert said == [
        f"litegraph-node run: the node at {url} went away before {invocation_id} ended;"
        " how it ended is unknown"
    ]
    _no_transport_noise(said)


def test_run_without_a_node_fails_with_one_clear_line(tmp_path: pathlib.Path) -> None:
    result = subprocess.run(
        node_command("run", "--", "true"),
        capture_output=True,
        text=True,
        env=clean_env(LITEGRAPH_NODE_STATE_DIR=str(tmp_path / "nothing")),
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "no daemon is running with state folder" in result.stderr


def _client(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[bytes]:
    """A client command (`run`, `logs`) to its end, its output as bytes."""
    return subprocess.run(
        node_command(*args), capture_output=True, env=env, cwd=guest_cwd(), timeout=120
    )


def test_run_streams_every_byte_of_a_large_output(
    dev_node: tuple[str, dict[str, str], int], tmp_path: pathlib.Path
) -> None:
    url, env, _ = dev_node
    result = _client(env, "run", "--url", url, "--", "sh", "-c", "seq 1 200000; echo bye >&2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(b"\n") == 200000
    assert result.stdout == "".join(f"{n}\n" for n in range(1, 200001)).encode()
    assert b"bye\n" in result.stderr and b"not kept" not in result.stderr


def test_a_python_guests_line_arrives_before_it_ends(
    dev_node: tuple[str, dict[str, str], int], tmp_path: pathlib.Path
) -> None:
    url, env, _ = dev_node
    script = "import time; print('early'); time.sleep(4); print('late')"
    argv = node_command("run", "--url", url, "--", "python3", "-c", script)
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=guest_cwd()
    ) as run:
        watchdog = threading.Timer(60, run.kill)
        watchdog.start()
        try:
            assert run.stdout is not None
            first = run.stdout.readline()
            first_at = time.monotonic()
            rest = run.stdout.read()
            ended_at = time.monotonic()
            assert run.wait() == 0
        finally:
            watchdog.cancel()
    assert (first, rest) == (b"early\n", b"late\n")
    assert ended_at - first_at > 2  # printed live, not when the guest ended


def test_logs_prints_a_stream_after_the_end_and_follows_a_running_one(
    dev_node: tuple[str, dict[str, str], int], tmp_path: pathlib.Path
) -> None:
    url, env, _ = dev_node
    with spawned(
        node_command("run", "--url", url, "--", "sh", "-c", "echo out; echo err >&2; sleep 3"),
        env,
    ) as run:
        invocation_id = wait_for_line(run, r"(run-[0-9a-f]+): running")
        followed = _client(env, "logs", "--url", url, "-f", invocation_id)
        assert run.wait(timeout=60) == 0
    assert followed.returncode == 0 and followed.stdout == b"out\n", followed.stderr

    def logs(*args: str) -> subprocess.CompletedProcess[bytes]:
        return _client(env, "logs", "--url", url, *args)

    assert logs(invocation_id, "--stream", "stderr").stdout == b"err\n"
    unknown = logs("run-nope")
    assert unknown.returncode == 1 and b"unknown_invocation" in unknown.stderr
    assert logs(invocation_id, "--stream", "stdin").returncode == 2


def test_run_where_the_guest_may_not_start_says_so_and_starts_in_its_tmp(
    tmp_path: pathlib.Path,
) -> None:
    """`serve` allows no cwd by default. The current folder `run` sends on its own is
    dropped with a line saying so; a folder the user names is refused, with how."""
    state = tmp_path / "served"
    env = clean_env(LITEGRAPH_NODE_GUEST_CWD_ROOTS="[]")  # serve's default
    argv = node_command(
        "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--devices", "none"
    )
    with spawned(argv, env) as proc:
        wait_for_line(proc, r"listening on (http://\S+)")
        deadline = time.monotonic() + 20
        while not (state / "address.json").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        moved = run_client(env, "--state-dir", str(state), "run", "--", "pwd")
        assert (moved.returncode, moved.stdout) == (0, "/tmp\n"), moved.stderr
        said = moved.stderr.splitlines()
        assert said[0].startswith("litegraph-node run: invalid_cwd: cwd: "), said
        assert "this node allows no cwd" in said[0]
        assert "starting it in its private /tmp instead" in said[1], said
        named = run_client(env, "--state-dir", str(state), "run", "--cwd", "/srv", "--", "pwd")
        assert named.returncode == 1, named.stderr
        said = named.stderr.splitlines()
        assert said[0].startswith("litegraph-node run: refused (422) invalid_cwd: cwd: "), said
        assert "--cwd none sends none" in said[1], said
        ran = run_client(env, "--state-dir", str(state), "run", "--cwd", "none", "--", "pwd")
        assert (ran.returncode, ran.stdout) == (0, "/tmp\n"), ran.stderr
        assert stop(proc, signal.SIGTERM) == 0
