"""`dev` run by a normal user: with subordinate uids every guest has a uid of its own;
without them every guest runs as that user, and the node says so.

The daemon here really is a normal user's: a test user (no account on the host: its
passwd, group, subuid and subgid lines lie in an overlay over /etc inside a private
mount namespace, so the host's files never change) runs `litegraph-node dev`, and
newuidmap and newgidmap, setuid root, read its ranges from that overlay. The test
reads the guests' uids from the host's /proc.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import trio

from tests.confinement.guests import (
    TERMINAL,
    WAIT_SECONDS,
    alive,
    descendants,
    guest_cwd,
    kill_all,
    python,
    uid_of,
    wait_gone,
)
from tests.confinement.test_guest_tokens import OWN_WORK, STOLEN_WORK, gpu_sandbox
from tests.helpers import ROOT, reveal_lines, spawned, wait_for_line

USER = "lgsubuid"
# Free uids and ranges: no account, apart from every test's --guest-uids.
DAEMON_UID = 64_777
EXTRA_GROUP = 64_778  # a supplementary group of the daemon's, which no guest keeps
SUBUIDS = range(410_000, 410_000 + 1000)
HELPERS = ("newuidmap", "newgidmap", "unshare", "nsenter", "setpriv")


def _missing() -> str | None:
    for tool in HELPERS:
        if shutil.which(tool, path="/usr/bin:/bin") is None:
            return f"needs {tool} (make test installs uidmap)"
    if any(entry.pw_uid == DAEMON_UID for entry in pwd.getpwall()):
        return f"uid {DAEMON_UID} has an account here"
    if os.geteuid() != 0:
        return "needs root: the test's daemon is a user root makes up"
    drop = ["setpriv", f"--reuid={DAEMON_UID}", f"--regid={DAEMON_UID}", "--clear-groups"]
    made = subprocess.run([*drop, "--", "unshare", "--user", "true"], check=False, cwd="/")
    if made.returncode != 0:
        return "this kernel lets no normal user make a user namespace (bubblewrap needs it)"
    return None


MISSING = _missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@dataclass
class NormalDev:
    """A `dev` daemon of the test user, and what the test needs to talk to it."""

    proc: subprocess.Popen[str]
    # What its start-up banner says guests run as.
    banner: str
    headers: dict[str, str]
    client: httpx.AsyncClient

    async def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        reply = await self.client.post("/v1/invocations", json=body, headers=self.headers)
        assert reply.status_code == 202, reply.text
        accepted: dict[str, Any] = reply.json()
        return accepted

    async def status(self, invocation_id: str) -> dict[str, Any]:
        reply = await self.client.get(f"/v1/invocations/{invocation_id}", headers=self.headers)
        assert reply.status_code == 200, reply.text
        found: dict[str, Any] = reply.json()
        return found

    async def wait_end(self, invocation_id: str) -> dict[str, Any]:
        with trio.fail_after(WAIT_SECONDS):
            while (found := await self.status(invocation_id))["state"] not in TERMINAL:  # noqa: ASYNC110
                await trio.sleep(0.05)
        return found

    async def notes(self) -> list[str]:
        reply = await self.client.get("/v1/snapshot", headers=self.headers)
        assert reply.status_code == 200, reply.text
        return list(reply.json()["notes"])

    async def guest_pid(self, marker: str) -> int:
        """The host pid of the guest process whose command line holds `marker`."""
        with trio.fail_after(WAIT_SECONDS):
            while True:
                for pid in descendants(self.proc.pid):
                    with contextlib.suppress(OSError):
                        cmdline = await trio.Path(f"/proc/{pid}/cmdline").read_bytes()
                        if marker.encode() in cmdline and b"bwrap" not in cmdline:
                            return pid
                await trio.sleep(0.05)


def _etc_overlay(folder: pathlib.Path, subids: str) -> pathlib.Path:
    """The files laid over /etc: the host's passwd and group with the test user added,
    and subuid and subgid holding `subids` alone."""
    etc = folder / "etc"
    etc.mkdir(mode=0o755)
    passwd = pathlib.Path("/etc/passwd").read_text()
    group = pathlib.Path("/etc/group").read_text()
    line = f"{USER}:x:{DAEMON_UID}:{DAEMON_UID}::/nonexistent:/usr/sbin/nologin\n"
    (etc / "passwd").write_text(passwd.rstrip("\n") + "\n" + line)
    (etc / "group").write_text(group.rstrip("\n") + f"\n{USER}:x:{DAEMON_UID}:\n")
    (etc / "subuid").write_text(subids)
    (etc / "subgid").write_text(subids)
    for name in ("passwd", "group", "subuid", "subgid"):
        (etc / name).chmod(0o644)
    return etc


def _script(etc: pathlib.Path, fix: pathlib.Path, argv: list[str], hide: tuple[str, ...]) -> str:
    """The private mount namespace's set-up, then the daemon as the test user."""
    lines = ["set -e", f"mount -t overlay overlay -o lowerdir={etc}:/etc /etc"]
    lines += [f"mount --bind /dev/null {shutil.which(tool)}" for tool in hide]
    # The clone, its venv and their Python may lie under root's 0700 home.
    lines += reveal_lines(fix, (ROOT, pathlib.Path(sys.prefix), pathlib.Path(sys.base_prefix)))
    groups = f"{DAEMON_UID},{EXTRA_GROUP}"
    drop = f"setpriv --reuid={DAEMON_UID} --regid={DAEMON_UID} --groups={groups} --"
    lines.append("exec " + drop + " " + " ".join(f"'{arg}'" for arg in argv))
    return "\n".join(lines)


