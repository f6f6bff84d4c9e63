"""What a guest leaves under its uid meets no new tenant after a restart: the uid round
goes on where it stopped, and token files a killed daemon left are removed."""

from __future__ import annotations

import os
import pathlib
import signal
import time
from collections.abc import Callable

import httpx

from tests.adversarial.fixtures import subprocess_node
from tests.confinement.guests import TERMINAL as ENDED
from tests.confinement.guests import confined_node, python, run_to_end
from tests.helpers import clean_env

# Eight uids: every hand-out of both runs is seen, the start-up check's included.
# No ready sandboxes: they would take uids of the round ahead of the guests.
SMALL_RANGE = ("--guest-uids", "300200-300207", "--max-running", "2", "--sandbox-pool", "0")


async def _uids_of_guests(tmp_path: pathlib.Path, count: int) -> list[int]:
    """Start a daemon on `tmp_path`'s state, run `count` guests one after another, stop."""
    uids = []
    async with confined_node(tmp_path, *SMALL_RANGE) as node:
        for _ in range(count):
            found = await run_to_end(node, python("pass"))
            assert found["state"] == "succeeded", found
            uids.append(found["uid"])
    return uids


async def test_after_a_restart_no_guest_gets_a_uid_handed_out_before_until_the_range_wraps(
    tmp_path: pathlib.Path,
) -> None:
    before = await _uids_of_guests(tmp_path, 3)
    after = await _uids_of_guests(tmp_path, 4)
    # Each start's sandbox check takes one uid (300200, then 300204): the guests get
    # the rest in turn, and the bottom comes back only once the whole range went round.
    assert before == [300201, 300202, 300203]
    assert after == [300205, 300206, 300207, 300200]


def _tokens(run_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(run_dir.glob("guest-*.tokens"))


def _wait(what: str, check: Callable[[], object], seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.05)


def test_a_token_file_a_killed_daemon_left_is_removed_at_start_and_its_uid_not_reused(
    tmp_path: pathlib.Path,
) -> None:
    """A sandboxed guest's tokens never lie in the run dir (bubblewrap copies them in
    from a descriptor), so a SIGKILL leaves none; a file an older daemon or an
    unconfined guest left there is removed at the next start."""
    env = clean_env()  # one run dir for both daemons
    run_dir = pathlib.Path(env["LITEGRAPH_NODE_GUEST_RUN_DIR"])
    sleeper = python("import time; time.sleep(300)", invocation_id="sleeper")
    with subprocess_node(tmp_path, env=env) as (first, url, operator):
        with httpx.Client(base_url=url, headers=operator, timeout=10) as client:
            assert client.post("/v1/invocations", json=sleeper).status_code == 202
            _wait("running", lambda: client.get("/v1/invocations/sleeper").json()["uid"])
            killed_uid = client.get("/v1/invocations/sleeper").json()["uid"]
            assert _tokens(run_dir) == []  # nothing at a host path while it runs
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    assert _tokens(run_dir) == []
    stale = run_dir / f"guest-{7:032x}.tokens"  # as an unconfined guest's would be left
    stale.write_text("v4.public.x\n")
    os.chown(stale, killed_uid, killed_uid)
    stale.chmod(0o400)

    with subprocess_node(tmp_path, env=env) as (_second, url, operator):
        assert _tokens(run_dir) == []
        with httpx.Client(base_url=url, headers=operator, timeout=10) as client:
            body = python("pass", invocation_id="next")
            assert client.post("/v1/invocations", json=body).status_code == 202
            _wait("ended", lambda: client.get("/v1/invocations/next").json()["state"] in ENDED)
            found = client.get("/v1/invocations/next").json()
            assert found["state"] == "succeeded", found
            assert found["uid"] != killed_uid
