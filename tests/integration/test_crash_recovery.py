"""SIGKILL the daemon while a process invocation runs, restart it on the same state:
no orphan survives, the ledger is back to its baseline, old tokens are refused."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import time

import httpx
import psutil

from tests.helpers import (
    clean_env,
    guest_cwd,
    node_command,
    rest_of_stderr,
    spawned,
    stop,
    wait_for_line,
)

LISTENING = r"listening on (http://\S+)"


def _serve(state: pathlib.Path, devices: str = "none") -> list[str]:
    """`serve` on `state`. Without GPUs unless asked: only the test of tokens needs a
    lane host on a GPU, and the simulated workstation's four cost a daemon about a
    second of CPU (and half a second of wall time) at every start."""
    return node_command(
        "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--devices", devices
    )


def _wait_ready(client: httpx.Client) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if client.get("/readyz").status_code == 200:
            return
        time.sleep(0.02)
    raise AssertionError("the daemon never became ready")


def _ready(proc: subprocess.Popen[bytes], state: pathlib.Path) -> tuple[str, dict[str, str]]:
    """The daemon's URL once it is ready, and the scheduler's credential."""
    url = wait_for_line(proc, LISTENING)
    with httpx.Client(base_url=url, timeout=10) as client:
        _wait_ready(client)
    secret = json.loads((state / "auth.json").read_text())["scheduler"]
    return url, {"Authorization": f"Bearer {secret}"}


def _guests(pid: int) -> list[psutil.Process]:
    """The daemon's descendants but its lane hosts (which are up before it is ready, and
    die with it)."""
    out = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "lanehost" not in child.cmdline():
                out.append(child)
        except psutil.Error:
            continue
    return out


def test_sigkill_then_restart_leaves_no_orphan_and_refuses_old_tokens(
    tmp_path: pathlib.Path,
) -> None:
    env = clean_env()
    with spawned(_serve(tmp_path, "sim"), env) as first:
        url, operator = _ready(first, tmp_path)
        with httpx.Client(base_url=url, headers=operator, timeout=10) as client:
            baseline = client.get("/v1/snapshot").json()["capacity"]
            accepted = client.post(
                "/v1/invocations",
                json={
                    "id": "survivor",
                    "work": {"kind": "process", "argv": ["sh", "-c", "sleep 300 & sleep 300"]},
                    "requirement": "gpu",
                    "resources": {"cpu_millis": 500, "gpus": 1, "vram_bytes": 2**30},
                },
            )
            assert accepted.status_code == 202, accepted.text
            lane_id, token = next(iter(accepted.json()["tokens"].items()))
            deadline = time.monotonic() + 10
            while len(_guests(first.pid)) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            orphans = _guests(first.pid)
            assert len(orphans) >= 2  # the shell and its backgrounded sleep
            held = client.get("/v1/snapshot").json()["capacity"]
            assert held["cpu_millis"]["allocated"] == baseline["cpu_millis"]["allocated"] + 500
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    assert any(p.is_running() for p in orphans), "the orphans outlived the daemon"

    with spawned(_serve(tmp_path, "sim"), env) as second:
        url = wait_for_line(second, LISTENING)
        with httpx.Client(base_url=url, headers=operator, timeout=10) as client:
            _wait_ready(client)
            _gone, alive = psutil.wait_procs(orphans, timeout=10)
            assert not alive, f"orphans left running: {alive}"
            capacity = client.get("/v1/snapshot").json()["capacity"]
            assert capacity["cpu_millis"] == baseline["cpu_millis"]
            assert capacity["memory_bytes"] == baseline["memory_bytes"]
            assert capacity["vram_bytes"] == baseline["vram_bytes"]
            refused = client.post(
                f"/v1/lanes/{lane_id}/work",
                json={"op": "execute", "kernel": "noop"},
                headers={"Authorization": f"Bearer {token}"},
            )
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "unknown_key"
        assert stop(second, signal.SIGTERM) == 0


def _echo(text: str) -> dict[str, object]:
    return {
        "id": "once-only",
        "work": {"kind": "process", "argv": ["sh", "-c", f"echo {text}"]},
        "resources": {"cpu_millis": 100, "memory_bytes": 2**26},
    }


def _wait_ended(client: httpx.Client, invocation_id: str) -> dict[str, object]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        status: dict[str, object] = client.get(f"/v1/invocations/{invocation_id}").json()
        if status["state"] not in ("queued", "running"):
            return status
        time.sleep(0.02)
    raise AssertionError(f"{invocation_id} never ended")


def test_an_id_resubmitted_after_a_restart_answers_its_outcome_and_does_not_run_again(
    tmp_path: pathlib.Path,
) -> None:
    env = clean_env()
    with spawned(_serve(tmp_path), env) as first:
        url, operator = _ready(first, tmp_path)
        with httpx.Client(base_url=url, headers=operator, timeout=10) as client:
            assert client.post("/v1/invocations", json=_echo("hi")).status_code == 202
            ended = _wait_ended(client, "once-only")
            assert ended["state"] == "succeeded"
        assert stop(first, signal.SIGTERM) == 0

    with spawned(_serve(tmp_path), env) as second:
        url = wait_for_line(second, LISTENING)
        with httpx.Client(base_url=url, headers=operator, timeout=10) as client:
            _wait_ready(client)
            for _ in range(3):
                again = client.post("/v1/invocations", json=_echo("hi"))
                assert again.status_code == 202, again.text
                assert again.json()["state"] == "succeeded" and again.json()["tokens"] == {}
            status = client.get("/v1/invocations/once-only").json()
            assert status["state"] == "succeeded" and status["ended_at"] == ended["ended_at"]
            assert status["stdout_bytes"] == ended["stdout_bytes"] == 3
            other = client.post("/v1/invocations", json=_echo("bye"))
            assert other.status_code == 409 and other.json()["error"]["code"] == "id_conflict"
            assert client.get("/v1/snapshot").json()["capacity"]["cpu_millis"]["allocated"] == 0
        assert stop(second, signal.SIGTERM) == 0


def test_an_id_cut_off_by_a_crash_answers_node_restarted_and_does_not_run_again(
    tmp_path: pathlib.Path,
) -> None:
    shared = guest_cwd()
    shared.chmod(0o777)  # the guest runs as a uid of its own and writes here
    marker = shared / "runs"
    body = {
        "id": "cut-off",
        "work": {
            "kind": "process",
            "argv": ["sh", "-c", "echo run >> runs; sleep 300"],
            "cwd": str(shared),  # bound into the sandbox
        },
        "resources": {"cpu_millis": 100, "memory_bytes": 2**26},
    }
    # Its marker is a host write: allowed under that root only.
    env = clean_env(LITEGRAPH_NODE_GUEST_WRITABLE_ROOTS=json.dumps([str(shared)]))
    with spawned(_serve(tmp_path), env) as first:
        url, operator = _ready(first, tmp_path)
        with httpx.Client(base_url=url, headers=operator, timeout=10) as client:
            assert client.post("/v1/invocations", json=body).status_code == 202
            deadline = time.monotonic() + 20
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert marker.exists(), "the guest never ran"
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)

    with spawned(_serve(tmp_path), env) as second:
        url = wait_for_line(second, LISTENING)
        with httpx.Client(base_url=url, headers=operator, timeout=10) as client:
            _wait_ready(client)
            again = client.post("/v1/invocations", json=body)
            assert again.status_code == 202, again.text
            assert (again.json()["state"], again.json()["tokens"]) == ("failed", {})
            status = client.get("/v1/invocations/cut-off").json()
            assert (status["state"], status["reason"]) == ("failed", "node_restarted")
            other = client.post("/v1/invocations", json={**body, "timeout_s": 5.0})
            assert other.status_code == 409 and other.json()["error"]["code"] == "id_conflict"
            # Nothing runs again: no invocation is live (a rerun would be: it ends in
            # `sleep 300`), nothing is reserved, and the one line is the first run's.
            listed = client.get("/v1/invocations").json()["invocations"]
            assert [(s["id"], s["state"]) for s in listed] == [("cut-off", "failed")]
            assert client.get("/v1/snapshot").json()["capacity"]["cpu_millis"]["allocated"] == 0
            assert marker.read_text() == "run\n"
        assert stop(second, signal.SIGTERM) == 0


def _listed(client: httpx.Client, **params: object) -> list[dict[str, object]]:
    reply = client.get("/v1/invocations", params={"limit": 500, **params})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["next_cursor"] is None
    invocations: list[dict[str, object]] = body["invocations"]
    return invocations


def _kept(status: dict[str, object]) -> dict[str, object]:
    """What a restart keeps of a status: everything but the output text."""
    return {**status, "stdout_tail": "", "stderr_tail": ""}


def test_history_is_listed_and_readable_after_a_clean_stop_and_after_a_crash(
    tmp_path: pathlib.Path,
) -> None:
    def process(invocation_id: str, script: str) -> dict[str, object]:
        return {
            "id": invocation_id,
            "work": {"kind": "process", "argv": ["sh", "-c", script]},
            "resources": {"cpu_millis": 100, "memory_bytes": 2**26},
        }

    env = clean_env()
    with spawned(_serve(tmp_path), env) as first:
        url, operator = _ready(first, tmp_path)
        with httpx.Client(base_url=url, headers=operator, timeout=10) as client:
            for body in (process("said-hi", "echo hi"), process("exit-3", "exit 3")):
                assert client.post("/v1/invocations", json=body).status_code == 202
                _wait_ended(client, str(body["id"]))
            sleeper = process("cancelled", "sleep 300")
            assert client.post("/v1/invocations", json=sleeper).status_code == 202
            assert client.delete("/v1/invocations/cancelled").status_code == 200
            ended = {s["id"]: s for s in _listed(client)}
        assert stop(first, signal.SIGTERM) == 0

    assert (ended["said-hi"]["state"], ended["said-hi"]["exit_code"]) == ("succeeded", 0)
    assert (ended["exit-3"]["state"], ended["exit-3"]["exit_code"]) == ("failed", 3)
    assert ended["exit-3"]["reason"] == "nonzero_exit"
    assert (ended["cancelled"]["state"], ended["cancelled"]["reason"]) == (
        "cancelled",
        "cancel_requested",
    )
    with spawned(_serve(tmp_path), env) as second:
        url = wait_for_line(second, LISTENING)
        with httpx.Client(base_url=url, headers=operator, timeout=10) as client:
            _wait_ready(client)
            listed = _listed(client)
            assert [s["id"] for s in listed] == ["cancelled", "exit-3", "said-hi"]
            for status in listed:
                assert status == _kept(ended[str(status["id"])])
                assert client.get(f"/v1/invocations/{status['id']}").json() == status
            assert [s["id"] for s in _listed(client, state="failed")] == ["exit-3"]
            # Cut off by a crash: the next start lists it as ended with the daemon.
            assert client.post("/v1/invocations", json=sleeper | {"id": "cut"}).status_code == 202
            deadline = time.monotonic() + 10
            while client.get("/v1/invocations/cut").json()["state"] != "running":
                assert time.monotonic() < deadline, "cut never ran"
                time.sleep(0.02)
        second.send_signal(signal.SIGKILL)
        second.wait(timeout=10)

    with spawned(_serve(tmp_path), env) as third:
        url = wait_for_line(third, LISTENING)
        with httpx.Client(base_url=url, headers=operator, timeout=10) as client:
            _wait_ready(client)
            listed = _listed(client)
            assert [s["id"] for s in listed] == ["cut", "cancelled", "exit-3", "said-hi"]
            assert (listed[0]["state"], listed[0]["reason"]) == ("failed", "node_restarted")
            assert listed[0]["ended_at"] is not None
            assert listed[1:] == [_kept(ended[str(s["id"])]) for s in listed[1:]]
        assert stop(third, signal.SIGTERM) == 0


def test_a_journal_emptied_after_acknowledged_work_stops_start_up_unless_accepted(
    tmp_path: pathlib.Path,
) -> None:
    env = clean_env()
    body = {
        "id": "ran-once",
        "work": {"kind": "process", "argv": ["sh", "-c", "echo hi"]},
        "resources": {"cpu_millis": 100, "memory_bytes": 2**26},
    }
    with spawned(_serve(tmp_path), env) as first:
        url, operator = _ready(first, tmp_path)
        with httpx.Client(base_url=url, headers=operator, timeout=10) as client:
            assert client.post("/v1/invocations", json=body).status_code == 202
            _wait_ended(client, "ran-once")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    journal = tmp_path / "reservations.journal"
    journal.write_bytes(b"")  # lost: the id that ran would be forgotten and run again

    refused = subprocess.run(
        _serve(tmp_path), env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert refused.returncode == 1, refused.stderr
    assert "Traceback" not in refused.stderr, refused.stderr
    (line,) = [x for x in refused.stderr.splitlines() if "cannot start" in x]
    prefix = (
        f"litegraph-node: cannot start: journal {journal} holds 0 records, {journal}.mark says "
    )
    assert line.startswith(prefix), line
    acknowledged = int(line.removeprefix(prefix).split()[0])
    assert acknowledged >= 3  # reserve, then its ending: release, process_ended, ended
    assert line.endswith(" were acknowledged; --accept-journal-loss to start anyway"), line
    assert journal.read_bytes() == b""

    with spawned([*_serve(tmp_path), "--accept-journal-loss"], env) as accepted:
        url = wait_for_line(accepted, LISTENING)
        with httpx.Client(base_url=url, headers=operator, timeout=10) as client:
            _wait_ready(client)
        assert stop(accepted, signal.SIGTERM) == 0
        lines = rest_of_stderr(accepted)
    assert any(
        "--accept-journal-loss" in x and f"says {acknowledged} were acknowledged" in x
        for x in lines
    ), lines