@contextlib.contextmanager
def _folders() -> Iterator[pathlib.Path]:
    base = pathlib.Path(tempfile.mkdtemp(prefix="lg-subuid-"))
    try:
        base.chmod(0o755)  # guests enter the run dir inside it
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@contextlib.asynccontextmanager
async def normal_user_dev(
    *, subids: str, shared: pathlib.Path, hide: tuple[str, ...] = (), private_run: bool = False
) -> AsyncIterator[NormalDev]:
    """`litegraph-node dev` as the test user, `shared` its guests' writable root; the
    tools in `hide` are missing, and with `private_run` its run dir lies in a folder
    only it may enter (as its 0700 $XDG_RUNTIME_DIR is)."""
    with _folders() as base:
        etc = _etc_overlay(base, subids)
        fix = base / "root"
        fix.mkdir(mode=0o755)
        state, run = base / "state", base / "run"
        for folder in (state, run):
            folder.mkdir(mode=0o700)
            os.chown(folder, DAEMON_UID, DAEMON_UID)
        if private_run:
            run = run / "litegraph-node"
        roots = json.dumps([str(shared)])
        argv = [
            sys.executable,
            "-m",
            "node",
            "dev",
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            str(state),
            "--guest-run-dir",
            str(run),
            "--devices",
            "sim",
            "--max-running",
            "4",
            "--guest-cwd-roots",
            roots,
            "--guest-writable-roots",
            roots,
        ]
        command = ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c"]
        command.append(_script(etc, fix, argv, hide))
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(state)}
        with spawned(command, env) as proc:
            url = await trio.to_thread.run_sync(
                wait_for_line, proc, r"listening on (http://\S+)", 60.0
            )
            # dev's banner comes once the daemon has started.
            banner = await trio.to_thread.run_sync(wait_for_line, proc, r"guest uids:\s+(.*)", 60.0)
            secret = json.loads((state / "auth.json").read_text())["scheduler"]
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                node = NormalDev(proc, banner, {"Authorization": f"Bearer {secret}"}, client)
                try:
                    yield node
                finally:
                    guests = descendants(proc.pid)
                    proc.kill()
                    proc.wait(timeout=30)
                    # --die-with-parent: nothing of theirs outlives the daemon.
                    left = wait_gone(guests)
                    kill_all(left)
                    assert not left, left


def _groups(pid: int) -> list[str]:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Groups:"):
            return line.split()[1:]
    raise AssertionError(f"no Groups line for {pid}")


WRITE_SECRET = """
import os, time
fd = os.open("a.secret", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
os.write(fd, b"only a's")
os.close(fd)
print("WROTE", os.getuid(), flush=True)
time.sleep(60)  # guest-a
"""

READ_SECRET = """
import os, time
while not os.path.exists("a.secret"):
    time.sleep(0.05)
try:
    print("READ", open("a.secret").read())
except OSError as exc:
    print("DENIED", exc.errno)
try:
    os.remove("a.secret")
    print("REMOVED")
except OSError as exc:
    print("KEPT", exc.errno)
time.sleep(60)  # guest-b
"""


