"""The command's argv boundary and the daemon's start and shutdown: exit codes,
precedence, planted files, signals.

What the command says and returns for its arguments is asked of `node.cli.main` in this
process (`tests.cli_fixtures.cli`, as a shell with that environment runs it); the
daemon's start, refusal to start and shutdown, and one bad flag, of a real process."""

from __future__ import annotations

import pathlib
import signal
import socket
import subprocess
import time

import httpx
import msgspec
import psutil
import pytest

from machine.snapshot import NodeSnapshot
from tests.cli_fixtures import Ran, cli
from tests.helpers import (
    clean_env,
    node_command,
    rest_of_stderr,
    spawned,
    stop,
    submit_a_sleeper,
    wait_for_line,
)

LISTENING = r"listening on (http://\S+)"
# Its sleeps inherit the ignored SIGTERM: only SIGKILL ends it.
STUBBORN = ["/bin/sh", "-c", "trap '' TERM; sleep 600"]


def run(
    *args: str, cwd: pathlib.Path | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        node_command(*args),
        capture_output=True,
        text=True,
        env=clean_env(**env),
        cwd=cwd,
        timeout=30,
        check=False,
    )


def _cli(*args: str, cwd: pathlib.Path | None = None, **env: str) -> Ran:
    return cli(clean_env(**env), *args, cwd=cwd)


def test_unknown_flag_exits_2_with_one_line_naming_it() -> None:
    """As a process: the exit status and stderr of `python -m node` itself."""
    result = run("--no-such-flag")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "litegraph-node: error: unknown flag --no-such-flag"
    ]


def test_an_unknown_command_is_named_and_a_missing_one_said_missing() -> None:
    """The report: `litegraph-node frobnicate` said "missing command"."""
    unknown = _cli("frobnicate")
    assert unknown.returncode == 2
    (line,) = unknown.stderr.strip().splitlines()
    assert line.startswith("litegraph-node: error: unknown command 'frobnicate' (one of: serve")
    missing = _cli()
    assert missing.returncode == 2
    assert "missing command (one of: serve" in missing.stderr


def test_contracts_check_says_so_when_they_match() -> None:
    """The report: `contracts --check` was silent on success."""
    result = _cli("contracts", "--check")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "litegraph-node contracts: api/contracts/ matches the types"


def test_invalid_env_value_exits_2_naming_flag() -> None:
    result = _cli("serve", LITEGRAPH_NODE_MAX_RUNNING="lots")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "--max-running" in result.stderr


def test_help_is_generated_from_the_flag_file() -> None:
    result = _cli("--help")
    assert result.returncode == 0
    assert "LITEGRAPH_NODE_LISTEN" in result.stdout and "--log-format" in result.stdout


def test_planted_flag_file_in_working_directory_is_ignored(tmp_path: pathlib.Path) -> None:
    (tmp_path / ".cli-flags.toml").write_text(
        '[flags.evil]\nenv = "LITEGRAPH_NODE_EVIL"\naliases = ["evil"]\n'
    )
    (tmp_path / "cli-flags.toml").write_text((tmp_path / ".cli-flags.toml").read_text())
    result = _cli("--evil", "x", cwd=tmp_path)
    assert result.returncode == 2
    assert "unknown flag --evil" in result.stderr


def _serve_argv(tmp_path: pathlib.Path, *argv: str) -> list[str]:
    return node_command("serve", "--state-dir", str(tmp_path), "--devices", "none", *argv)


def test_environment_sets_listen_and_sigint_stops_cleanly(tmp_path: pathlib.Path) -> None:
    env = clean_env(LITEGRAPH_NODE_LISTEN="127.0.0.1:0")
    with spawned(_serve_argv(tmp_path), env) as proc:
        url = wait_for_line(proc, LISTENING)
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":7380")
        reply = httpx.get(f"{url}/healthz", timeout=5)
        assert reply.status_code == 200 and reply.json() == {"status": "ok"}
        assert stop(proc, signal.SIGINT) == 0


def test_argv_listen_beats_environment_and_sigterm_stops(tmp_path: pathlib.Path) -> None:
    env = clean_env(LITEGRAPH_NODE_LISTEN="127.0.0.1:0")
    with spawned(_serve_argv(tmp_path, "--listen", "127.0.0.2:0"), env) as proc:
        url = wait_for_line(proc, LISTENING)
        assert url.startswith("http://127.0.0.2:")
        assert stop(proc, signal.SIGTERM) == 0


def _snapshot_of(*argv: str) -> NodeSnapshot:
    result = _cli("snapshot", *argv)
    assert result.returncode == 0, result.stderr
    # Strict decoding: unknown fields, missing fields and wrong types all fail.
    return msgspec.json.decode(result.stdout, type=NodeSnapshot)


