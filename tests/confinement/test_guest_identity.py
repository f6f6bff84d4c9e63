"""Each guest runs as a uid of its own, never root, never the daemon's user; it cannot
reach the node's secrets, another guest's environment or token file, or signal it."""

from __future__ import annotations

import errno
import os
import pathlib
import subprocess

import pytest
import trio

from supervisor.identity import become
from supervisor.process_env import GUEST_PATH
from tests.adversarial.fixtures import Node
from tests.confinement.guests import (
    GUEST_PYTHON,
    confined_node,
    guest_pid,
    python,
    run_to_end,
    status,
    uid_of,
)

READ_SECRETS = """
import os, sys
state = sys.argv[1]
for path in (state + "/auth.json", state + "/reservations.journal", state + "/keys",
             state + "/logs"):
    try:
        if os.path.isdir(path):
            print("LISTED", path, os.listdir(path))
        else:
            print("READ", path, len(open(path, "rb").read()))
    except OSError as exc:
        print("DENIED", path, exc.errno)
"""


def as_uid(uid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run argv on the host as `uid` (no namespace): what one guest uid may do to another."""

    def drop() -> None:
        become(uid)

    return subprocess.run(
        argv, preexec_fn=drop, capture_output=True, text=True, timeout=30, check=False, cwd="/"
    )


def state_dir(node: Node) -> str:
    return node.daemon.config.state_dir


@pytest.mark.parametrize("isolation", ["sandbox", "shared"])
async def test_a_guest_cannot_read_the_auth_file_keys_or_journal(
    tmp_path: pathlib.Path, isolation: str
) -> None:
    async with confined_node(tmp_path) as node:
        state = state_dir(node)
        body = python(READ_SECRETS, isolation=isolation)
        body["work"]["argv"].append(state)
        found = await run_to_end(node, body)
        assert found["state"] == "succeeded", found
        out = found["stdout_tail"]
        assert "READ" not in out and "LISTED" not in out, out
        assert out.count("DENIED") == 4, out


async def test_a_guest_runs_as_its_own_uid_never_root_nor_the_daemons(
    tmp_path: pathlib.Path,
) -> None:
    async with confined_node(tmp_path) as node:
        await node.submit(python("import time; time.sleep(60)  # guest-a", invocation_id="a"))
        await node.submit(python("import time; time.sleep(60)  # guest-b", invocation_id="b"))
        a = await guest_pid(node, "a", "guest-a")
        b = await guest_pid(node, "b", "guest-b")
        uid_a, uid_b = uid_of(a), uid_of(b)
        assert uid_a != uid_b
        assert os.geteuid() not in (uid_a, uid_b) and 0 not in (uid_a, uid_b)


async def test_one_guest_cannot_read_or_signal_another(tmp_path: pathlib.Path) -> None:
    async with confined_node(tmp_path) as node:
        secret = "s3cr3t-of-a"
        await node.submit(
            python("import time; time.sleep(60)  # guest-a", invocation_id="a", env={"S": secret})
        )
        await node.submit(python("import time; time.sleep(60)  # guest-b", invocation_id="b"))
        a = await guest_pid(node, "a", "guest-a")
        b = await guest_pid(node, "b", "guest-b")
        token_file = trio.Path(f"/proc/{a}/root/run/litegraph/tokens")
        assert (await token_file.read_text()).startswith("v4.public.")  # root sees it
        probe = as_uid(
            uid_of(b),
            GUEST_PYTHON,
            "-c",
            "import os, sys\n"
            "a, tokens = int(sys.argv[1]), sys.argv[2]\n"
            "for what, act in (('environ', lambda: open(f'/proc/{a}/environ').read()),\n"
            "                  ('tokens', lambda: open(tokens).read()),\n"
            "                  ('signal', lambda: os.kill(a, 0))):\n"
            "    try:\n"
            "        act(); print(what, 'ALLOWED')\n"
            "    except OSError as exc:\n"
            "        print(what, exc.errno)\n",
            str(a),
            str(token_file),
        )
        assert probe.returncode == 0, probe.stderr
        lines = dict(line.split() for line in probe.stdout.splitlines())
        assert lines == {
            "environ": str(errno.EACCES),
            "tokens": str(errno.EACCES),
            "signal": str(errno.EPERM),
        }, probe.stdout
        # Inside its sandbox, b does not even see a's processes.
        await node.client.delete("/v1/invocations/b", headers=node.op)
        seen = await run_to_end(
            node, python("import os; print(sorted(p for p in os.listdir('/proc') if p.isdigit()))")
        )
        assert str(a) not in seen["stdout_tail"].split("'")
        assert (await status(node, "a"))["state"] == "running"


async def test_a_guests_path_is_the_fixed_one_whatever_the_daemons_path_holds(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", f"/root/.local/bin:/opt/daemon-tools/bin:{os.environ['PATH']}")
    show = "import os; print(os.environ['PATH'])"
    async with confined_node(tmp_path) as node:
        for isolation in ("sandbox", "shared"):
            found = await run_to_end(node, python(show, isolation=isolation))
            assert found["stdout_tail"].strip() == GUEST_PATH, found
        own = await run_to_end(node, python(show, env={"PATH": "/usr/bin"}))
        assert own["stdout_tail"].strip() == "/usr/bin", own  # its request may set its own