async def test_dev_as_a_normal_user_gives_each_guest_a_subordinate_uid_of_its_own() -> None:
    shared = guest_cwd()
    shared.chmod(0o1777)  # every guest may write here, and only remove its own files
    subids = f"# ranges\n{USER}:{SUBUIDS.start}:{len(SUBUIDS)}\nnobody:1:2\nbad line\n"
    async with normal_user_dev(subids=subids, shared=shared) as node:
        assert node.banner.startswith("one each of your subordinate uids"), node.banner
        notes = await node.notes()
        assert any(n.startswith("dev_guests_own_uids:") for n in notes), notes
        assert not any("dev_guests_share_uid" in n for n in notes), notes
        await node.submit(python(WRITE_SECRET, invocation_id="a", cwd=str(shared)))
        a = await node.guest_pid("guest-a")
        await node.submit(python(READ_SECRET, invocation_id="b", cwd=str(shared)))
        b = await node.guest_pid("guest-b")
        uid_a, uid_b = uid_of(a), uid_of(b)
        assert uid_a != uid_b, (uid_a, uid_b)
        assert uid_a in SUBUIDS and uid_b in SUBUIDS, (uid_a, uid_b)
        # No supplementary group of the daemon's reaches a guest.
        assert _groups(a) == [] and _groups(b) == [], (_groups(a), _groups(b))
        found = await trio.Path(shared / "a.secret").stat()
        assert (found.st_uid, found.st_mode & 0o777) == (uid_a, 0o600)
        with trio.fail_after(WAIT_SECONDS):
            while "KEPT" not in (await node.status("b"))["stdout_tail"]:  # noqa: ASYNC110
                await trio.sleep(0.05)
        out = (await node.status("b"))["stdout_tail"]
        assert "DENIED 13" in out and "READ" not in out and "KEPT 1" in out, out
        assert (await node.status("a"))["uid"] == uid_a
        # The daemon, a normal user, still ends a guest of another uid.
        reply = await node.client.delete("/v1/invocations/a", headers=node.headers)
        assert reply.status_code == 200, reply.text
        assert (await node.wait_end("a"))["state"] == "cancelled"
        assert not alive(a)
        # A new guest meanwhile gets yet another uid: the round goes on.
        await node.submit(python("import os; print(os.getuid())", invocation_id="c"))
        c = await node.wait_end("c")
        assert c["state"] == "succeeded", c
        assert int(c["stdout_tail"]) in SUBUIDS and int(c["stdout_tail"]) not in (uid_a, uid_b)


async def test_a_subordinate_uid_guests_token_works_from_its_uid_alone() -> None:
    """Through the node's socket, which a subordinate uid reaches: its own lane work is
    done, and the same token from another guest (another subordinate uid) is refused."""
    subids = f"{USER}:{SUBUIDS.start}:{len(SUBUIDS)}\n"
    async with normal_user_dev(subids=subids, shared=guest_cwd()) as node:
        owner = await node.submit(gpu_sandbox(OWN_WORK, invocation_id="owner"))
        with trio.fail_after(WAIT_SECONDS):
            while "TOKEN" not in (found := await node.status("owner"))["stdout_tail"]:  # noqa: ASYNC110
                await trio.sleep(0.05)
        assert found["uid"] in SUBUIDS, found
        code, reply = json.loads(found["stdout_tail"].splitlines()[0])["reply"]
        assert (code, reply.get("op")) == (200, "memory_reserve"), reply
        token = found["stdout_tail"].split("TOKEN ")[1].split()[0]
        thief = gpu_sandbox(STOLEN_WORK, invocation_id="thief")
        work = thief["work"]
        assert isinstance(work, dict)
        work["argv"] += [owner["lanes"][0]["lane_id"], token]
        await node.submit(thief)
        stolen = await node.wait_end("thief")
        assert stolen["uid"] in SUBUIDS and stolen["uid"] != found["uid"], stolen
        code, reply = json.loads(stolen["stdout_tail"])
        assert (code, reply["error"]["code"]) == (403, "wrong_holder"), reply


@pytest.mark.parametrize("missing", ["range", "newuidmap", "reachable_socket"])
async def test_dev_without_subordinate_uids_says_its_guests_share_its_uid(missing: str) -> None:
    """No range for the user, no newuidmap, or a guest that could not start under a
    subordinate uid (the node's socket where no other uid may reach it)."""
    shared = guest_cwd()
    subids = "" if missing == "range" else f"{USER}:{SUBUIDS.start}:{len(SUBUIDS)}\n"
    hide = ("newuidmap",) if missing == "newuidmap" else ()
    private = missing == "reachable_socket"
    async with normal_user_dev(
        subids=subids, shared=shared, hide=hide, private_run=private
    ) as node:
        assert node.banner.startswith("all as you"), node.banner
        notes = await node.notes()
        shares = [n for n in notes if n.startswith("dev_guests_share_uid:")]
        assert len(shares) == 1, notes
        why = {
            "range": f"no subordinate uids for {USER}",
            "newuidmap": "newuidmap not found",
            "reachable_socket": "a guest could not start under a subordinate uid",
        }[missing]
        assert why in shares[0] and "cannot switch users" in shares[0], shares
        await node.submit(python("import os; print(os.getuid())", invocation_id="one"))
        found = await node.wait_end("one")
        assert found["state"] == "succeeded", found
        assert int(found["stdout_tail"]) == DAEMON_UID