def test_snapshot_without_gpus_has_the_host_and_a_reason() -> None:
    snapshot = _snapshot_of("--devices", "auto", "--node-id", "ws-1")
    assert snapshot.node_id == "ws-1"
    assert snapshot.cpu.logical_cores == psutil.cpu_count()
    assert snapshot.memory.total_bytes <= psutil.virtual_memory().total
    assert [lane.kind.value for lane in snapshot.lanes] == ["cpu"]
    assert snapshot.devices == ()
    assert any(r.startswith(("nvml_unavailable", "no_gpus")) for r in snapshot.readiness_reasons)


def test_snapshot_of_the_simulated_workstation_has_gpu_and_mig_lanes() -> None:
    snapshot = _snapshot_of("--devices", "sim")
    kinds = sorted(lane.kind.value for lane in snapshot.lanes)
    assert kinds == ["cpu", "gpu", "mig", "mig", "mig"]
    assert len(snapshot.devices) == 2
    assert snapshot.readiness_reasons == ()


def test_snapshot_with_a_missing_sim_file_fails_clearly(tmp_path: pathlib.Path) -> None:
    result = _cli("snapshot", "--devices", "sim", "--sim-file", str(tmp_path / "nope.toml"))
    assert result.returncode == 2
    assert "--sim-file" in result.stderr and "nope.toml" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("content", [None, "[[gpus]]\nname = 3\n", "not toml ["])
def test_a_bad_sim_file_exits_2_before_anything_is_created(
    tmp_path: pathlib.Path, content: str | None
) -> None:
    sim = tmp_path / "sim.toml"
    if content is not None:
        sim.write_text(content)
    state = tmp_path / "state"
    result = _cli(
        "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--devices", "sim",
        "--sim-file", str(sim),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("litegraph-node: error: --sim-file: ") and str(sim) in line
    # No port was bound and no secret, key or folder was created.
    assert not state.exists()


def test_a_misspelt_environment_variable_is_named_with_the_nearest_option() -> None:
    result = _cli(
        "snapshot", "--devices", "none",
        LITEGRAPH_NODE_SHUTDOWN_GRCE="5", LITEGRAPH_NODE_ZZZZZZ="1", LITEGRAPH_NODE_LISTEN="x",
    )  # fmt: skip
    assert result.returncode == 2  # the valid LISTEN is still checked
    assert result.stderr.splitlines()[:2] == [
        "litegraph-node: warning: LITEGRAPH_NODE_SHUTDOWN_GRCE is not an option and is"
        " ignored; did you mean LITEGRAPH_NODE_SHUTDOWN_GRACE?",
        "litegraph-node: warning: LITEGRAPH_NODE_ZZZZZZ is not an option and is ignored"
        " (see --help)",
    ]


def test_dev_refuses_an_open_state_dir_with_one_line(tmp_path: pathlib.Path) -> None:
    state = tmp_path / "xdg" / "litegraph-node"
    state.mkdir(parents=True)
    state.chmod(0o777)
    result = run(
        "dev", "--listen", "127.0.0.1:0", "--devices", "none", XDG_STATE_HOME=str(tmp_path / "xdg")
    )
    assert result.returncode == 1, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if "cannot start" in x]
    assert line == (
        f"litegraph-node: cannot start: state folder {state} has mode 0777: other users"
        " could read or replace its keys and secrets (chmod 700 it)"
    )
    assert list(state.iterdir()) == []


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_second_signal_stops_at_once_with_its_own_status_and_one_line(
    tmp_path: pathlib.Path, signum: signal.Signals, status: int
) -> None:
    state = tmp_path / "state"
    argv = _serve_argv(
        state, "--listen", "127.0.0.1:0", "--shutdown-grace", "60", "--kill-grace", "60"
    )
    with spawned(argv, clean_env()) as proc:
        url = wait_for_line(proc, LISTENING)
        # A guest that ignores SIGTERM: stopping at once does not wait its kill grace.
        submit_a_sleeper(url, state, {"kind": "process", "argv": STUBBORN})
        proc.send_signal(signum)
        # The first signal says what shutdown waits for, and how not to wait.
        said = wait_for_line(proc, rf"({signum.name}: stopping.*)")
        assert said == (
            f"{signum.name}: stopping; waiting up to 60s for 1 invocation to finish"
            " (Ctrl-C again to stop now)"
        )
        started = time.monotonic()
        proc.send_signal(signum)
        assert proc.wait(timeout=50) == status
        assert time.monotonic() - started < 20, "the second signal waited the kill grace"
        rest = rest_of_stderr(proc)
    assert not any("Traceback" in line or "Error" in line for line in rest), rest
    assert rest[-1] == (
        f"litegraph-node: second {signum.name}: stopped at once without waiting for"
        f" running work (exit status {status})"
    )


def test_a_port_in_use_exits_1_with_one_line(tmp_path: pathlib.Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(
            "serve", "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "state"),
            "--devices", "none",
        )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if "cannot start" in x]
    assert line.startswith(f"litegraph-node: cannot start: cannot listen on 127.0.0.1:{port}: ")
