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
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.helpers import clean_env, guest_cwd, node_command, spawned, stop, wait_for_line
from tests.helpers import run_client as client

DEV_LISTENING = r"dev: listening on (http://\S+)"


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


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--gpus", "many"], "--gpus (LITEGRAPH_NODE_RUN_GPUS): expected an integer, got 'many'"),
        (["--gpus", "65"], "--gpus: must be from 0 to 64 (got 65)"),
        (["--cpu", "lots"], "--cpu: expected cores such as 2, 0.5 or 250m (got 'lots')"),
        (["--cpu", "0"], "--cpu: must be from 1m to 2147483648m (got '0')"),
        (["--memory", "0"], "--memory: must be above 0 (got '0')"),
        (["--vram", "-1"], "--vram: expected a size such as 2GiB or a number of bytes (got '-1')"),
        (["--isolation", "fancy"], "--isolation: expected one of shared, sandbox, partitioned"),
        (["--requirement", "tpu"], "--requirement: expected one of cpu, gpu, auto (got 'tpu')"),
        (["--env", "A=1", "--env", "NOEQUALS"], "--env: expected KEY=VALUE, got 'NOEQUALS'"),
        (["--env", "LD_PRELOAD=/x.so"], "--env: LD_PRELOAD: reserved: set by the node only"),
        (
            ["--cwd", "relative/dir"],
            "--cwd: must be an absolute path, or none to send no cwd (got 'relative/dir')",
        ),
        (["--timeout", "0"], "--timeout: must be in (0, 604800] seconds (got 0.0)"),
    ],
)
def test_a_bad_run_option_exits_2_naming_it_before_anything_is_sent(
    tmp_path: pathlib.Path, flags: list[str], said: str
) -> None:
    # No daemon: a 2 (not 1, "no daemon") shows nothing was looked up or sent.
    state = tmp_path / "nothing"
    result = client(clean_env(), "--state-dir", str(state), "run", *flags, "--", "true")
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"litegraph-node: error: {said}"), line


def _secret(state: pathlib.Path) -> dict[str, str]:
    auth = json.loads((state / "auth.json").read_text())
    return {"Authorization": f"Bearer {auth['scheduler']}"}


def test_run_asks_for_the_resources_its_flags_name(tmp_path: pathlib.Path) -> None:
    state = tmp_path / "state"
    env = clean_env()
    folder = guest_cwd()
    argv = node_command("dev", "--listen", "127.0.0.1:0", "--state-dir", str(state))
    with spawned(argv, env) as daemon:
        url = wait_for_line(daemon, DEV_LISTENING)
        run_argv = node_command(
            "--state-dir", str(state), "run", "--cpu", "250m", "--memory", "64MiB",
            "--gpus", "1", "--isolation", "dedicated", "--env", "GREETING=hello there",
            "--env", "OTHER=2", "--cwd", str(folder), "--timeout", "30",
            "--", "sh", "-c", 'echo "$GREETING/$OTHER/$(pwd)"; sleep 30',
        )  # fmt: skip
        with spawned(run_argv, env) as run:
            invocation_id = wait_for_line(run, r"(run-[0-9a-f]+): running")
            headers = _secret(state)
            status = httpx.get(f"{url}/v1/invocations/{invocation_id}", headers=headers).json()
            assert status["isolation"] == "dedicated"
            assert [lane["kind"] for lane in status["lanes"]] == ["gpu"]
            capacity = httpx.get(f"{url}/v1/snapshot", headers=headers).json()["capacity"]
            assert capacity["cpu_millis"]["allocated"] == 250
            assert capacity["memory_bytes"]["allocated"] == 64 * 2**20
            assert capacity["gpus"]["allocated"] == 1
            deadline = time.monotonic() + 20
            while "hello there/2/" not in status["stdout_tail"]:
                assert time.monotonic() < deadline, status
                time.sleep(0.1)
                status = httpx.get(f"{url}/v1/invocations/{invocation_id}", headers=headers).json()
            assert status["stdout_tail"] == f"hello there/2/{folder}\n"
            assert stop(run, signal.SIGINT) == 130
        assert stop(daemon, signal.SIGINT) == 0


@pytest.fixture
def dev_state(tmp_path: pathlib.Path) -> Iterator[tuple[str, pathlib.Path, dict[str, str]]]:
    """A `dev` daemon on a free port with its own state folder: its URL, the folder,
    and the environment the client commands run in. Its tests leave a minute-long
    invocation running, so the daemon gives it no shutdown grace."""
    state = tmp_path / "state"
    env = clean_env()
    argv = node_command(
        "dev", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--shutdown-grace", "0"
    )
    with spawned(argv, env) as proc:
        url = wait_for_line(proc, DEV_LISTENING)
        yield url, state, env
        assert stop(proc, signal.SIGINT) == 0


