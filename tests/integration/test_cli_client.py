"""The client commands against a real `dev` daemon: finding it from the state folder,
the hint `dev` prints, per-command help and --version.

The commands run in this process (`tests.cli_fixtures.cli`) unless their subject is the
process: the hint as a shell runs it, --version from the console script, and a `run`
stopped by Ctrl-C. Tests that leave the node as they found it share one daemon
(`dev`); those that need its first state, or stop or kill it, start their own."""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import re
import shlex
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.cli_fixtures import (
    DEV_LISTENING,
    GUEST_WAITS,
    Dev,
    Running,
    cli,
    cli_in_thread,
    headers,
    started_dev,
    until,
    wait_ended,
)
from tests.helpers import clean_env, guest_cwd, node_command, spawned, stop, wait_for_line


def _as_typed(hint: str) -> list[str]:
    """The printed hint as argv, with the program word replaced by this interpreter's."""
    words = shlex.split(hint)
    assert words[0] == "litegraph-node", hint
    return node_command(*words[1:])


def test_the_dev_hint_works_as_printed_with_another_state_dir(tmp_path: pathlib.Path) -> None:
    state = tmp_path / "my state"
    env = clean_env(XDG_STATE_HOME=str(tmp_path / "xdg"))
    argv = node_command(
        "dev", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--devices", "none"
    )
    with spawned(argv, env) as proc:
        wait_for_line(proc, DEV_LISTENING)
        hint = wait_for_line(proc, r"try:\s+(.*)$")
        assert hint == f"litegraph-node --state-dir {shlex.quote(str(state))} run -- sleep 2"
        words = shlex.split(hint)
        assert words[0] == "litegraph-node", hint
        result = cli(env, *words[1:])
        assert result.returncode == 0, result.stderr
        assert "succeeded" in result.stderr
        assert stop(proc, signal.SIGINT) == 0


def test_the_address_file_is_private_and_removed_on_a_clean_exit(tmp_path: pathlib.Path) -> None:
    state = tmp_path / "state"
    argv = node_command(
        "dev", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--devices", "none"
    )
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
    result = cli(clean_env(), "--state-dir", str(state), "run", "--", "true")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"litegraph-node run: no daemon is running with state folder {state}"
        f" (no {state}/address.json); start one with `litegraph-node dev`"
    ]


def test_a_client_of_a_killed_daemon_sends_its_secret_nowhere(tmp_path: pathlib.Path) -> None:
    state = tmp_path / "state"
    argv = node_command(
        "dev", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--devices", "none"
    )
    with spawned(argv, clean_env()) as proc:
        wait_for_line(proc, DEV_LISTENING)
        pid = proc.pid
        proc.kill()  # no clean exit: the address file stays behind
        proc.wait(timeout=20)
    result = cli(clean_env(), "--state-dir", str(state), "run", "--", "true")
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
    result = cli(clean_env(), "--state-dir", str(state), "run", "--", "true")
    assert result.returncode == 1
    assert "address file" in result.stderr and "mode 0644" in result.stderr


