"""`litegraph-node run -- CMD` against a `dev` daemon.

`run` and `logs` run in this process (`tests.cli_fixtures.cli`) where their subject is
what they print and the status they return; as real subprocesses where it is the
process: Ctrl-C, bytes through a real pipe, output that arrives while the guest runs,
a node that stops or is killed under them. Tests that only run their own invocations
to their end share one daemon; those that stop or kill it, or need `serve`, start
their own."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import threading
from collections.abc import Iterator

import httpx
import pytest

from api.auth import load_auth
from tests.adversarial.fixtures import guest_command_lines
from tests.cli_fixtures import (
    DEV_LISTENING,
    GUEST_WAITS,
    Dev,
    cli,
    cli_in_thread,
    started_dev,
    until,
    wait_ended,
)
from tests.helpers import (
    clean_env,
    guest_cwd,
    node_command,
    rest_of_stderr,
    spawned,
    stop,
    wait_for_line,
)


def _dev(tmp_path: pathlib.Path) -> tuple[list[str], dict[str, str]]:
    """A `dev` daemon that cancels running work at once when it stops."""
    env = clean_env(LITEGRAPH_NODE_STATE_DIR=str(tmp_path / "state"))
    argv = node_command(
        "dev", "--listen", "127.0.0.1:0", "--devices", "none", "--shutdown-grace", "0"
    )
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
    result = cli(clean_env(LITEGRAPH_NODE_STATE_DIR=str(tmp_path / "nothing")), "run", "--", "true")
    assert result.returncode == 1
    assert "no daemon is running with state folder" in result.stderr


def _client(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[bytes]:
    """A client command (`run`, `logs`) to its end as a process, its output as bytes."""
    return subprocess.run(
        node_command(*args), capture_output=True, env=env, cwd=guest_cwd(), timeout=120
    )


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
        until((state / "address.json").exists, "wrote its address file")
        moved = cli(env, "--state-dir", str(state), "run", "--", "pwd")
        assert (moved.returncode, moved.stdout) == (0, "/tmp\n"), moved.stderr
        said = moved.stderr.splitlines()
        assert said[0].startswith("litegraph-node run: invalid_cwd: cwd: "), said
        assert "this node allows no cwd" in said[0]
        assert "starting it in its private /tmp instead" in said[1], said
        named = cli(env, "--state-dir", str(state), "run", "--cwd", "/srv", "--", "pwd")
        assert named.returncode == 1, named.stderr
        said = named.stderr.splitlines()
        assert said[0].startswith("litegraph-node run: refused (422) invalid_cwd: cwd: "), said
        assert "--cwd none sends none" in said[1], said
        ran = cli(env, "--state-dir", str(state), "run", "--cwd", "none", "--", "pwd")
        assert (ran.returncode, ran.stdout) == (0, "/tmp\n"), ran.stderr
        assert stop(proc, signal.SIGTERM) == 0


# The tests below share one daemon: on one worker, one after another, where xdist's
# loadgroup works. Kept for the session (a fixture of this module's alone), so that a
# worker that runs some of them, then other modules' tests, then the rest, starts it once.
SHARED = pytest.mark.xdist_group("run-command-dev")


@pytest.fixture(scope="session")
def shared_dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dev]:
    """The module's `dev` daemon on loopback port 0, its state folder in the environment
    `run` is given (LITEGRAPH_NODE_STATE_DIR), where `run --url` finds its secret."""
    state = tmp_path_factory.mktemp("run-command") / "state"
    env = clean_env(LITEGRAPH_NODE_STATE_DIR=str(state))
    with started_dev(env, "--devices", "none", state=state) as dev:
        yield dev


@pytest.fixture
def dev(shared_dev: Dev) -> Iterator[Dev]:
    """The shared daemon, back as it started once the test is done: nothing running."""
    yield shared_dev
    shared_dev.clean_up()


@SHARED
def test_run_prints_output_and_exits_with_the_commands_status(dev: Dev) -> None:
    result = cli(dev.env, "run", "--url", dev.url, "--", "sh", "-c", "echo hi; exit 3")
    assert result.stdout == "hi\n", result.stderr
    assert result.returncode == 3, result.stderr
    assert "failed (nonzero_exit)" in result.stderr


@SHARED
def test_run_exits_0_when_the_command_succeeds(dev: Dev) -> None:
    script = "printf 'a\\nb\\n'; echo err >&2"
    result = cli(dev.env, "run", "--url", dev.url, "--", "sh", "-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "a\nb\n"
    assert "err\n" in result.stderr


@SHARED
def test_sigint_cancels_the_invocation(dev: Dev) -> None:
    with spawned(node_command("run", "--url", dev.url, "--", "sleep", "60"), dev.env) as run:
        invocation_id = wait_for_line(run, r"(run-[0-9a-f]+): running")
        assert stop(run, signal.SIGINT) == 130
    secret = load_auth(dev.state / "auth.json").scheduler
    reply = httpx.get(
        f"{dev.url}/v1/invocations/{invocation_id}",
        headers={"Authorization": f"Bearer {secret}"},
        timeout=10,
    )
    assert reply.status_code == 200
    assert reply.json()["state"] == "cancelled"
    assert reply.json()["reason"] == "cancel_requested"
    # Cancelled means the process is gone: the daemon runs no guest (ready sandboxes and
    # lane hosts aside).
    assert guest_command_lines(dev.proc.pid) == []


@SHARED
def test_run_streams_every_byte_of_a_large_output(dev: Dev) -> None:
    script = "seq 1 200000; echo bye >&2"
    result = _client(dev.env, "run", "--url", dev.url, "--", "sh", "-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(b"\n") == 200000
    assert result.stdout == "".join(f"{n}\n" for n in range(1, 200001)).encode()
    assert b"bye\n" in result.stderr and b"not kept" not in result.stderr


# A Python guest that waits, in its folder, until the test creates `go` there.
PYTHON_WAITS = "import os, time\nwhile not os.path.exists('go'):\n    time.sleep(0.02)\n"


@SHARED
def test_a_python_guests_line_arrives_before_it_ends(dev: Dev) -> None:
    folder = guest_cwd()
    script = f"print('early')\n{PYTHON_WAITS}print('late')"
    argv = node_command("run", "--url", dev.url, "--", "python3", "-c", script)
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=dev.env, cwd=folder
    ) as run:
        watchdog = threading.Timer(60, run.kill)
        watchdog.start()
        try:
            assert run.stdout is not None
            # The guest cannot end before `go` exists: its first line came while it ran.
            first = run.stdout.readline()
            (folder / "go").touch()
            rest = run.stdout.read()
            assert run.wait() == 0
        finally:
            (folder / "go").touch(exist_ok=True)
            watchdog.cancel()
    assert (first, rest) == (b"early\n", b"late\n")


@SHARED
def test_logs_prints_a_stream_after_the_end_and_follows_a_running_one(dev: Dev) -> None:
    folder = guest_cwd()
    invocation_id = "logs-followed"
    body = {
        "id": invocation_id,
        "work": {
            "kind": "process",
            "argv": ["sh", "-c", f"echo out; echo err >&2; {GUEST_WAITS}; echo more"],
            "cwd": str(folder),
        },
        "resources": {"cpu_millis": 100, "memory_bytes": 64 * 2**20},
    }
    with dev.client() as node:
        submitted = node.post("/v1/invocations", json=body)
    assert submitted.status_code == 202, submitted.text
    with cli_in_thread(dev.env, "logs", "--url", dev.url, "-f", invocation_id) as logs:
        try:
            logs.wait_for_stdout(b"out\n")
            assert logs.running()
        finally:
            (folder / "go").touch()  # only now can the guest print `more`, and end
        followed = logs.wait()
    assert followed.returncode == 0 and followed.out == b"out\nmore\n", followed.stderr
    assert wait_ended(dev.url, dev.state, invocation_id) == {invocation_id: "succeeded"}

    def logs_of(*args: str) -> tuple[int, bytes, bytes]:
        ran = cli(dev.env, "logs", "--url", dev.url, *args)
        return ran.returncode, ran.out, ran.err

    assert logs_of(invocation_id, "--stream", "stderr")[1] == b"err\n"
    code, _, err = logs_of("run-nope")
    assert code == 1 and b"unknown_invocation" in err
    assert logs_of(invocation_id, "--stream", "stdin")[0] == 2