def _submit_sleep(url: str, state: pathlib.Path, invocation_id: str, seconds: float) -> None:
    body = {
        "id": invocation_id,
        "work": {"kind": "builtin", "name": "sleep", "args": {"seconds": seconds}},
        "resources": {"cpu_millis": 100, "memory_bytes": 2**20},
    }
    reply = httpx.post(f"{url}/v1/invocations", json=body, headers=_secret(state), timeout=10)
    assert reply.status_code == 202, reply.text


def _state_of(url: str, state: pathlib.Path, invocation_id: str) -> str:
    reply = httpx.get(f"{url}/v1/invocations/{invocation_id}", headers=_secret(state), timeout=10)
    return str(reply.json()["state"])


def _until(check: Callable[[], bool], seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.05)


def _start_long(url: str, state: pathlib.Path) -> None:
    """The invocation `long`, running for a minute by the time this returns."""
    _submit_sleep(url, state, "long", 60)
    _until(lambda: _state_of(url, state, "long") == "running")


def test_status_shows_readiness_capacity_lanes_and_counts(
    dev_state: tuple[str, pathlib.Path, dict[str, str]],
) -> None:
    url, state, env = dev_state
    _start_long(url, state)
    result = client(env, "--state-dir", str(state), "status", "--json")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["node"]["ready"] is True and shown["node"]["drained"] is False
    assert shown["node"]["invocations"]["running"] == 1
    cpu = shown["snapshot"]["capacity"]["cpu_millis"]
    assert cpu["allocated"] == 100 and cpu["allocatable"] == cpu["capacity"] - cpu["reserved"] - 100
    lanes = shown["snapshot"]["lanes"]

    text = client(env, "--state-dir", str(state), "status")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"node {shown['node']['node_id']}: ready"
    header = lines.index(next(line for line in lines if line.startswith("RESOURCE")))
    assert lines[header].split() == ["RESOURCE", "TOTAL", "RESERVED", "ALLOCATED", "FREE"]
    assert lines[header + 1].split()[:5] == [
        "cpu",
        "(cores)",
        str(cpu["capacity"] // 1000),
        "1",
        "0.1",
    ]
    for lane in lanes:
        (row,) = [line for line in lines if line.startswith(lane["lane_id"])]
        assert row.split()[1:] == [
            lane["kind"],
            lane["mig_uuid"] or lane["device_id"],
            lane["health"],
            "-",
        ]
    assert ["running", "1"] in [line.split() for line in lines]


def test_dev_banner_and_status_count_the_gpus_alike(tmp_path: pathlib.Path) -> None:
    # The simulated workstation: one whole GPU and one split into three MIG instances,
    # four GPU lanes in all.
    state = tmp_path / "state"
    env = clean_env()
    argv = node_command("dev", "--listen", "127.0.0.1:0", "--state-dir", str(state))
    with spawned([*argv, "--devices", "sim"], env) as proc:
        wait_for_line(proc, DEV_LISTENING)
        banner = wait_for_line(proc, r"  devices: +(.*)")
        text = client(env, "--state-dir", str(state), "status")
        assert text.returncode == 0, text.stderr
        shown = json.loads(client(env, "--state-dir", str(state), "status", "--json").stdout)
        assert stop(proc, signal.SIGINT) == 0
    assert "2 GPUs (3 MIG instances)" in banner, banner
    lines = text.stdout.splitlines()
    assert "devices: 2 GPUs (3 MIG instances)" in lines, text.stdout
    (row,) = [line.split() for line in lines if line.startswith("gpu lanes")]
    lanes = [lane for lane in shown["snapshot"]["lanes"] if lane["kind"] != "cpu"]
    assert row[2] == str(len(lanes)) == "4"


def test_ls_lists_invocations_by_state_and_limit(
    dev_state: tuple[str, pathlib.Path, dict[str, str]],
) -> None:
    url, state, env = dev_state
    for name in ("quick-1", "quick-2"):
        _submit_sleep(url, state, name, 0.01)
    _submit_sleep(url, state, "long", 60)
    _until(lambda: _state_of(url, state, "quick-2") == "succeeded")
    _until(lambda: _state_of(url, state, "quick-1") == "succeeded")
    _until(lambda: _state_of(url, state, "long") == "running")
    base = ("--state-dir", str(state), "ls")

    everything = client(env, *base, "--json")
    assert everything.returncode == 0, everything.stderr
    listed = {inv["id"]: inv["state"] for inv in json.loads(everything.stdout)["invocations"]}
    assert listed == {"quick-1": "succeeded", "quick-2": "succeeded", "long": "running"}

    running = client(env, *base, "--state", "running")
    rows = running.stdout.splitlines()
    assert rows[0].split() == [
        "ID", "STATE", "REASON", "EXIT", "DURATION", "LANES", "SUBMITTED", "COMMAND"
    ]  # fmt: skip
    assert [row.split()[:2] for row in rows[1:]] == [["long", "running"]]
    (long_row,) = [row.split() for row in rows[1:]]
    assert long_row[4].endswith("s") and long_row[5].startswith("cpu:lane_"), long_row
    assert long_row[-1] == "builtin:sleep"

    one = client(env, *base, "--state", "succeeded", "--limit", "1", "--json")
    (only,) = json.loads(one.stdout)["invocations"]
    assert only["state"] == "succeeded"
    both = client(env, *base, "--state", "running,succeeded", "--json")
    assert len(json.loads(both.stdout)["invocations"]) == 3

    for bad, said in (
        (["--state", "sleepy"], "--state: 'sleepy' is not one of queued"),
        (["--limit", "0"], "--limit: must be from 1 to 10000 (got 0)"),
    ):
        refused = client(env, *base, *bad)
        assert refused.returncode == 2
        assert refused.stderr.startswith(f"litegraph-node: error: {said}"), refused.stderr


def test_cancel_ends_a_running_invocation_and_names_what_it_cannot(
    dev_state: tuple[str, pathlib.Path, dict[str, str]],
) -> None:
    url, state, env = dev_state
    _start_long(url, state)
    cancelled = client(env, "--state-dir", str(state), "cancel", "long")
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout == "long: cancelled (cancel_requested)\n"
    assert _state_of(url, state, "long") == "cancelled"  # it answered once released

    unknown = client(env, "--state-dir", str(state), "cancel", "nobody")
    assert unknown.returncode == 1
    assert "404 unknown_invocation" in unknown.stderr
    malformed = client(env, "--state-dir", str(state), "cancel", "../x")
    assert malformed.returncode == 2
    assert "'../x' is not an invocation id" in malformed.stderr
    missing = client(env, "--state-dir", str(state), "cancel")
    assert missing.returncode == 2


def test_drain_and_resume_the_node_and_a_lane(
    dev_state: tuple[str, pathlib.Path, dict[str, str]],
) -> None:
    url, state, env = dev_state
    base = ("--state-dir", str(state))
    _start_long(url, state)

    drained = client(env, *base, "drain")
    assert drained.returncode == 0, drained.stderr
    said = ": drained; no new work is admitted, 1 running or queued go on\n"
    assert drained.stdout.endswith(said)
    status = client(env, *base, "status")
    assert status.stdout.splitlines()[0].endswith(": NOT READY, DRAINED (admits no new work)")
    refused = client(env, *base, "run", "--", "true")
    assert refused.returncode == 1
    assert "refused (503) node_draining" in refused.stderr
    assert _state_of(url, state, "long") == "running"  # running work goes on
    assert client(env, *base, "resume").stdout.endswith(": resumed; admitting work\n")

    lanes = json.loads(client(env, *base, "status", "--json").stdout)["snapshot"]["lanes"]
    cpu_lane = next(lane["lane_id"] for lane in lanes if lane["kind"] == "cpu")
    lane_drained = client(env, *base, "drain", cpu_lane)
    assert lane_drained.stdout == f"lane {cpu_lane}: drained\n"
    (row,) = [r for r in client(env, *base, "status").stdout.splitlines() if r.startswith(cpu_lane)]
    assert row.split()[-1] == "drained"
    assert client(env, *base, "resume", cpu_lane).stdout == f"lane {cpu_lane}: resumed\n"

    unknown = client(env, *base, "drain", "lane_0000000000000000")
    assert unknown.returncode == 1 and "404 unknown_lane" in unknown.stderr
    malformed = client(env, *base, "drain", "cpu")
    assert malformed.returncode == 2 and "'cpu' is not a lane id" in malformed.stderr


def test_serve_is_found_from_its_state_dir_too(tmp_path: pathlib.Path) -> None:
    state = tmp_path / "served"
    argv = node_command(
        "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--devices", "none"
    )
    with spawned(argv, clean_env()) as proc:
        url = wait_for_line(proc, r"listening on (http://\S+)")
        # Written once the daemon has started (after it logs where it listens).
        _until((state / "address.json").exists)
        assert json.loads((state / "address.json").read_text())["url"] == url
        shown = client(clean_env(), "--state-dir", str(state), "status", "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["node"]["ready"] is True
        assert stop(proc, signal.SIGTERM) == 0
    assert not (state / "address.json").exists()
