"""litegraph-gate, the helper every confined guest starts through (native/litegraph-gate.c):
its gate runs nothing until its line comes, takes the guest's uid with no group and no
capability, and its stage runs only a whole, well-formed message."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from supervisor.gate import (
    GATE_NAME,
    find_gate,
    gate_argv,
    install_keeper,
    stage_argv,
    stage_message,
)
from supervisor.launch import GATE_SHELL, plan
from supervisor.sandbox import SandboxSpec

GATE = pathlib.Path(sys.executable).parent / GATE_NAME
pytestmark = pytest.mark.skipif(
    not GATE.exists(), reason="litegraph-gate is not built (make builds it with cc)"
)
UID = 300777


def _run(argv: list[str], given: bytes) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, input=given, capture_output=True, timeout=30, check=False)


def test_the_gate_runs_nothing_when_its_pipe_closes_before_the_line(
    tmp_path: pathlib.Path,
) -> None:
    mark = tmp_path / "ran"
    argv = [*gate_argv(GATE, None), "/bin/sh", "-c", f"touch {mark}"]
    for given in (b"", b"no newline yet"):
        done = _run(argv, given)
        assert done.returncode == 126, done
        assert not mark.exists()
    assert _run(argv, b"\n").returncode == 0 and mark.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="taking another uid needs root")
def test_the_gate_takes_the_uid_with_no_group_and_no_capability() -> None:
    argv = [
        *gate_argv(GATE, UID),
        "/bin/sh",
        "-c",
        "id -u; id -g; id -G; grep ^Cap /proc/self/status",
    ]
    done = _run(argv, b"\n")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.decode().splitlines()
    assert lines[:3] == [str(UID), str(UID), str(UID)]  # `id -G` shows the gid alone
    caps = dict(line.split(":\t") for line in lines[3:])
    for name in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        assert int(caps[name], 16) == 0, caps
    # And it keeps its stdin for a stage only when asked.
    keep = [*gate_argv(GATE, None, keep_stdin=True), "/bin/cat"]
    assert _run(keep, b"\nafter the line").stdout == b"after the line"
    assert _run([*gate_argv(GATE, None), "/bin/cat"], b"\nafter the line").stdout == b""


def test_the_gate_refuses_a_relative_program_and_a_bad_uid() -> None:
    assert _run([*gate_argv(GATE, None), "true"], b"\n").returncode == 125
    assert _run([str(GATE), "gate", "-u", "0", "--", "/bin/true"], b"\n").returncode == 125
    assert _run([str(GATE), "gate", "-u", "12x", "--", "/bin/true"], b"\n").returncode == 125


def test_the_stage_runs_a_whole_message_with_exactly_its_environment(
    tmp_path: pathlib.Path,
) -> None:
    tokens = tmp_path / "tokens"
    env = {"PATH": "/usr/bin:/bin", "ODD": "two\nlines and = signs"}
    message = stage_message(["env", "-0"], env, b"t1\n")
    done = _run([str(GATE), "stage", str(tokens)], message)
    assert done.returncode == 0, done.stderr
    # Found on the guest's PATH, with that environment and PWD (as bwrap sets it after
    # its --chdir); nothing of the daemon's or the stage's own reaches it.
    shown = dict(entry.split("=", 1) for entry in done.stdout.decode().split("\0") if entry)
    assert shown == {**env, "PWD": os.getcwd()}
    assert tokens.read_bytes() == b"t1\n" and tokens.stat().st_mode & 0o777 == 0o400


def test_the_stage_runs_nothing_of_a_message_cut_short_or_malformed(
    tmp_path: pathlib.Path,
) -> None:
    tokens = tmp_path / "tokens"
    whole = stage_message(["/bin/sh", "-c", f"touch {tmp_path / 'ran'}"], {}, b"t\n")
    for given in (
        b"",
        whole[:-3],  # the closing "." never came: the daemon died while writing
        whole[: whole.index(b"A")],  # the command never came
        whole.replace(b"litegraph-stage-1", b"litegraph-stage-0"),
        whole[:-1],  # not NUL-terminated
        whole.replace(b"\0A/bin/sh", b"\0X/bin/sh"),
        whole + b"A-more\0",  # a record after the end
    ):
        done = _run([str(GATE), "stage", str(tokens)], given)
        assert done.returncode == 126, (given, done)
        assert not (tmp_path / "ran").exists() and not tokens.exists()


def test_a_missing_command_fails_as_bwrap_would_say_it() -> None:
    message = stage_message(["no-such-command-here"], {"PATH": "/usr/bin:/bin"}, b"")
    done = _run([str(GATE), *stage_argv("/nonexistent/tokens")[1:]], message)
    assert done.returncode == 127
    assert b"execvp no-such-command-here" in done.stderr


def test_a_guest_starts_through_the_gate_where_it_is_built_else_the_shell_and_setpriv() -> None:
    bwrap = pathlib.Path("/usr/bin/bwrap")
    if not bwrap.exists():
        pytest.skip("bubblewrap is not installed")
    with_gate = plan(
        ["true"], env={}, sandbox=SandboxSpec(bwrap=bwrap, gate=GATE), uid=UID, cgroup=None
    )
    without = plan(["true"], env={}, sandbox=SandboxSpec(bwrap=bwrap), uid=UID, cgroup=None)
    try:
        assert with_gate.argv[: len(gate_argv(GATE, UID))] == gate_argv(GATE, UID)
        assert "setpriv" not in " ".join(with_gate.argv) and GATE_SHELL[2] not in with_gate.argv
        assert list(without.argv[: len(GATE_SHELL)]) == list(GATE_SHELL)
        assert any(arg.endswith("setpriv") for arg in without.argv)
    finally:
        with_gate.close()
        without.close()
    assert find_gate() == GATE


def _sandboxed(keeper: pathlib.Path, script: str) -> subprocess.CompletedProcess[bytes]:
    bwrap = pathlib.Path("/usr/bin/bwrap")
    if not bwrap.exists():
        pytest.skip("bubblewrap is not installed")
    spec = SandboxSpec(bwrap=bwrap, gate=GATE, keeper=keeper)
    launch = plan(
        ["sh", "-c", script], env={"PATH": "/usr/bin:/bin"}, sandbox=spec, uid=UID, cgroup=None
    )
    try:
        return subprocess.run(
            launch.argv,
            env=launch.env,
            pass_fds=launch.pass_fds,
            input=b"\n",
            capture_output=True,
            timeout=30,
            check=False,
        )
    finally:
        launch.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="taking another uid needs root")
def test_a_gate_the_guest_uid_cannot_reach_keeps_its_guest_from_its_copy(
    tmp_path: pathlib.Path,
) -> None:
    # As for a venv in root's 0700 home: the guest's uid, which runs bwrap, cannot reach
    # the gate itself, only its copy in a run folder it may enter.
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    gate = private / GATE_NAME
    gate.write_bytes(GATE.read_bytes())
    run = pathlib.Path(tempfile.mkdtemp(prefix="litegraph-run-", dir="/tmp"))
    try:
        run.chmod(0o711)
        keeper = install_keeper(gate, run)
        assert keeper.parent == run and keeper.stat().st_mode & 0o777 == 0o555
        assert keeper.read_bytes() == GATE.read_bytes() and list(run.iterdir()) == [keeper]
        unreachable = _sandboxed(gate, "true")
        assert unreachable.returncode != 0 and b"Permission denied" in unreachable.stderr
        done = _sandboxed(keeper, "echo $PPID; exit 3")
        assert (done.returncode, done.stdout) == (3, b"2\n"), done.stderr  # pid 2: the keeper
        killed = _sandboxed(keeper, "kill -TERM $$")
        assert killed.returncode == 128 + 15, killed.stderr
    finally:
        shutil.rmtree(run)


def test_the_keeper_exits_with_its_guest_and_does_not_wait_for_what_it_left() -> None:
    # Not ending: a background process the guest left does not hold the keeper.
    script = "sleep 30 >/dev/null 2>&1 & echo $!; exit 4"
    done = _run([str(GATE), "keep", "--", "/bin/sh", "-c", script], b"")
    assert done.returncode == 4
    left = int(done.stdout)
    try:
        os.kill(left, 0)  # still alive: the sandbox's end (not the keeper) takes it
    finally:
        os.kill(left, 9)
    assert _run([str(GATE), "keep"], b"").returncode == 125


def test_the_keeper_waits_for_its_guest_whatever_sigchld_it_inherited() -> None:
    # With SIGCHLD ignored, children are reaped unseen and no exit status comes back.
    def ignore_sigchld() -> None:
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)

    done = subprocess.run(
        [str(GATE), "keep", "--", "/bin/sh", "-c", "exit 4"],
        preexec_fn=ignore_sigchld, capture_output=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 4, done.stderr