def test_version_is_the_package_version() -> None:
    """Through the console script pip made from [project.scripts], as a user runs it."""
    script = pathlib.Path(sys.executable).with_name("litegraph-node")
    result = subprocess.run(
        [str(script), "--version"], capture_output=True, text=True, env=clean_env(), timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"litegraph-node {importlib.metadata.version('litegraph-node')}\n"


def test_a_subcommands_help_lists_its_own_flags() -> None:
    result = cli(clean_env(), "run", "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith("usage: litegraph-node run [options]")
    assert "Options of 'run'" in text and "--timeout" in text and "--state-dir" in text
    # Not the global help: no list of commands, no daemon-only option.
    assert "contracts" not in text and "--reserved-cpu" not in text
    serve = cli(clean_env(), "serve", "--help").stdout
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
    result = cli(clean_env(), "--state-dir", str(state), "run", *flags, "--", "true")
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"litegraph-node: error: {said}"), line


@pytest.fixture
def own_dev(tmp_path: pathlib.Path) -> Iterator[Dev]:
    """A `dev` daemon of the test's own, for a test that needs all it has ever run."""
    argv = ("--devices", "none", "--shutdown-grace", "0")
    with started_dev(clean_env(), *argv, state=tmp_path / "state") as dev:
        yield dev


def _submit_sleep(dev: Dev, invocation_id: str, seconds: float) -> None:
    body = {
        "id": invocation_id,
        "work": {"kind": "builtin", "name": "sleep", "args": {"seconds": seconds}},
        "resources": {"cpu_millis": 100, "memory_bytes": 2**20},
    }
    reply = httpx.post(
        f"{dev.url}/v1/invocations", json=body, headers=headers(dev.state), timeout=10
    )
    assert reply.status_code == 202, reply.text


def _state_of(dev: Dev, invocation_id: str) -> str:
    reply = httpx.get(
        f"{dev.url}/v1/invocations/{invocation_id}", headers=headers(dev.state), timeout=10
    )
    return str(reply.json()["state"])


def _start_long(dev: Dev, invocation_id: str) -> None:
    """`invocation_id`, running for a minute by the time this returns."""
    _submit_sleep(dev, invocation_id, 60)
    until(lambda: _state_of(dev, invocation_id) == "running", f"{invocation_id} running")


def test_ls_lists_invocations_by_state_and_limit(own_dev: Dev) -> None:
    dev = own_dev
    for name in ("quick-1", "quick-2"):
        _submit_sleep(dev, name, 0.01)
    _submit_sleep(dev, "long", 60)
    assert wait_ended(dev.url, dev.state, "quick-1", "quick-2") == {
        "quick-1": "succeeded",
        "quick-2": "succeeded",
    }
    until(lambda: _state_of(dev, "long") == "running", "long running")
    base = ("--state-dir", str(dev.state), "ls")

    everything = cli(dev.env, *base, "--json")
    assert everything.returncode == 0, everything.stderr
    listed = {inv["id"]: inv["state"] for inv in json.loads(everything.stdout)["invocations"]}
    assert listed == {"quick-1": "succeeded", "quick-2": "succeeded", "long": "running"}

    running = cli(dev.env, *base, "--state", "running")
    rows = running.stdout.splitlines()
    assert rows[0].split() == [
        "ID", "STATE", "REASON", "EXIT", "DURATION", "LANES", "SUBMITTED", "COMMAND"
    ]  # fmt: skip
    assert [row.split()[:2] for row in rows[1:]] == [["long", "running"]]
    (long_row,) = [row.split() for row in rows[1:]]
    assert long_row[4].endswith("s") and long_row[5].startswith("cpu:lane_"), long_row
    assert long_row[-1] == "builtin:sleep"

    one = cli(dev.env, *base, "--state", "succeeded", "--limit", "1", "--json")
    (only,) = json.loads(one.stdout)["invocations"]
    assert only["state"] == "succeeded"
    both = cli(dev.env, *base, "--state", "running,succeeded", "--json")
    assert len(json.loads(both.stdout)["invocations"]) == 3

    for bad, said in (
        (["--state", "sleepy"], "--state: 'sleepy' is not one of queued"),
        (["--limit", "0"], "--limit: must be from 1 to 10000 (got 0)"),
    ):
        refused = cli(dev.env, *base, *bad)
        assert refused.returncode == 2
        assert refused.stderr.startswith(f"litegraph-node: error: {said}"), refused.stderr


def test_serve_is_found_from_its_state_dir_too(tmp_path: pathlib.Path) -> None:
    state = tmp_path / "served"
    argv = node_command(
        "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--devices", "none"
    )
    with spawned(argv, clean_env()) as proc:
        url = wait_for_line(proc, r"listening on (http://\S+)")
        # Written once the daemon has started (after it logs where it listens).
        until((state / "address.json").exists, "wrote its address file")
        assert json.loads((state / "address.json").read_text())["url"] == url
        shown = cli(clean_env(), "--state-dir", str(state), "status", "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["node"]["ready"] is True
        assert stop(proc, signal.SIGTERM) == 0
    assert not (state / "address.json").exists()


# The tests below share one daemon: on one worker, one after another, where xdist's
# loadgroup works. Kept for the session (a fixture of this module's alone), so that a
# worker that runs some of them, then other modules' tests, then the rest, starts it once.
SHARED = pytest.mark.xdist_group("cli-client-dev")


@pytest.fixture(scope="session")
def shared_dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dev]:
    """The module's `dev` daemon, with its default state folder (under XDG_STATE_HOME)
    on a free port, on the simulated workstation: one whole GPU and one split into three
    MIG instances. Its tests leave a minute-long invocation running, so it gives running
    work no shutdown grace."""
    env = clean_env(XDG_STATE_HOME=str(tmp_path_factory.mktemp("cli-client") / "xdg"))
    with started_dev(env, "--devices", "sim", "--shutdown-grace", "0") as dev:
        yield dev


@pytest.fixture
def dev(shared_dev: Dev) -> Iterator[Dev]:
    """The shared daemon, back as it started once the test is done: nothing running, the
    node and its lanes admitting work."""
    yield shared_dev
    shared_dev.clean_up()


@SHARED
def test_the_dev_hint_works_as_printed_on_another_port(dev: Dev) -> None:
    """As a user's shell runs it: the hint's words, as a process, in their environment."""
    assert not dev.url.endswith(":7380")
    assert dev.hint == "litegraph-node run -- sleep 2"
    result = subprocess.run(
        _as_typed(dev.hint),
        capture_output=True,
        text=True,
        env=dev.env,
        cwd=guest_cwd(),
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "succeeded" in result.stderr


@SHARED
def test_run_asks_for_the_resources_its_flags_name(dev: Dev) -> None:
    folder = guest_cwd()
    run_argv = (
        "--state-dir", str(dev.state), "run", "--cpu", "250m", "--memory", "64MiB",
        "--gpus", "1", "--isolation", "dedicated", "--env", "GREETING=hello there",
        "--env", "OTHER=2", "--cwd", str(folder), "--timeout", "30",
        "--", "sh", "-c", f'echo "$GREETING/$OTHER/$(pwd)"; {GUEST_WAITS}',
    )  # fmt: skip
    with cli_in_thread(dev.env, *run_argv) as run, dev.client() as node:
        try:
            _the_run_asked_for_what_it_was_told(run, node, folder)
        finally:
            (folder / "go").touch()  # the guest ends
        ran = run.wait()
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == f"hello there/2/{folder}\n"


def _the_run_asked_for_what_it_was_told(
    run: Running, node: httpx.Client, folder: pathlib.Path
) -> None:
    said = run.wait_for_stderr(b": running\n").decode()
    (invocation_id,) = re.findall(r"^(run-[0-9a-f]+): running$", said, re.MULTILINE)
    status = node.get(f"/v1/invocations/{invocation_id}").json()
    assert status["isolation"] == "dedicated"
    assert [lane["kind"] for lane in status["lanes"]] == ["gpu"]
    capacity = node.get("/v1/snapshot").json()["capacity"]
    assert capacity["cpu_millis"]["allocated"] == 250
    assert capacity["memory_bytes"]["allocated"] == 64 * 2**20
    assert capacity["gpus"]["allocated"] == 1

    def tail() -> str:
        return str(node.get(f"/v1/invocations/{invocation_id}").json()["stdout_tail"])

    until(lambda: "hello there/2/" in tail(), "printed its environment")
    assert tail() == f"hello there/2/{folder}\n"


@SHARED
def test_status_shows_readiness_capacity_lanes_and_counts(dev: Dev) -> None:
    _start_long(dev, "status-long")
    result = cli(dev.env, "--state-dir", str(dev.state), "status", "--json")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["node"]["ready"] is True and shown["node"]["drained"] is False
    assert shown["node"]["invocations"]["running"] == 1
    cpu = shown["snapshot"]["capacity"]["cpu_millis"]
    assert cpu["allocated"] == 100 and cpu["allocatable"] == cpu["capacity"] - cpu["reserved"] - 100
    lanes = shown["snapshot"]["lanes"]

    text = cli(dev.env, "--state-dir", str(dev.state), "status")
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


@SHARED
def test_dev_banner_and_status_count_the_gpus_alike(dev: Dev) -> None:
    # The simulated workstation: one whole GPU and one split into three MIG instances,
    # four GPU lanes in all.
    text = cli(dev.env, "--state-dir", str(dev.state), "status")
    assert text.returncode == 0, text.stderr
    shown = json.loads(cli(dev.env, "--state-dir", str(dev.state), "status", "--json").stdout)
    assert "2 GPUs (3 MIG instances)" in dev.devices, dev.devices
    lines = text.stdout.splitlines()
    assert "devices: 2 GPUs (3 MIG instances)" in lines, text.stdout
    (row,) = [line.split() for line in lines if line.startswith("gpu lanes")]
    lanes = [lane for lane in shown["snapshot"]["lanes"] if lane["kind"] != "cpu"]
    assert row[2] == str(len(lanes)) == "4"


@SHARED
def test_dev_on_purpose_sim_says_it_was_asked_for(dev: Dev) -> None:
    assert "SIMULATED" in dev.devices and "--devices sim" in dev.devices, dev.devices


@SHARED
def test_cancel_ends_a_running_invocation_and_names_what_it_cannot(dev: Dev) -> None:
    base = ("--state-dir", str(dev.state), "cancel")
    _start_long(dev, "cancel-long")
    cancelled = cli(dev.env, *base, "cancel-long")
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout == "cancel-long: cancelled (cancel_requested)\n"
    assert _state_of(dev, "cancel-long") == "cancelled"  # it answered once released

    unknown = cli(dev.env, *base, "nobody")
    assert unknown.returncode == 1
    assert "404 unknown_invocation" in unknown.stderr
    malformed = cli(dev.env, *base, "../x")
    assert malformed.returncode == 2
    assert "'../x' is not an invocation id" in malformed.stderr
    missing = cli(dev.env, *base)
    assert missing.returncode == 2


@SHARED
def test_drain_and_resume_the_node_and_a_lane(dev: Dev) -> None:
    env, base = dev.env, ("--state-dir", str(dev.state))
    _start_long(dev, "drain-long")

    drained = cli(env, *base, "drain")
    assert drained.returncode == 0, drained.stderr
    said = ": drained; no new work is admitted, 1 running or queued go on\n"
    assert drained.stdout.endswith(said)
    status = cli(env, *base, "status")
    assert status.stdout.splitlines()[0].endswith(": NOT READY, DRAINED (admits no new work)")
    refused = cli(env, *base, "run", "--", "true")
    assert refused.returncode == 1
    assert "refused (503) node_draining" in refused.stderr
    assert _state_of(dev, "drain-long") == "running"  # running work goes on
    assert cli(env, *base, "resume").stdout.endswith(": resumed; admitting work\n")

    lanes = json.loads(cli(env, *base, "status", "--json").stdout)["snapshot"]["lanes"]
    cpu_lane = next(lane["lane_id"] for lane in lanes if lane["kind"] == "cpu")
    lane_drained = cli(env, *base, "drain", cpu_lane)
    assert lane_drained.stdout == f"lane {cpu_lane}: drained\n"
    (row,) = [r for r in cli(env, *base, "status").stdout.splitlines() if r.startswith(cpu_lane)]
    assert row.split()[-1] == "drained"
    assert cli(env, *base, "resume", cpu_lane).stdout == f"lane {cpu_lane}: resumed\n"

    unknown = cli(env, *base, "drain", "lane_0000000000000000")
    assert unknown.returncode == 1 and "404 unknown_lane" in unknown.stderr
    malformed = cli(env, *base, "drain", "cpu")
    assert malformed.returncode == 2 and "'cpu' is not a lane id" in malformed.stderr
