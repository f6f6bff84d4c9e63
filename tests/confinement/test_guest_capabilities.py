"""A daemon started the way deploy/litegraph-node.service starts it (a system user
holding CAP_SETUID, CAP_SETGID, CAP_CHOWN and CAP_KILL as ambient capabilities)
hands none of them to its guests, and its sandbox works."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import pytest

from tests.helpers import GUEST_PYTHON, reveal_lines

ROOT = pathlib.Path(__file__).resolve().parents[2]
DAEMON_UID = 64_999  # a system-user stand-in, outside --guest-uids
GUEST_UID = 200_123
UNIT_CAPS = "+setuid,+setgid,+chown,+kill"

# Run by the system Python as DAEMON_UID: the real spawn hook and start-up check.
PROBE = f"""
import pathlib, shutil, subprocess, sys
sys.path[:0] = sys.argv[1:]
import trio
from node.guests import _sandbox_works
from supervisor.launch import _preexec

status = subprocess.run(
    ["grep", "^Cap", "/proc/self/status"], preexec_fn=_preexec(None, None, None, {GUEST_UID}),
    capture_output=True, text=True, check=True, cwd="/",
).stdout
print(status, end="")
bwrap = shutil.which("bwrap")
print("SANDBOX", trio.run(_sandbox_works, pathlib.Path(bwrap), {GUEST_UID}))
"""


# The same daemon's usual way: its vforked gate execs setpriv, which takes the guest's uid.
SETPRIV_PROBE = f"""
import subprocess, sys
sys.path[:0] = sys.argv[1:]
from supervisor.launch import find_setpriv, uid_drop

print(subprocess.run(
    [*uid_drop(find_setpriv(), {GUEST_UID}), "grep", "^Cap", "/proc/self/status"],
    capture_output=True, text=True, check=True, cwd="/",
).stdout, end="")
"""


# The same daemon starting a lane host: trusted code, but it needs no capability either.
HOST_PROBE = """
import os, subprocess, sys
sys.path[:0] = sys.argv[1:]
from supervisor.lane_host_process import _die_with_parent

print(subprocess.run(
    ["grep", "^Cap", "/proc/self/status"], preexec_fn=_die_with_parent(os.getpid()),
    capture_output=True, text=True, check=True, cwd="/",
).stdout, end="")
"""


def _capabilities(status: str) -> dict[str, int]:
    return {
        name: int(value, 16)
        for name, value in (
            line.split(":") for line in status.splitlines() if line.startswith("Cap")
        )
    }


def _as_unit_daemon(probe: str = PROBE) -> subprocess.CompletedProcess[str]:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("needs setpriv (util-linux) to hold ambient capabilities")
    version = subprocess.run(
        [GUEST_PYTHON, "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    if version != str(sys.version_info[:2]):
        pytest.skip(f"{GUEST_PYTHON} is {version}, not the test's Python: cannot load the project")
    paths = {str(ROOT), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    daemon = [
        setpriv,
        f"--reuid={DAEMON_UID}",
        f"--regid={DAEMON_UID}",
        "--clear-groups",
        f"--inh-caps={UNIT_CAPS}",
        f"--ambient-caps={UNIT_CAPS}",
        f"--bounding-set=-all,{UNIT_CAPS}",
        GUEST_PYTHON,
        "-c",
        probe,
        *sorted(paths),
    ]
    # The clone and its venv may lie under root's 0700 home: shown to DAEMON_UID in a
    # mount namespace of the probe's own.
    with tempfile.TemporaryDirectory(prefix="lg-caps-") as fix:
        os.chmod(fix, 0o755)  # noqa: S103 - DAEMON_UID enters the trees inside
        lines = [*reveal_lines(pathlib.Path(fix), map(pathlib.Path, paths)), 'exec "$@"']
        argv = ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c"]
        argv += ["\n".join(["set -e", *lines]), "probe", *daemon]
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=60, check=False, cwd="/"
        )


def _probe_holds_no_capability(probe_code: str) -> subprocess.CompletedProcess[str]:
    probe = _as_unit_daemon(probe_code)
    assert probe.returncode == 0, probe.stderr
    caps = _capabilities(probe.stdout)
    for name in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        assert caps[name] == 0, probe.stdout
    return probe


def test_a_daemon_with_the_units_ambient_capabilities_gives_none_to_its_guests() -> None:
    probe = _probe_holds_no_capability(PROBE)
    # bubblewrap refuses to run with capabilities it did not get from setuid.
    assert "SANDBOX None" in probe.stdout, probe.stdout


def test_setpriv_run_by_that_daemon_leaves_its_guests_no_capability() -> None:
    _probe_holds_no_capability(SETPRIV_PROBE)


def test_a_lane_host_started_by_that_daemon_holds_no_capability() -> None:
    _probe_holds_no_capability(HOST_PROBE)
